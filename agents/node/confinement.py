"""The node agent's work: the kernel resources each sandbox runs in, and taking them back.

A sandbox's confinement is its cgroups (limits, and the v2 directory that later carries BPF
programs) and its network namespace. Both outlive this process, so a restarted agent
lists what the kernel holds and removes whatever no live sandbox record owns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from agents.node.egress import Egress
from sandfleet.kernel import cgroups, netns
from sandfleet.store import SandboxStore
from schemas.node import Confinement, ConfineRequest

log = logging.getLogger("sandfleet.agent")


@dataclass
class NodeConfinement:
    layout: cgroups.CgroupLayout
    node_id: str
    egress: Egress

    def confine(self, req: ConfineRequest) -> Confinement:
        group = cgroups.SandboxCgroups(self.layout, self.node_id, req.sandbox_id)
        group.create(cpu=req.cpu, memory_mb=req.memory_mb, pids=req.pids)
        try:
            self.egress.attach(group.v2_dir)  # before any sandbox process exists
            ns = netns.create(self.node_id, req.sandbox_id)
        except Exception:
            self.egress.detach(group.v2_dir)
            group.remove()
            raise
        return Confinement(
            sandbox_id=req.sandbox_id, cgroup_procs=group.procs_files, cgroup_v2=group.v2_dir, netns=ns
        )

    def release(self, sandbox_id: str) -> bool:
        group = cgroups.SandboxCgroups(self.layout, self.node_id, sandbox_id)
        group.kill()
        self.egress.detach(group.v2_dir)
        group.remove()
        netns.remove(self.node_id, sandbox_id)
        return True

    def held(self) -> set[str]:
        """Sandbox ids this node holds kernel resources for."""
        return set(cgroups.list_sandboxes(self.layout, self.node_id)) | set(netns.list_sandboxes(self.node_id))

    async def reconcile(self, store: SandboxStore) -> list[str]:
        """Remove what no live record of this node owns; police what stays."""
        live = {r.id for r in await store.all(self.node_id)}
        held = self.held()
        orphans = sorted(held - live)
        for sandbox_id in orphans:
            await asyncio.to_thread(self.release, sandbox_id)
            log.info("reclaimed orphaned confinement of %s", sandbox_id)
        kept = [cgroups.SandboxCgroups(self.layout, self.node_id, s).v2_dir for s in sorted(held & live)]
        self.egress.take_over([d for d in kept if os.path.isdir(d)], self.layout.node_dirs(self.node_id)[-1])
        return orphans

    def release_everything(self) -> None:
        for sandbox_id in cgroups.list_sandboxes(self.layout, self.node_id):
            self.release(sandbox_id)
        cgroups.remove_node_root(self.layout, self.node_id)

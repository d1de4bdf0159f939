"""The node agent's work: the kernel resources each sandbox runs in, and taking them back.

A sandbox's confinement is its cgroups (limits, and the v2 directory that carries the BPF
programs), its network namespace and, when its spec allows egress, a veth with its rules
in the BPF maps and its names at the DNS stub (agents/node/network.py), and its AppArmor
profile where the kernel runs AppArmor (agents/node/apparmor.py). All of it outlives
this process, so a restarted agent lists what the kernel holds, removes whatever no live
sandbox record owns, and refills the rules of the sandboxes that live on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from agents.node.allow_rules import AllowList, parse_allow
from agents.node.apparmor import SandboxProfiles
from agents.node.egress import Egress
from agents.node.limits_watch import ViolationWatch
from agents.node.network import EgressNetwork
from sandfleet.errors import ServiceError
from linuxnode import cgroups, netns
from sandfleet.store import SandboxStore
from sandfleet import telemetry
from sandfleet.telemetry import SANDBOX_ID
from schemas.errors import ErrorCode
from schemas.node import Confinement, ConfineRequest
from schemas.sandbox import ENDED, SandboxRecord

log = logging.getLogger("sandfleet.agent")


def parse_rules(allow: list[str]) -> AllowList:
    """The sandbox's allowlist, or the typed error the creator gets for a bad rule."""
    try:
        return parse_allow(allow)
    except ValueError as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(exc)) from None


@dataclass
class NodeConfinement:
    layout: cgroups.CgroupLayout
    node_id: str
    egress: Egress
    network: EgressNetwork | None = None  # None: BPF is off here, so no sandbox gets egress
    watch: ViolationWatch | None = None  # syscall and limit violations (agents/node/limits_watch.py)
    profiles: SandboxProfiles = SandboxProfiles(False, "off")  # AppArmor, where the kernel runs it

    def check_egress(self, req: ConfineRequest) -> AllowList:
        rules = parse_rules(req.allow)
        if (rules.domains or rules.networks) and self.network is None:
            raise ServiceError(ErrorCode.UNSUPPORTED, f"egress allowlists are off on node {self.node_id}: "
                                                      f"{self.egress.status}")
        return rules

    def confine(self, req: ConfineRequest) -> Confinement:
        rules = self.check_egress(req)
        group = cgroups.SandboxCgroups(self.layout, self.node_id, req.sandbox_id)
        with telemetry.phase("agent.cgroups"):
            group.create(cpu=req.cpu, memory_mb=req.memory_mb, pids=req.pids)
        address = ""
        try:
            with telemetry.phase("agent.bpf_attach"):
                cg = self.egress.attach(group.v2_dir)  # before any sandbox process exists
            with telemetry.phase("agent.netns"):
                ns = netns.create(self.node_id, req.sandbox_id)
            if rules.domains or rules.networks:
                assert self.network is not None and cg is not None
                address = str(self.network.setup(req.sandbox_id, ns, cg, rules).address.ip)
            with telemetry.phase("agent.apparmor"):
                profile = self.profiles.load(req.sandbox_id, req.host_view, req.build)
        except Exception:
            self.profiles.unload(req.sandbox_id)
            if self.network is not None:
                self.network.teardown(req.sandbox_id)
            self.egress.detach(group.v2_dir)
            group.remove()
            netns.remove(self.node_id, req.sandbox_id)
            raise
        self.egress.labels[req.sandbox_id] = dict(req.labels)
        if self.watch is not None:
            try:
                self.watch.add(req.sandbox_id)  # its cgroups exist and no process of it has run yet
            except Exception:
                self.release(req.sandbox_id)
                raise
        return Confinement(
            sandbox_id=req.sandbox_id, cgroup_procs=group.procs_files, cgroup_v2=group.v2_dir, netns=ns,
            address=address, apparmor_profile=profile,
        )

    def release(self, sandbox_id: str) -> bool:
        if self.watch is not None:
            self.watch.remove(sandbox_id)
        group = cgroups.SandboxCgroups(self.layout, self.node_id, sandbox_id)
        group.kill()
        if self.network is not None:
            self.network.teardown(sandbox_id)
        self.egress.detach(group.v2_dir)
        group.remove()
        netns.remove(self.node_id, sandbox_id)
        self.profiles.unload(sandbox_id)  # after its last process is gone
        self.egress.labels.pop(sandbox_id, None)
        return True

    def held(self) -> set[str]:
        """Sandbox ids this node holds kernel resources for."""
        return (set(cgroups.list_sandboxes(self.layout, self.node_id)) | set(netns.list_sandboxes(self.node_id))
                | self.profiles.held())

    async def reconcile(self, store: SandboxStore) -> list[str]:
        """Remove what no live record of this node owns; police what stays."""
        records = {r.id: r for r in await store.all(self.node_id)}
        held = self.held()
        orphans = []
        for sandbox_id in sorted(held - set(records)):
            # A KV key listing can miss a key written a moment ago; ask for the record itself
            # before taking a sandbox's kernel resources away.
            if (live := await _live_record(store, sandbox_id, self.node_id)) is not None:
                records[sandbox_id] = live
            else:
                orphans.append(sandbox_id)
        for sandbox_id in orphans:
            await asyncio.to_thread(self.release, sandbox_id)
            log.info("reclaimed orphaned confinement of %s", sandbox_id, extra={SANDBOX_ID: sandbox_id})
        kept = {s: cgroups.SandboxCgroups(self.layout, self.node_id, s).v2_dir for s in sorted(held & set(records))}
        kept = {s: d for s, d in kept.items() if os.path.isdir(d)}
        for d in kept.values():
            self.egress.attach(d)  # ours first, so the sandbox is never unpoliced
        if self.watch is not None:
            self.watch.take_over(list(kept))
        if self.network is not None:
            await self._reconnect(records, kept)
        self.egress.detach_stale(self.layout.node_dirs(self.node_id)[-1])
        return orphans

    async def _reconnect(self, records: dict, kept: dict[str, str]) -> None:
        """Refill the rules of live sandboxes with egress; drop links nobody owns."""
        assert self.network is not None
        with_egress: dict[str, tuple[int, AllowList]] = {}
        for sandbox_id, v2_dir in kept.items():
            try:
                rules = parse_allow(records[sandbox_id].spec.allow)
            except ValueError:
                continue
            if rules.domains or rules.networks:
                with_egress[sandbox_id] = (os.stat(v2_dir).st_ino, rules)
        removed = await asyncio.to_thread(self.network.adopt, with_egress)
        for sandbox_id in removed:
            log.info("removed the veth of %s, which no live sandbox owns", sandbox_id, extra={SANDBOX_ID: sandbox_id})
        adopted = [s for s in with_egress if self.network.holds(s)]
        if adopted:
            await self.network.ensure_started()
            for sandbox_id in adopted:
                self.network.reapply(sandbox_id, with_egress[sandbox_id][1])
            log.info("refilled the egress rules of %d sandbox(es)", len(adopted))
        elif await asyncio.to_thread(self.network.leftovers):
            await asyncio.to_thread(self.network.remove_leftovers)

    def release_everything(self) -> None:
        for sandbox_id in cgroups.list_sandboxes(self.layout, self.node_id):
            self.release(sandbox_id)
        cgroups.remove_node_root(self.layout, self.node_id)


async def _live_record(store: SandboxStore, sandbox_id: str, node_id: str) -> SandboxRecord | None:
    """The sandbox's record if it is live on this node; None only when the store says so."""
    try:
        record, _ = await store.get(sandbox_id)
    except ServiceError as exc:
        if exc.code is ErrorCode.NOT_FOUND:
            return None
        raise
    return record if record.node == node_id and record.state not in ENDED else None

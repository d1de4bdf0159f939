"""Composition root of the node agent: reclaim leftovers, then serve confine/release."""

from __future__ import annotations

import asyncio
import logging

from agents.node.confinement import NodeConfinement
from agents.node.egress import Egress
from sandfleet import runner
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from sandfleet.kernel import cgroups, lsm
from sandfleet.store import SandboxStore
from schemas import node as node_schema
from schemas.node import (
    ConfinedList,
    Confinement,
    ConfineRequest,
    Empty,
    NodeSecurity,
    ReleaseReply,
    ReleaseRequest,
)

log = logging.getLogger("sandfleet.agent")


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    async with runner.service_bus("agent", config) as bus:
        egress = await Egress.load(config.node_id)
        node = NodeConfinement(layout=cgroups.CgroupLayout.detect(), node_id=config.node_id, egress=egress)
        store = await SandboxStore.open(bus)
        reclaimed = await node.reconcile(store)
        egress.report_to(bus, store)

        async def confine(req: ConfineRequest) -> Confinement:
            return node.confine(req)

        async def release(req: ReleaseRequest) -> ReleaseReply:
            return ReleaseReply(released=await asyncio.to_thread(node.release, req.sandbox_id))

        async def confined(_: Empty) -> ConfinedList:
            return ConfinedList(sandbox_ids=sorted(node.held()))

        abi = lsm.landlock_abi()
        security = NodeSecurity(
            node=config.node_id,
            mechanisms={
                "cgroup-limits": "on",
                "egress-ebpf": egress.status,
                "landlock": f"off: available (ABI {abi}) but not applied yet" if abi else "off: not in this kernel",
                "apparmor": "off: profiles not generated yet" if lsm.apparmor_enabled() else "off: not in this kernel",
            },
        )
        log.info("security on node %s: %s", config.node_id, security.mechanisms)

        async def security_info(_: Empty) -> NodeSecurity:
            return security

        n = config.node_id
        await bus.serve(
            "agent",
            [
                Endpoint("confine", node_schema.subject(n, node_schema.CONFINE), ConfineRequest, confine),
                Endpoint("release", node_schema.subject(n, node_schema.RELEASE), ReleaseRequest, release),
                Endpoint("confined", node_schema.subject(n, node_schema.AGENT_LIST), Empty, confined),
                Endpoint("security", node_schema.subject(n, node_schema.SECURITY), Empty, security_info),
            ],
            queue_group=f"agent-{n}",
        )
        log.info("agent serving node %s (reclaimed %d orphaned sandboxes)", n, len(reclaimed))
        await stop.wait()
        # SIGTERM means the node is going down (a crash restart never sends it): the launcher
        # has destroyed its sandboxes by now; take back anything still held.
        await asyncio.to_thread(node.release_everything)
        await node.reconcile(store)
        egress.close()


if __name__ == "__main__":
    runner.run("agent", main)

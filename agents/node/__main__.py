"""Composition root of the node agent: reclaim leftovers, then serve confine/release."""

from __future__ import annotations

import asyncio
import logging

from agents.node import apparmor
from agents.node.audit import LsmViolations, landlock_status
from agents.node.confinement import NodeConfinement
from agents.node.egress import Egress
from agents.node.limits_watch import ViolationWatch
from agents.node.network import EgressNetwork, NetworkConfig
from agents.node.violations import ViolationPublisher
from sandfleet import runner, telemetry
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from linuxnode import cgroups, lsm, netns
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
        publisher = ViolationPublisher(config.node_id)  # the one way violation events reach the bus
        egress = await Egress.load(config.node_id, publisher)
        network = None
        if egress.policy is not None:
            network = EgressNetwork(config.node_id, NetworkConfig.from_env(config.nats_url), egress.policy,
                                    egress.report_dns)
        layout = cgroups.CgroupLayout.detect()
        watch = await ViolationWatch.load(config.node_id, layout, publisher)
        lsm_denials = LsmViolations(config.node_id, layout, publisher)  # turns audit on if it is off
        profiles = await asyncio.to_thread(apparmor.SandboxProfiles.detect)
        node = NodeConfinement(layout=layout, node_id=config.node_id, egress=egress,
                               network=network, watch=watch, profiles=profiles)
        netns.keep_holder(config.node_id)  # the names' holder lasts the node's life, not each sandbox's
        store = await SandboxStore.open(bus)
        reclaimed = await node.reconcile(store)
        publisher.bind(bus, store)
        egress.start()
        watch.start()
        lsm_denials.start()

        async def confine(req: ConfineRequest) -> Confinement:
            telemetry.current_attributes({telemetry.NODE_ID: config.node_id, telemetry.ISOLATION: req.isolation,
                                          telemetry.TENANT: req.labels.get("tenant", "")})
            if req.allow and network is not None:
                node.check_egress(req)  # a bad rule is the caller's error before anything is made
                await network.ensure_started()  # the first sandbox with egress brings it up
            # Off the event loop either way: a batch sends hundreds of confines at once, and done
            # inline they would all be answered only when the last was made (past the caller's timeout).
            return await asyncio.to_thread(node.confine, req)

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
                "syscall-violations": watch.status,
                "egress-network": network.describe() if network is not None else f"off: {egress.status}",
                "landlock": landlock_status(abi, lsm_denials),
                "apparmor": profiles.status,
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
        await asyncio.to_thread(netns.release_holder, config.node_id)  # unpinned if no name is left
        if network is not None:
            await network.close()
        await egress.close()
        await watch.close()
        await lsm_denials.close()


if __name__ == "__main__":
    runner.run("agent", main, node_scoped=True)

"""Composition root of the security monitor (cluster scope; run any number of replicas):
its KV state, the policy endpoints, and the violation consumer."""

from __future__ import annotations

import asyncio
import functools
import logging

from sandfleet import runner
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from schemas import security
from services.security_monitor import consumer, handlers
from services.security_monitor.state import Ledger, Owners, Policies

log = logging.getLogger("sandfleet.security")


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    async with runner.service_bus(security.SERVICE, config) as bus:
        deps = handlers.Deps(bus=bus, policies=await Policies.open(bus), ledger=await Ledger.open(bus),
                             owners=await Owners.open(bus))
        h = functools.partial
        await bus.serve(
            security.SERVICE,
            [
                Endpoint("policy_set", security.POLICY_SET, security.Policy, h(handlers.set_policy, deps)),
                Endpoint("policy_get", security.POLICY_GET, security.PolicyGetRequest, h(handlers.get_policy, deps)),
                Endpoint("policy_list", security.POLICY_LIST, security.PolicyListRequest,
                         h(handlers.list_policies, deps)),
                Endpoint("sandbox_get", security.SANDBOX_GET, security.SandboxGetRequest,
                         h(handlers.get_sandbox, deps)),
            ],
            queue_group=security.QUEUE_GROUP,
        )
        consuming = asyncio.create_task(consumer.consume(bus, deps))
        log.info("security monitor serving")
        await asyncio.wait([consuming, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        consuming.cancel()
        if not stop.is_set():
            await consuming  # the consumer died: raise, so the supervisor restarts us


if __name__ == "__main__":
    runner.run(security.SERVICE, main)

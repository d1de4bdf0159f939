"""Composition root of placement: bus, store, node registry watch, endpoints."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import nats.js.errors

from sandfleet import runner
from sandfleet.bus import Bus, Endpoint, decode
from sandfleet.config import ServiceConfig
from sandfleet.store import SandboxStore
from schemas import node as node_schema
from schemas import sandbox
from services.placement import handlers
from services.placement.policy import NodeView

log = logging.getLogger("sandfleet.placement")


async def watch_nodes(bus: Bus, view: NodeView) -> None:
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    while True:
        try:
            watcher = await kv.watchall()
            async for entry in watcher:
                if entry is None:
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    view.forget(entry.key)
                else:
                    view.heartbeat(decode(entry.value, node_schema.NodeInfo))
        except (nats.js.errors.Error, nats.errors.Error) as exc:
            log.warning("node watch interrupted (%s); resuming", exc)
            await asyncio.sleep(0.5)


async def sweep_stuck(deps: handlers.Deps, period_s: float = 30.0) -> None:
    while True:
        try:
            failed = await handlers.fail_stuck(deps, time.time())
            if failed:
                log.warning("failed %d sandbox(es) that were never launched", len(failed))
        except Exception:  # the sweep must outlive a bad moment of the bus
            log.exception("stuck-sandbox sweep failed")
        await asyncio.sleep(period_s)


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    async with runner.service_bus("placement", config) as bus:
        deps = handlers.Deps(bus=bus, store=await SandboxStore.open(bus), nodes=NodeView())
        tasks = [asyncio.create_task(watch_nodes(bus, deps.nodes)), asyncio.create_task(sweep_stuck(deps))]
        h = functools.partial
        await bus.serve(
            "placement",
            [
                Endpoint("create", sandbox.CREATE, sandbox.CreateRequest, h(handlers.create, deps)),
                Endpoint("create_many", sandbox.CREATE_MANY, sandbox.CreateManyRequest, h(handlers.create_many, deps)),
                Endpoint("get", sandbox.GET, sandbox.GetRequest, h(handlers.get, deps)),
                Endpoint("list", sandbox.LIST, sandbox.ListRequest, h(handlers.list_sandboxes, deps)),
            ],
            queue_group=sandbox.QUEUE_GROUP,
        )
        log.info("placement serving")
        await stop.wait()
        for task in tasks:
            task.cancel()


if __name__ == "__main__":
    runner.run("placement", main)

"""Composition root of placement: bus, store, node registry and booking watches, quota
release, the stuck and lost sweeps, endpoints."""

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
from sandfleet.telemetry import NODE_ID
from schemas import node as node_schema
from schemas import pools, sandbox
from services.placement import handlers
from services.placement.ledger import Ledger
from services.placement.pools import PoolBook
from services.placement.policy import Limits, NodeView
from services.placement.quotas import Quotas

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
    """A sweep reads every record (~80 µs each): with tens of thousands it waits 20 times as
    long as it took, so it never costs more than ~5% of a core (stuck still means > 120 s)."""
    while True:
        started = time.monotonic()
        try:
            failed = await handlers.fail_stuck(deps, time.time())
            if failed:
                log.warning("failed %d sandbox(es) that were never launched", len(failed))
        except Exception:  # the sweep must outlive a bad moment of the bus
            log.exception("stuck-sandbox sweep failed")
        await asyncio.sleep(min(300.0, max(period_s, 20 * (time.monotonic() - started))))


async def sweep_lost(deps: handlers.Deps) -> None:
    # A replica that just started has not heard every node yet: wait one lost period first.
    await asyncio.sleep(deps.nodes.limits.node_lost_s)
    while True:
        try:
            for node_id, n in (await handlers.fail_lost(deps, time.time())).items():
                log.warning("node %s is lost; %d sandbox(es) reported failed", node_id, n, extra={NODE_ID: node_id})
        except Exception:
            log.exception("lost-node sweep failed")
        await asyncio.sleep(min(node_schema.HEARTBEAT_S, deps.nodes.limits.node_lost_s / 2))


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    async with runner.service_bus("placement", config) as bus:
        view = NodeView(limits=Limits.from_env())
        store = await SandboxStore.open(bus)
        if moved := await store.rekey():  # a platform upgraded in place from the layout keyed by id alone
            log.info("moved %d sandbox record(s) to their nodes' keys (record layout v3)", moved)
        deps = handlers.Deps(bus=bus, store=store, nodes=view,
                             ledger=await Ledger.open(bus, view), quotas=await Quotas.open(bus),
                             pools=await PoolBook.open(bus))
        assert deps.ledger is not None and deps.quotas is not None and deps.pools is not None
        tasks = [asyncio.create_task(c) for c in (
            watch_nodes(bus, view), deps.ledger.watch(), deps.quotas.watch_limits(), deps.quotas.release_ended(),
            sweep_stuck(deps), sweep_lost(deps),
        )]
        h = functools.partial
        await bus.serve(
            "placement",
            [
                Endpoint("create", sandbox.CREATE, sandbox.CreateRequest, h(handlers.create, deps)),
                Endpoint("create_many", sandbox.CREATE_MANY, sandbox.CreateManyRequest, h(handlers.create_many, deps)),
                Endpoint("get", sandbox.GET, sandbox.GetRequest, h(handlers.get, deps)),
                Endpoint("list", sandbox.LIST, sandbox.ListRequest, h(handlers.list_sandboxes, deps)),
                Endpoint("quota_set", sandbox.QUOTA_SET, sandbox.Quota, h(handlers.set_quota, deps)),
                Endpoint("quota_get", sandbox.QUOTA_GET, sandbox.QuotaGetRequest, h(handlers.get_quota, deps)),
                Endpoint("pool_set", pools.POOL_SET, pools.Pool, h(deps.pools.set, view=view)),
                Endpoint("pool_list", pools.POOL_LIST, pools.PoolListRequest, h(deps.pools.list, view=view)),
                Endpoint("pool_clear", pools.POOL_CLEAR, pools.PoolClearRequest, deps.pools.clear),
            ],
            queue_group=sandbox.QUEUE_GROUP,
        )
        log.info("placement serving (%s)", view.limits)
        await stop.wait()
        for task in tasks:
            task.cancel()


if __name__ == "__main__":
    runner.run("placement", main)

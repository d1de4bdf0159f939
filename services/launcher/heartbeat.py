"""The node's heartbeat: every HEARTBEAT_S, what this node runs, has booked and can offer (its
isolation levels, allocations, pressure, cached layers, intake counters) into the `nodes` KV
bucket, whose TTL tells placement a node that stopped beating is lost."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import nats.errors
import nats.js.errors

from sandfleet.bus import Bus, encode
from sandfleet.config import ServiceConfig
from sandfleet.errors import SandfleetError
from schemas import node as node_schema
from schemas.node import NodeInfo, NodePressure
from linuxnode import procfs
from services.launcher.clients import HEARTBEAT_LISTING_TIMEOUT_S
from services.launcher.keys import LOGGER
from services.launcher.lifecycle import Launcher
from services.launcher.pool import WarmPools

log = logging.getLogger(LOGGER)

WARM_BEAT_S = 0.2  # the soonest a change of the warm spares is beaten after the last beat


async def cached_layers(launcher: Launcher) -> list[str]:
    try:
        listing = await launcher.layers.listing(timeout=HEARTBEAT_LISTING_TIMEOUT_S, roots=False)
    except SandfleetError:
        return []  # no layer-cache on this node (yet): no locality to offer
    return sorted({ref for image in listing.images for ref in (image.digest, *image.names)})


def node_info(launcher: Launcher, config: ServiceConfig, memory_mb: int, layers: list[str], criu: str,
              pools: WarmPools | None = None) -> NodeInfo:
    intake = launcher.intake
    spares = pools.held() if pools is not None else []  # room they take, like running sandboxes
    specs = [live.spec for live in launcher.live.values()] + list(intake.starting.values()) + spares
    return NodeInfo(
        id=config.node_id,
        isolation=launcher.isolation,
        capacity=config.capacity,
        running=len(launcher.live) + len(spares),
        cpus=os.cpu_count() or 1,
        memory_mb=memory_mb,
        at=time.time(),
        starting=len(intake.starting),
        allocated_cpu=sum(s.cpu for s in specs),
        allocated_memory_mb=sum(s.memory_mb for s in specs),
        pressure=NodePressure(cpu=procfs.node_pressure("cpu"), memory=procfs.node_pressure("memory")),
        layers=layers,
        instance=intake.instance,
        accepted=intake.accepted,
        accepted_cpu=intake.accepted_cpu,
        accepted_memory_mb=intake.accepted_memory_mb,
        criu=criu,
        microvm=launcher.drivers.microvm,
        vm=launcher.drivers.vm,
        warm=pools.warm() if pools is not None else {},
    )


async def heartbeat(bus: Bus, launcher: Launcher, config: ServiceConfig, criu: str = "",
                    pools: WarmPools | None = None) -> None:
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    while True:
        if pools is not None:
            pools.changed.clear()  # before the snapshot: a change after it beats again
        info = node_info(launcher, config, memory_mb, await cached_layers(launcher), criu, pools)
        try:
            await kv.put(config.node_id, encode(info))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("heartbeat failed: %s", exc)
        if pools is None:
            await asyncio.sleep(node_schema.HEARTBEAT_S)
            continue
        # A claim or a new spare changes what placement should know: beat again soon, not in 2 s
        # (a burst of claims makes one beat, not one each).
        try:
            await asyncio.wait_for(pools.changed.wait(), node_schema.HEARTBEAT_S)
            await asyncio.sleep(WARM_BEAT_S)
        except asyncio.TimeoutError:
            pass


async def withdraw(bus: Bus, node_id: str) -> None:
    """The node's entry out of the bucket: it stopped on purpose, placement need not wait for the TTL."""
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    await kv.delete(node_id)

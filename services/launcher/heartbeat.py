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

log = logging.getLogger(LOGGER)


async def cached_layers(launcher: Launcher) -> list[str]:
    try:
        listing = await launcher.layers.listing(timeout=HEARTBEAT_LISTING_TIMEOUT_S)
    except SandfleetError:
        return []  # no layer-cache on this node (yet): no locality to offer
    return sorted({ref for image in listing.images for ref in (image.digest, *image.names)})


def node_info(launcher: Launcher, config: ServiceConfig, memory_mb: int, layers: list[str], criu: str) -> NodeInfo:
    intake = launcher.intake
    specs = [live.spec for live in launcher.live.values()] + list(intake.starting.values())
    return NodeInfo(
        id=config.node_id,
        isolation=launcher.isolation,
        capacity=config.capacity,
        running=len(launcher.live),
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
    )


async def heartbeat(bus: Bus, launcher: Launcher, config: ServiceConfig, criu: str = "") -> None:
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    while True:
        info = node_info(launcher, config, memory_mb, await cached_layers(launcher), criu)
        try:
            await kv.put(config.node_id, encode(info))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("heartbeat failed: %s", exc)
        await asyncio.sleep(node_schema.HEARTBEAT_S)


async def withdraw(bus: Bus, node_id: str) -> None:
    """The node's entry out of the bucket: it stopped on purpose, placement need not wait for the TTL."""
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    await kv.delete(node_id)

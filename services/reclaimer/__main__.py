"""Composition root of a node's reclaimer: KSM and zram set up, the savings endpoint, the loop;
on SIGTERM zram taken down and KSM handed back, in reverse order.

Settings (environment): SANDFLEET_RECLAIM=off (watch and report only: no KSM, no zram, no
actions), SANDFLEET_ZRAM_MB (default a quarter of RAM, 0 = none), SANDFLEET_ZRAM_ALGORITHM
(default: the kernel's), SANDFLEET_RECLAIM_INTERVAL_S (2), SANDFLEET_RECLAIM_IDLE_S (30),
SANDFLEET_RECLAIM_MERGE_S (20, at least), SANDFLEET_RECLAIM_MERGE_MAX_S (90, at most),
SANDFLEET_RECLAIM_PRESSURE (PSI some avg10 %, 25),
SANDFLEET_RECLAIM_PRESSURE_S (30).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os

from sandfleet import metrics, runner
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from linuxnode.cgroups import CgroupLayout
from schemas import reclaim
from services.reclaimer.ksm import SharedKsm
from services.reclaimer.node import NodeReclaimer
from services.reclaimer.policy import Policy, PolicyConfig
from services.reclaimer.zram import ZramError, ZramSwap

log = logging.getLogger("sandfleet.reclaimer")


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


def policy_config() -> PolicyConfig:
    return PolicyConfig(
        idle_after_s=_env("SANDFLEET_RECLAIM_IDLE_S", 30),
        merge_window_s=_env("SANDFLEET_RECLAIM_MERGE_S", 20),
        merge_max_s=_env("SANDFLEET_RECLAIM_MERGE_MAX_S", 90),
        pressure_avg10=_env("SANDFLEET_RECLAIM_PRESSURE", 25),
        pressure_sustain_s=_env("SANDFLEET_RECLAIM_PRESSURE_S", 30),
    )


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    enabled = os.environ.get("SANDFLEET_RECLAIM", "on") != "off"
    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    zram_mb = int(_env("SANDFLEET_ZRAM_MB", ram_mb // 4))
    pcfg = policy_config()
    ksm = SharedKsm(config.node_id, target_scan_s=max(2, int(pcfg.merge_window_s // 2)))
    zram = ZramSwap(config.data_dir / "reclaimer" / config.node_id / "zram.json", config.node_id)
    await asyncio.to_thread(zram.reclaim_leftover)  # before anything new: a crashed predecessor's device
    note = "off: SANDFLEET_RECLAIM=off" if not enabled else "off: SANDFLEET_ZRAM_MB=0"
    if enabled and zram_mb > 0:
        try:
            device = await asyncio.to_thread(zram.set_up, zram_mb, os.environ.get("SANDFLEET_ZRAM_ALGORITHM", ""))
            log.info("swap on %s (%d MiB)", device, zram_mb)
        except ZramError as exc:
            note = f"off: {exc}"
            log.warning("no compressed swap: %s", exc)
    if enabled and ksm.available:
        await asyncio.to_thread(ksm.join)
    try:
        async with runner.service_bus(reclaim.SERVICE, config) as bus:
            node = NodeReclaimer(bus=bus, node_id=config.node_id, layout=CgroupLayout.detect(), policy=Policy(pcfg),
                                 ksm=ksm, zram=zram, enabled=enabled, zram_note=note,
                                 interval_s=_env("SANDFLEET_RECLAIM_INTERVAL_S", 2),
                                 cpu_budget=_env("SANDFLEET_RECLAIM_CPU_BUDGET", 0.05))
            await bus.serve(
                reclaim.SERVICE,
                [Endpoint("savings", reclaim.savings_subject(config.node_id), reclaim.SavingsRequest,
                          functools.partial(NodeReclaimer.savings, node))],
                queue_group=f"{reclaim.SERVICE}-{config.node_id}",
            )
            metrics.SANDBOX_MEMORY.set_function(lambda: sum(s.memory_bytes for s in node.last))
            metrics.MERGED.set_function(lambda: sum(s.merged_bytes for s in node.last))
            metrics.SWAPPED.set_function(lambda: zram.stats().orig_bytes)
            looping = asyncio.create_task(node.run())
            log.info("reclaimer %s on node %s", "acting" if enabled else "watching only", config.node_id)
            await stop.wait()
            looping.cancel()
    finally:
        if enabled and ksm.available:
            await asyncio.to_thread(ksm.leave)
        await asyncio.to_thread(zram.tear_down)


if __name__ == "__main__":
    runner.run(reclaim.SERVICE, main, node_scoped=True)

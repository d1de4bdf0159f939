"""Fencing: a node that comes back after placement gave it up tears down what it still runs.

When a node's heartbeats stop for `SANDFLEET_NODE_LOST_S` (a hung launcher, a cut-off link,
an overloaded bus), placement marks it lost and ends its sandboxes `failed` (`node_lost`), and
the trainer sees them fail. If the node was only slow, its launcher still holds them: running
processes, cgroups, roots and veths that no record owns any longer, and that nobody would ever
destroy. Every `period_s` the launcher reads the records of its live sandboxes (one pipelined
burst) and drops, on the kernel side only, each one whose record has ended or is gone. The
record is left as placement wrote it: the trainer was told `failed`, and `failed` it stays.
"""

from __future__ import annotations

import asyncio
import logging
import os

from schemas.sandbox import ENDED
from services.launcher.lifecycle import Launcher

log = logging.getLogger("sandfleet.launcher")

FENCE_S = float(os.environ.get("SANDFLEET_FENCE_S") or 15)


async def fence(launcher: Launcher) -> list[str]:
    """Drop the live sandboxes whose records ended elsewhere or vanished; their ids."""
    candidates = [i for i, live in launcher.live.items() if not live.ending]
    if not candidates:
        return []
    records = await launcher.store.read_many(candidates)
    dropped = []
    for sandbox_id in candidates:
        record, _ = records.get(sandbox_id, (None, 0))
        if record is None:
            why = "its record is gone"
        elif record.state in ENDED:
            why = f"its record was ended elsewhere ({record.state.value}, {record.reason.value}: {record.detail})"
        elif record.node != launcher.node_id:
            why = f"its record names node {record.node}"
        else:
            continue
        if await launcher.drop(sandbox_id, why):
            dropped.append(sandbox_id)
    return dropped


async def fence_loop(launcher: Launcher, period_s: float = FENCE_S) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            dropped = await fence(launcher)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the bus is what failed: try again next period
            log.warning("fencing pass failed: %s", exc)
            continue
        if dropped:
            log.warning("dropped %d sandbox(es) whose records had ended elsewhere", len(dropped))

"""Fencing: a node that comes back after placement gave it up tears down what it still runs.

When a node's heartbeats stop for `SANDFLEET_NODE_LOST_S` (a hung launcher, a cut-off link,
an overloaded bus), placement marks it lost and ends its sandboxes `failed` (`node_lost`), and
the trainer sees them fail. If the node was only slow, its launcher still holds them: running
processes, cgroups, roots and veths that no record owns any longer, and that nobody would ever
destroy. Every `SANDFLEET_FENCE_S` the launcher reads the records of its live sandboxes (one
pipelined burst) and drops, on the kernel side only, each one whose record has ended or is gone
(decisions.to_drop). The record is left as placement wrote it: the trainer was told `failed`,
and `failed` it stays.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.launcher import decisions
from services.launcher.keys import LOGGER
from services.launcher.lifecycle import Launcher

log = logging.getLogger(LOGGER)


async def fence(launcher: Launcher) -> list[str]:
    """Drop the live sandboxes whose records ended elsewhere or vanished; their ids."""
    candidates = [i for i, live in launcher.live.items() if not live.ending]
    if not candidates:
        return []
    found = await launcher.store.read_many(candidates)
    return [sandbox_id for sandbox_id, why in decisions.to_drop(candidates, found, launcher.node_id)
            if await launcher.drop(sandbox_id, why)]


BUDGET = 0.05  # of the time, at most, a pass may take: it reads every live sandbox's record


async def fence_loop(launcher: Launcher, period_s: float) -> None:
    took = 0.0
    while True:
        # A pass costs the node and the bus per live sandbox (~0.2 ms each): with thousands the
        # period stretches so fencing stays a small share of the time, however full the node is.
        await asyncio.sleep(max(period_s, took / BUDGET))
        started = time.monotonic()
        try:
            dropped = await fence(launcher)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the bus is what failed: try again next period
            log.warning("fencing pass failed: %s", exc)
            continue
        finally:
            took = time.monotonic() - started
        if dropped:
            log.warning("dropped %d sandbox(es) whose records had ended elsewhere", len(dropped))

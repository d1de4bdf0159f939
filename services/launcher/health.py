"""Launcher endpoints for a sandbox's lifetime and health: a new deadline (`set_timeout`) and
what it uses now (`metrics`, `node_metrics`). Figures come from the driver (read from outside the
sandbox); the deadline is the one the expiry loop (lifecycle.py) ends it at, reason `expired`."""

from __future__ import annotations

import asyncio
import time

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.health import (
    InterfaceBytes,
    MetricsRequest,
    NodeMetrics,
    NodeMetricsRequest,
    SandboxMetrics,
    SetTimeoutReply,
    SetTimeoutRequest,
)
from services.launcher import records
from services.launcher.drivers.base import SandboxGone
from services.launcher.keys import tag
from services.launcher.lifecycle import Launcher
from services.launcher.state import Live

_SETTING: set[tuple[str, str]] = set()  # (node, sandbox) whose set_timeout is writing its record now
NODE_METRICS_AT_ONCE = 16  # sandboxes read at once for `node_metrics` (each is a few file reads in a thread)


async def set_timeout(launcher: Launcher, req: SetTimeoutRequest) -> SetTimeoutReply:
    """The sandbox now ends `timeout_s` from now; sooner than before is allowed (the expiry loop
    ends it at its next pass after the new deadline). The record is written first: a refused write
    changes nothing."""
    tag(launcher.node_id, req.sandbox_id)
    limit = launcher.settings.max_timeout_s
    if req.timeout_s > limit:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"timeout_s {req.timeout_s:g} is beyond this node's "
                                                      f"maximum of {limit:g} s")
    _not_ending(launcher, req.sandbox_id)
    key = (launcher.node_id, req.sandbox_id)
    if key in _SETTING:  # two at once could leave the record with one deadline and the expiry loop the other
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is getting another timeout; retry")
    _SETTING.add(key)
    try:
        deadline = time.time() + req.timeout_s
        record = await records.deadline_set(launcher.store, req.sandbox_id, deadline)
        live = _not_ending(launcher, req.sandbox_id)  # it may have begun to end during the write
        live.deadline = deadline
    finally:
        _SETTING.discard(key)
    return SetTimeoutReply(record=record)


async def metrics(launcher: Launcher, req: MetricsRequest) -> SandboxMetrics:
    tag(launcher.node_id, req.sandbox_id)
    found = await _metrics_of(launcher.get_live(req.sandbox_id))
    if found is None:
        raise ServiceError(ErrorCode.NOT_FOUND, f"sandbox {req.sandbox_id} ended while it was read")
    return found


async def node_metrics(launcher: Launcher, req: NodeMetricsRequest) -> NodeMetrics:
    """Every live sandbox of the node, a few at a time; those ending meanwhile are left out."""
    tag(launcher.node_id)
    slots = asyncio.Semaphore(NODE_METRICS_AT_ONCE)

    async def one(live: Live) -> SandboxMetrics | None:
        async with slots:
            return await _metrics_of(live)

    found = await asyncio.gather(*(one(live) for live in list(launcher.live.values()) if not live.ending))
    return NodeMetrics(node=launcher.node_id, sandboxes=[m for m in found if m is not None])


async def _metrics_of(live: Live) -> SandboxMetrics | None:
    """None if the sandbox is gone (or going) by the time it is read."""
    try:
        used = await live.driver.usage(live.instance)
    except SandboxGone:
        return None
    if live.ending:
        return None
    interfaces = [InterfaceBytes(name=name, rx_bytes=rx, tx_bytes=tx) for name, rx, tx in used.interfaces]
    return SandboxMetrics(
        sandbox_id=live.id, at=time.time(), cpu_s=used.cpu_s, memory_bytes=used.memory_bytes,
        memory_peak_bytes=used.memory_peak_bytes, memory_limit_bytes=used.memory_limit_bytes,
        disk_bytes=used.disk_bytes, processes=used.processes, rx_bytes=sum(i.rx_bytes for i in interfaces),
        tx_bytes=sum(i.tx_bytes for i in interfaces), interfaces=interfaces, deadline=live.deadline,
    )


def _not_ending(launcher: Launcher, sandbox_id: str) -> Live:
    live = launcher.live.get(sandbox_id)
    if live is not None and live.ending:
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is ending: its life cannot change")
    return launcher.get_live(sandbox_id)

"""A sandbox's lifetime and health on the bus: a new deadline, what it uses now, and what every
sandbox of a node (or of the fleet, for `sandfleet top`) uses, one request per node."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sandfleet import errors
from schemas import health
from schemas.health import NodeMetrics, SandboxMetrics
from schemas.sandbox import SandboxRecord, State

if TYPE_CHECKING:
    from sandfleet.client import Fleet

__all__ = ["SandboxMetrics", "NodeMetrics", "set_timeout", "metrics", "node_metrics", "fleet_metrics"]

_LIVE = frozenset({State.RUNNING, State.PAUSED})


async def set_timeout(fleet: Fleet, node_id: str, sandbox_id: str, seconds: float) -> SandboxRecord:
    req = health.SetTimeoutRequest(sandbox_id=sandbox_id, timeout_s=seconds)
    subject = health.subject(node_id, health.SET_TIMEOUT)
    return (await fleet.bus.request(subject, req, health.SetTimeoutReply, timeout=30)).record


async def metrics(fleet: Fleet, node_id: str, sandbox_id: str) -> SandboxMetrics:
    req = health.MetricsRequest(sandbox_id=sandbox_id)
    return await fleet.bus.request(health.subject(node_id, health.METRICS), req, SandboxMetrics, timeout=30)


async def node_metrics(fleet: Fleet, node_id: str) -> NodeMetrics:
    subject = health.subject(node_id, health.NODE_METRICS)
    return await fleet.bus.request(subject, health.NodeMetricsRequest(), NodeMetrics, timeout=30)


async def fleet_metrics(fleet: Fleet, node_id: str | None = None) -> list[tuple[str, SandboxMetrics]]:
    """(node, metrics) of every live sandbox, of one node or of every node holding one; a node
    that does not answer (gone, or a simulated one) is left out."""
    if node_id is not None:
        nodes = {node_id}
    else:
        nodes = {r.node for r in await fleet.list() if r.state in _LIVE and r.node}
    found = await asyncio.gather(*(node_metrics(fleet, n) for n in sorted(nodes)), return_exceptions=True)
    out: list[tuple[str, SandboxMetrics]] = []
    for got in found:
        if isinstance(got, (errors.NoResponders, errors.Timeout)):
            continue
        if isinstance(got, BaseException):
            raise got
        out += [(got.node, m) for m in got.sandboxes]
    return sorted(out, key=lambda nm: (nm[0], nm[1].sandbox_id))

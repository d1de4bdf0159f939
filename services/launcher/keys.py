"""The canonical keys (`sandbox.id`, `node.id`, sandfleet.telemetry) on the launcher's log lines
and spans. The runner puts `node.id` on every line of a node service; a line about one sandbox
passes `extra=about(id)`, and a handler tags its request's span with `tag`."""

from __future__ import annotations

from sandfleet import telemetry
from sandfleet.bus import current_span

LOGGER = "sandfleet.launcher"


def about(sandbox_id: str) -> dict[str, str]:
    return {telemetry.SANDBOX_ID: sandbox_id}


def tag(node_id: str, sandbox_id: str | None = None) -> None:
    """Tag the current request's span (the bus adapter makes one per request)."""
    span = current_span()
    span.set_attribute(telemetry.NODE_ID, node_id)
    if sandbox_id is not None:
        span.set_attribute(telemetry.SANDBOX_ID, sandbox_id)

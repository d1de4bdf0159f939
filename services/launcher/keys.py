"""The canonical keys (`sandbox.id`, `node.id`, sandfleet.telemetry) on the launcher's log lines
and spans. The composition root stamps `node.id` on every line of the launcher's logger; a line
about one sandbox passes `extra=about(id)`, and a handler tags its request's span with `tag`.
The message text still names the sandbox, for a reader of the plain log format."""

from __future__ import annotations

import logging

from sandfleet import telemetry
from sandfleet.bus import current_span

LOGGER = "sandfleet.launcher"


def about(sandbox_id: str) -> dict[str, str]:
    return {telemetry.SANDBOX_ID: sandbox_id}


class NodeStamp(logging.Filter):
    """Puts `node.id` on every record of the logger it is added to."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def filter(self, record: logging.LogRecord) -> bool:
        setattr(record, telemetry.NODE_ID, self.node_id)
        return True


def tag(node_id: str, sandbox_id: str | None = None) -> None:
    """Tag the current request's span (the bus adapter makes one per request)."""
    span = current_span()
    span.set_attribute(telemetry.NODE_ID, node_id)
    if sandbox_id is not None:
        span.set_attribute(telemetry.SANDBOX_ID, sandbox_id)

"""Violation events: what a sandbox tried and was refused, on
`events.v1.violation.<node>.<sandbox>.<kind>` (kept by the EVENTS stream as the audit trail).

`kind` is `<layer>.<what>` (`network.connect`, `network.sendmsg`, `network.socket`); in the
subject it is one token with `_` for the dot, so `events.v1.violation.*.*.network_connect`
selects one kind on every node.
"""

from __future__ import annotations

import msgspec

ALL = "events.v1.violation.>"
VERSION = 1


def subject(node_id: str, sandbox_id: str, kind: str) -> str:
    return f"events.v1.violation.{node_id}.{sandbox_id}.{kind.replace('.', '_')}"


def sandbox_filter(sandbox_id: str) -> str:
    return f"events.v1.violation.*.{sandbox_id}.*"


class Violation(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="violation"):
    v: int = VERSION
    node: str
    sandbox_id: str
    kind: str
    pid: int
    command: str
    attempted: str  # e.g. "connect 10.1.2.3:80/tcp"
    address: str | None = None
    port: int = 0
    at: float
    labels: dict[str, str] = {}

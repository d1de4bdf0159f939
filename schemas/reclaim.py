"""The memory reclamation service's subjects: the actions it takes on idle sandboxes (events
`events.v1.reclaim.<node>.<sandbox>.<merged|paged_out|frozen>`, kept by the EVENTS stream),
what a node has saved (`node.v1.<node>.savings`, shown by `sandfleet status`). Under sustained
pressure it freezes the idlest through the launcher's `node.v1.<node>.pause` (schemas/node.py).

Actions, in the order an idle sandbox meets them: `merge` (its processes opted in to KSM at
spawn; the reclaimer runs ksmd and reports the pages now backed by a shared copy), `page_out`
(`process_madvise(MADV_PAGEOUT)` over its processes, into the node's zram swap), `freeze`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SERVICE = "reclaimer"
VERSION = 1

SAVINGS = "savings"  # verb of node.v1.<node>.savings

ALL = "events.v1.reclaim.>"

Action = Literal["merge", "page_out", "freeze"]
ACTION_EVENT: dict[str, str] = {"merge": "merged", "page_out": "paged_out", "freeze": "frozen"}


def action_subject(node_id: str, sandbox_id: str, action: str) -> str:
    return f"events.v1.reclaim.{node_id}.{sandbox_id}.{ACTION_EVENT[action]}"


def sandbox_filter(node_id: str, sandbox_id: str) -> str:
    return f"events.v1.reclaim.{node_id}.{sandbox_id}.*"


def node_filter(node_id: str) -> str:
    """Every reclaim action of one node's sandboxes."""
    return f"events.v1.reclaim.{node_id}.>"


def savings_subject(node_id: str) -> str:
    return f"node.v1.{node_id}.{SAVINGS}"


class ReclaimAction(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="reclaim.action"):
    """One action on one sandbox. `bytes_reclaimed`: for `merge`, the sandbox's pages now backed
    by a page another process shares (KSM); for `page_out`, how much its processes' resident
    memory fell; for `freeze`, 0 (a frozen sandbox stops growing, it frees nothing by itself)."""

    v: int = VERSION
    node: str
    sandbox_id: str
    action: Action
    bytes_reclaimed: int
    memory_bytes: int  # the sandbox's charged memory (its memory cgroup) after the action
    outcome: str = "done"
    at: float


class SavingsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class NodeSavings(msgspec.Struct, frozen=True, kw_only=True):
    """The reply of `node.v1.<node>.savings`: what reclamation saves on this node right now.

    `saved_bytes` = `merged_bytes` + `swapped_bytes` - `swap_stored_bytes`: pages served by a
    shared copy, plus pages moved to zram, minus the RAM zram holds them in (compressed)."""

    node: str
    enabled: bool
    ksm: str  # "on", or "off: <why>"
    zram: str  # "on: /dev/zramN <size> MiB", or "off: <why>"
    sandboxes: int
    idle: int
    paged_out: int
    frozen: int
    memory_bytes: int  # what the node's sandboxes are charged now (their memory cgroups)
    merged_bytes: int
    swapped_bytes: int
    swap_stored_bytes: int
    saved_bytes: int
    actions: dict[str, int] = {}  # how many of each action since the service started
    reclaimed_bytes: dict[str, int] = {}  # their bytes_reclaimed, summed
    at: float = 0.0

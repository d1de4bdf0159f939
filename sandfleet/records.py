"""The sandbox record's state machine, without I/O: what a move does to a record, the event it
yields, the moves refused.

`SandboxStore` decides here, for one sandbox or a batch of them alike, and only does the
reading, revision-checked writing and publishing around it; so this module is unit-tested
without a bus (tests/test_records_units.py).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from sandfleet import errors
from schemas import events
from schemas.errors import ErrorCode
from schemas.sandbox import Reason, SandboxRecord, State, can_transition


# One accepted transition: (the record to write, the event to publish once it is written). A
# plain tuple: a batch makes one per sandbox, and a NamedTuple costs ten times as much to make.
Move = tuple[SandboxRecord, events.SandboxEvent]


def advance(record: SandboxRecord, new: State, at: float, reason: Reason = Reason.NONE, detail: str = "",
            change: Callable[[SandboxRecord], SandboxRecord] | None = None,
            only_from: frozenset[State] | None = None) -> Move | None:
    """The move of `record` to `new` at time `at`: the next record (state, reason, detail and
    `updated_at` set, `seq` one up, then `change` applied) and its event; None when `record` is
    in `new` already (nothing to write, nothing to publish). Raises CONFLICT for a move the
    state machine does not allow, or one from a state outside `only_from` (e.g. placement
    failing a launch whose reply was lost must not fail a sandbox the node did start)."""
    if record.state is new:
        return None
    if not can_transition(record.state, new) or (only_from and record.state not in only_from):
        raise errors.ServiceError(
            ErrorCode.CONFLICT, f"sandbox {record.id} is {record.state.value}, cannot become {new.value}")
    updated = msgspec.structs.replace(record, state=new, reason=reason, detail=detail, updated_at=at,
                                      seq=record.seq + 1)
    if change is not None:
        updated = change(updated)
    return updated, lifecycle_event(updated, record.state)


def first(record: SandboxRecord) -> Move:
    """A new record as it is first stored (`seq` 1, whatever the caller set) and its first event."""
    stored = msgspec.structs.replace(record, seq=1)
    return stored, lifecycle_event(stored, None)


def unrecorded_end(record: SandboxRecord, reason: Reason, detail: str, at: float) -> events.SandboxEvent:
    """The `failed` event a sandbox whose record was never stored (while its `scheduled` event
    may have been) would have had: the move of its first record to `failed`, so its trail ends."""
    move = advance(msgspec.structs.replace(record, state=State.SCHEDULED, seq=1), State.FAILED, at, reason, detail)
    assert move is not None  # scheduled -> failed is always allowed
    return move[1]


def lifecycle_event(record: SandboxRecord, previous: State | None) -> events.SandboxEvent:
    """The event of `record` having come from `previous` (None: just created)."""
    kind = events.event_type(previous, record.state)
    return kind(sandbox_id=record.id, node=record.node, tenant=record.tenant, state=record.state, seq=record.seq,
                at=record.updated_at, reason=record.reason, detail=record.detail)

"""Every write the launcher makes to a sandbox's record, one function per kind, so each kind
has one route (and its rules: which states it may come from, what it changes besides the
state). The store checks every write against the record's revision; `known` is the record and
revision a caller already holds (placement sends them with a launch), tried before a read."""

from __future__ import annotations

import logging
import time

import msgspec

from sandfleet import telemetry
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas.sandbox import Reason, SandboxRecord, State
from services.launcher.drivers.base import Anchor
from services.launcher.keys import LOGGER, about

log = logging.getLogger(LOGGER)

Known = dict[str, tuple[SandboxRecord, int]]


async def starting(store: SandboxStore, ids: list[str], known: Known | None = None
                   ) -> list[SandboxRecord | ServiceError]:
    """A launch's claim on its sandboxes (`starting`), in one pipelined write; per id, the record
    or the refusal (it ended meanwhile, or was never scheduled here)."""
    return await store.transition_many(ids, State.STARTING, known=known)


async def running(store: SandboxStore, sandbox_id: str, anchor: Anchor, started_at: float, deadline: float,
                  known: tuple[SandboxRecord, int] | None = None) -> SandboxRecord:
    """Built: `running`, with what a restarted launcher needs to find it again."""

    def change(r: SandboxRecord) -> SandboxRecord:
        return msgspec.structs.replace(r, init_pid=anchor.pid, init_start_time=anchor.start_time,
                                       started_at=started_at, deadline=deadline)

    record = await store.transition(sandbox_id, State.RUNNING, change=change, known=known)
    telemetry.state_changed(State.RUNNING.value)
    return record


def anchor_of(record: SandboxRecord) -> Anchor | None:
    """The instance `running` recorded, for a launcher that no longer holds it."""
    return Anchor(record.init_pid, record.init_start_time) if record.init_pid else None


async def stopping(store: SandboxStore, sandbox_id: str, reason: Reason, detail: str) -> None:
    try:
        await store.transition(sandbox_id, State.STOPPING, reason, detail)
        telemetry.state_changed(State.STOPPING.value, reason=reason.value)
    except ServiceError:
        pass  # already stopping (a retry after a crash); finish the job


async def ended(store: SandboxStore, sandbox_id: str, state: State, reason: Reason, detail: str = "") -> SandboxRecord:
    """`stopped` (then forgotten: its events stay in the stream) or `failed` (kept to be read)."""
    try:
        record = await store.transition(sandbox_id, state, reason, detail)
        telemetry.state_changed(state.value, reason=reason.value)
    except ServiceError as exc:  # someone else ended it first (placement gave up on the launch)
        log.info("sandbox %s: %s", sandbox_id, exc.message, extra=about(sandbox_id))
        record, _ = await store.get(sandbox_id)
        return record
    if state is State.STOPPED:
        await store.forget(sandbox_id)
    return record


async def paused(store: SandboxStore, sandbox_id: str, reason: Reason, detail: str) -> SandboxRecord:
    return await store.transition(sandbox_id, State.PAUSED, reason, detail, only_from=frozenset({State.RUNNING}))


async def resumed(store: SandboxStore, sandbox_id: str) -> SandboxRecord:
    return await store.transition(sandbox_id, State.RUNNING, only_from=frozenset({State.PAUSED}))


async def quarantined(store: SandboxStore, sandbox_id: str, detail: str) -> SandboxRecord:
    """`paused` with reason `violation`, which no plain resume lifts; idempotent."""
    record, _ = await store.get(sandbox_id)
    if record.state is State.PAUSED:
        if record.reason is Reason.VIOLATION:
            return record
        # Paused already (a trainer, the reclaimer): same state, but now no resume may lift it.
        return await store.update(sandbox_id, lambda r: msgspec.structs.replace(
            r, reason=Reason.VIOLATION, detail=detail, updated_at=time.time()))
    return await store.transition(sandbox_id, State.PAUSED, Reason.VIOLATION, detail)


async def checkpointed(store: SandboxStore, sandbox_id: str, layers: list[str]) -> None:
    """Kept on the record: placement restores the sandbox from it elsewhere if this node is lost."""
    await store.update(sandbox_id, lambda r: msgspec.structs.replace(r, checkpoint=layers))


async def deadline_set(store: SandboxStore, sandbox_id: str, deadline: float) -> SandboxRecord:
    """A new deadline (`set_timeout`), kept on the record so a restarted launcher expires it then."""
    return await store.update(sandbox_id, lambda r: msgspec.structs.replace(r, deadline=deadline,
                                                                            updated_at=time.time()))

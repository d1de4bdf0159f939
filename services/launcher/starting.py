"""A launch's `starting` mark, written only for sandboxes still being built after a grace period.

A sandbox built within the grace goes from `scheduled` straight to `running` (or `failed`):
one revision-checked write and one event fewer each, a third of what a sandbox costs the bus
between request and start. The mark exists for placement: it fails a record still `scheduled`
only once its launch request timed out (30 s and more) or after `STUCK_AFTER_S` (120 s), long
past the grace, so a node's claim on what it builds is always on record by then. Every write
is checked against the record's revision, so a mark racing the launch's own next write cannot
overwrite it: one of the two is refused and the launch re-reads. A sandbox sent without its
record is claimed at once (`claim`), through the same write.
"""

from __future__ import annotations

import asyncio
import logging

from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas.node import LaunchItem
from schemas.sandbox import SandboxRecord
from services.launcher import records
from services.launcher.keys import LOGGER
from services.launcher.records import Known

log = logging.getLogger(LOGGER)

DEFAULT_GRACE_S = 0.5  # the launcher passes SANDFLEET_STARTING_GRACE_S (settings.py)


def placed_record(item: LaunchItem) -> tuple[SandboxRecord, int] | None:
    """The record and revision placement sent with the launch, if it did (no read needed;
    revision 0: a batch member with no own record yet, whose first write expects none)."""
    return (item.record, item.revision) if item.record is not None else None


class StartingMarks:
    """The marks of one launch request's sandboxes: after `grace`, those not yet settled are
    marked `starting` in one pipelined write; `settle(id)` comes before a sandbox's next write."""

    def __init__(self, store: SandboxStore, ids: list[str], known: Known | None = None,
                 grace: float = DEFAULT_GRACE_S) -> None:
        self._store, self._known = store, known or {}
        self._pending = dict.fromkeys(ids)  # insertion-ordered set
        self._written: asyncio.Task[dict[str, ServiceError]] | None = None
        self._timer = asyncio.get_running_loop().call_later(grace, self._write)

    def _write(self) -> None:
        ids, self._pending = list(self._pending), {}
        if ids:
            self._written = asyncio.ensure_future(self._mark(ids))

    async def _mark(self, ids: list[str]) -> dict[str, ServiceError]:
        outcome = await records.starting(self._store, ids, known=self._known)
        return {i: o for i, o in zip(ids, outcome) if isinstance(o, ServiceError)}

    async def claim(self, sandbox_id: str) -> ServiceError | None:
        """Mark one sandbox `starting` now, before it is built (placement sent no record for it,
        so nothing says it is scheduled here); the refusal, if the record cannot be claimed."""
        await self.settle(sandbox_id)
        [outcome] = await records.starting(self._store, [sandbox_id])
        return outcome if isinstance(outcome, ServiceError) else None

    async def settle(self, sandbox_id: str) -> ServiceError | None:
        """Before the sandbox's next write: not marked yet → it never will be; being marked → wait
        for that write. Returns the refusal of its mark (the record had ended meanwhile), if any."""
        if sandbox_id in self._pending:
            del self._pending[sandbox_id]
            if not self._pending and self._written is None:
                self._timer.cancel()
            return None
        if self._written is None:
            return None
        try:
            refused = await asyncio.shield(self._written)
        except Exception as exc:  # the write as a whole failed (the bus): the next write will tell
            log.warning("marking a launch starting failed: %s", exc)
            return None
        return refused.get(sandbox_id)

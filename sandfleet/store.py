"""JetStream state every service shares: the `sandboxes` and `nodes` KV buckets and the events stream.

`SandboxStore` is the only writer of sandbox records: every change is a revision-checked
update of one record that moves along the state machine, and every accepted transition
publishes its lifecycle event (de-duplicated by `<id>:<seq>`, so a retry is stored once).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import nats.js.errors
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from sandfleet import errors
from sandfleet.bus import Bus, decode, encode
from schemas import events, node, sandbox
from schemas.errors import ErrorCode
from schemas.sandbox import ENDED, Reason, SandboxRecord, State

EVENTS_MAX_AGE_S = 7 * 24 * 3600


async def ensure_state(bus: Bus) -> None:
    """Create the buckets and the stream if they are missing; safe to call from every service."""
    js = bus.js
    await js.create_key_value(
        KeyValueConfig(bucket=sandbox.KV_BUCKET, history=1, storage=StorageType.FILE, description="sandbox records")
    )
    await js.create_key_value(
        KeyValueConfig(
            bucket=node.KV_BUCKET, history=1, ttl=node.NODE_TTL_S, storage=StorageType.FILE, description="node heartbeats"
        )
    )
    try:
        await js.add_stream(
            StreamConfig(
                name=events.STREAM,
                subjects=events.STREAM_SUBJECTS,
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=EVENTS_MAX_AGE_S,
                duplicate_window=120,
            )
        )
    except nats.js.errors.BadRequestError:
        pass  # exists with another config (an operator tuned it); keep theirs


class SandboxStore:
    def __init__(self, bus: Bus, kv: KeyValue) -> None:
        self.bus = bus
        self.kv = kv
        # What this process last wrote, so its next update needs no read first; a stale entry
        # only costs one failed update (the revision check) and a re-read.
        self._written: dict[str, tuple[SandboxRecord, int]] = {}

    @classmethod
    async def open(cls, bus: Bus) -> SandboxStore:
        return cls(bus, await bus.js.key_value(sandbox.KV_BUCKET))

    async def get(self, sandbox_id: str) -> tuple[SandboxRecord, int]:
        try:
            entry = await self.kv.get(sandbox_id)
        except nats.js.errors.KeyNotFoundError:
            raise errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}") from None
        if entry.value is None:
            raise errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}")
        return decode(entry.value, SandboxRecord), entry.revision

    async def create(self, record: SandboxRecord) -> SandboxRecord:
        """Store a new record (state `scheduled`) and publish its first event."""
        record = msgspec.structs.replace(record, seq=1)
        await self.kv.create(record.id, encode(record))  # placement writes once; not worth caching
        await self._publish(record, None)
        return record

    async def transition(
        self,
        sandbox_id: str,
        new: State,
        reason: Reason = Reason.NONE,
        detail: str = "",
        change: Callable[[SandboxRecord], SandboxRecord] | None = None,
    ) -> SandboxRecord:
        """Move a sandbox to `new`, retrying on concurrent writers; refuses illegal moves."""
        for attempt in range(20):
            cached = self._written.pop(sandbox_id, None) if attempt == 0 else None
            record, revision = cached or await self.get(sandbox_id)
            if cached and (record.state is new or not sandbox.can_transition(record.state, new)):
                continue  # judge only on what the store holds now
            if record.state is new:
                return record
            if not sandbox.can_transition(record.state, new):
                raise errors.ServiceError(
                    ErrorCode.CONFLICT, f"sandbox {sandbox_id} is {record.state.value}, cannot become {new.value}"
                )
            updated = msgspec.structs.replace(
                record, state=new, reason=reason, detail=detail, updated_at=time.time(), seq=record.seq + 1
            )
            if change is not None:
                updated = change(updated)
            try:
                revision = await self.kv.update(sandbox_id, encode(updated), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            if new not in ENDED:
                self._written[sandbox_id] = (updated, revision)
            await self._publish(updated, record.state)
            return updated
        raise errors.ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is being changed by others; retry")

    async def update(self, sandbox_id: str, change: Callable[[SandboxRecord], SandboxRecord]) -> SandboxRecord:
        """Change fields that are not the state (e.g. the init pid); no event."""
        for attempt in range(20):
            cached = self._written.pop(sandbox_id, None) if attempt == 0 else None
            record, revision = cached or await self.get(sandbox_id)
            updated = change(record)
            try:
                revision = await self.kv.update(sandbox_id, encode(updated), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            self._written[sandbox_id] = (updated, revision)
            return updated
        raise errors.ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is being changed by others; retry")

    async def all(self, node_id: str | None = None, include_ended: bool = False) -> list[SandboxRecord]:
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        records = []
        for key in keys:
            try:
                record, _ = await self.get(key)
            except errors.ServiceError:
                continue
            if node_id is not None and record.node != node_id:
                continue
            if not include_ended and record.state in ENDED:
                continue
            records.append(record)
        return records

    async def forget(self, sandbox_id: str) -> None:
        """Drop an ended record; its events stay in the stream as the audit trail."""
        self._written.pop(sandbox_id, None)
        try:
            await self.kv.purge(sandbox_id)
        except nats.js.errors.Error:
            pass

    async def _publish(self, record: SandboxRecord, previous: State | None) -> None:
        kind = events.event_type(previous, record.state)
        event = kind(
            sandbox_id=record.id,
            node=record.node,
            state=record.state,
            seq=record.seq,
            at=record.updated_at,
            reason=record.reason,
            detail=record.detail,
        )
        subject = events.sandbox_subject(record.id, event.name)
        await self.bus.publish_durable(subject, event, msg_id=f"{record.id}:{record.seq}")

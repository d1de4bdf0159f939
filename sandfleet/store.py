"""JetStream state every service shares: the `sandboxes` and `nodes` KV buckets and the events stream.

`SandboxStore` is the only writer of sandbox records: every change is a revision-checked
update of one record that moves along the state machine, and every accepted transition
publishes its lifecycle event (de-duplicated by `<id>:<seq>`, so a retry is stored once).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from sandfleet import errors
from sandfleet.bus import Bus, decode, encode, kv_values, through_failover
from schemas import events, node, sandbox
from schemas.errors import ErrorCode
from schemas.sandbox import ENDED, Reason, SandboxRecord, State

log = logging.getLogger("sandfleet.store")

EVENTS_MAX_AGE_S = 7 * 24 * 3600


class _Ack(msgspec.Struct):
    seq: int = 0


class _StoredMsg(msgspec.Struct):
    data: str = ""
    seq: int = 0


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _MsgGet(msgspec.Struct):
    message: _StoredMsg | None = None
    error: _ApiError | None = None


_NO_MESSAGE = 10037  # JetStream's "no message found": the key has no value


_ack = msgspec.json.Decoder(_Ack)
_stored_msg = msgspec.json.Decoder(_MsgGet)


@dataclass
class _Burst:
    replies: list[Msg | None]
    left: int
    done: asyncio.Future


class _IngestError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _IngestFrame(msgspec.Struct):
    """What comes back on a fast-ingest batch's inbox: flow frames (`type` ack/gap/err), then
    one terminal frame (`stream` set) with the count stored or the batch's error."""

    type: str = ""
    stream: str = ""
    count: int = 0
    error: _IngestError | None = None


_ingest_frame = msgspec.json.Decoder(_IngestFrame)
_BATCH_DISABLED = 10205  # JetStream's "batch publish is disabled": the stream has no allow_batched
INGEST_CHUNK = 2000  # messages per fast-ingest batch


@dataclass
class _Batch:
    """A direct get answered by many messages on one reply subject, ended by a status message."""

    done: asyncio.Future
    found: list[Msg] = dataclasses.field(default_factory=list)
    status: str = ""
    description: str = ""


MULTI_LAST_MAX = 1024  # keys the server matches in one multi_last direct get


@dataclass
class _Ingest:
    """One fast-ingest batch in flight: its terminal frame, and the first error frame seen."""

    size: int
    done: asyncio.Future
    error: str = ""


class BatchRefused(errors.ServiceError):
    """Some records of a batch were not written: `refused` maps each id to the server's answer
    (an id that exists already is another sandbox's record, which the batch must not touch)."""

    def __init__(self, refused: dict[str, str]) -> None:
        super().__init__(ErrorCode.CONFLICT, f"{len(refused)} write(s) refused: {next(iter(refused.values()))}")
        self.refused = refused


def _refused(reply: Msg) -> bool:
    return b'"error"' in reply.data or bool(reply.headers and reply.headers.get("Status"))


async def ensure_state(bus: Bus) -> None:
    """Create the buckets and the stream if they are missing; safe to call from every service.

    On a clustered bus the bus adapter gives each the cluster's replica count (`Bus.js`)."""
    js = bus.js
    try:
        await js.create_key_value(
            KeyValueConfig(bucket=sandbox.KV_BUCKET, history=1, storage=StorageType.FILE,
                           description="sandbox records", direct=True)  # SandboxStore.read_many: batched direct gets
        )
    except nats.js.errors.BadRequestError:  # made by an older sandfleet (or tuned): keep it, with direct gets
        await _turn_on(js, f"KV_{sandbox.KV_BUCKET}", "allow_direct")
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
                allow_batched=True,  # events go in fast-ingest batches (SandboxStore._pipelined)
            )
        )
    except nats.js.errors.BadRequestError:  # exists with another config (an operator tuned it): keep theirs,
        await _turn_on(js, events.STREAM, "allow_batched")  # but let it take batches of events


async def _turn_on(js: Any, stream: str, feature: str) -> None:
    """Turn on a stream feature (`allow_direct`, `allow_batched`) that a stream made by an older
    sandfleet lacks, keeping the rest of its config. Where the server refuses, the store reads
    or writes the slower way instead."""
    info = await js.stream_info(stream)
    if not getattr(info.config, feature):
        try:
            await js.update_stream(dataclasses.replace(info.config, **{feature: True}))
        except nats.js.errors.Error as exc:
            log.warning("cannot turn on %s for stream %s: %s", feature, stream, exc)


class SandboxStore:
    def __init__(self, bus: Bus, kv: KeyValue) -> None:
        self.bus = bus
        self.kv = kv
        # What this process last wrote, so its next update needs no read first; a stale entry
        # only costs one failed update (the revision check) and a re-read.
        self._written: dict[str, tuple[SandboxRecord, int]] = {}
        # Batched writes share one reply subscription (created on first use) instead of one each.
        self._mux: Any = None
        self._mux_prefix = ""
        self._bursts = 0
        self._waiting: dict[str, _Burst | _Ingest | _Batch] = {}
        self._batch_base = secrets.token_hex(8)  # + a burst token: a batch id no other sender uses
        self._ingest = True  # events go as fast-ingest batches until the stream refuses them

    @classmethod
    async def open(cls, bus: Bus) -> SandboxStore:
        return cls(bus, await bus.js.key_value(sandbox.KV_BUCKET))

    async def get(self, sandbox_id: str) -> tuple[SandboxRecord, int]:
        try:
            entry = await through_failover(lambda: self.kv.get(sandbox_id), f"get {sandbox_id}")
        except nats.js.errors.KeyNotFoundError:
            raise errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}") from None
        if entry.value is None:
            raise errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}")
        return decode(entry.value, SandboxRecord), entry.revision

    async def read_many(self, sandbox_ids: list[str], timeout: float = 30.0) -> dict[str, tuple[SandboxRecord, int]]:
        """`get` for many ids: each record found, with its revision; an id with no record (never
        made, or purged) is left out. Batched direct gets (`multi_last`, up to 1,024 keys a
        request, answered by any replica of the bucket rather than queued at its leader's
        JetStream API); on a bucket that serves no direct gets, one pipelined read per id."""
        if not sandbox_ids:
            return {}
        chunks = [sandbox_ids[i : i + MULTI_LAST_MAX] for i in range(0, len(sandbox_ids), MULTI_LAST_MAX)]
        batches = await asyncio.gather(*(self._read_batch(chunk, timeout) for chunk in chunks))
        if any(batch is None for batch in batches):
            return await self._read_each(sandbox_ids, timeout)
        found = {}
        prefix = len(f"$KV.{sandbox.KV_BUCKET}.")
        for batch in batches:
            for msg in batch or ():
                headers = msg.headers or {}
                if msg.data and not headers.get("KV-Operation"):  # a delete or purge marker: no record
                    found[headers["Nats-Subject"][prefix:]] = (decode(msg.data, SandboxRecord),
                                                               int(headers["Nats-Sequence"]))
        return found

    async def _read_batch(self, sandbox_ids: list[str], timeout: float) -> list[Msg] | None:
        """One `multi_last` direct get: the last message of each key that has one (then a 204
        status; a 404 alone when none has), or None when the bucket serves no direct gets."""
        waiting = _Batch(done=asyncio.get_running_loop().create_future())
        request = encode({"multi_last": [f"$KV.{sandbox.KV_BUCKET}.{i}" for i in sandbox_ids], "batch": len(sandbox_ids)})
        await self._exchange(
            waiting, lambda reply: [(f"$JS.API.DIRECT.GET.KV_{sandbox.KV_BUCKET}", request, None, f"{reply}.0")],
            timeout, lambda: f"a read of {len(sandbox_ids)} sandboxes unanswered")
        if waiting.status == "503":  # no responders: the bucket has no allow_direct
            return None
        if waiting.status not in ("204", "404"):
            raise errors.ServiceError(ErrorCode.TIMEOUT if int(waiting.status or 0) >= 500 else ErrorCode.INTERNAL,
                                      f"cannot read sandboxes: {waiting.status} {waiting.description}")
        return waiting.found

    async def _read_each(self, sandbox_ids: list[str], timeout: float) -> dict[str, tuple[SandboxRecord, int]]:
        """`read_many` on a bucket without direct gets: one pipelined JetStream API read per id."""
        reads = await self._burst(
            [(f"$JS.API.STREAM.MSG.GET.KV_{sandbox.KV_BUCKET}", encode({"last_by_subj": f"$KV.{sandbox.KV_BUCKET}.{i}"}),
              None) for i in sandbox_ids], timeout)
        found = {}
        for i, msg in zip(sandbox_ids, reads):
            reply = _stored_msg.decode(msg.data)
            if reply.error is not None and reply.error.err_code != _NO_MESSAGE:  # unreadable is not absent
                raise errors.ServiceError(ErrorCode.TIMEOUT if reply.error.code >= 500 else ErrorCode.INTERNAL,
                                          f"cannot read sandbox {i}: {reply.error.description}")
            got = reply.message
            if got is not None and got.data:
                found[i] = (decode(base64.b64decode(got.data), SandboxRecord), got.seq)
        return found

    async def create(self, record: SandboxRecord) -> SandboxRecord:
        """Store a new record (state `scheduled`) and publish its first event."""
        record = msgspec.structs.replace(record, seq=1)
        try:  # placement writes once; not worth caching
            await through_failover(lambda: self.kv.create(record.id, encode(record)), f"create {record.id}")
        except nats.js.errors.KeyWrongLastSequenceError:
            if (await self.get(record.id))[0] != record:  # else: our own write, its ack lost in a failover
                raise errors.ServiceError(ErrorCode.CONFLICT, f"sandbox {record.id} exists") from None
        await self._publish(record, None)
        return record

    async def create_many(self, records: list[SandboxRecord], timeout: float = 30.0) -> list[tuple[SandboxRecord, int]]:
        """`create` for a batch: every record, then every first event, each sent as one pipelined
        burst with one wait for the acks, instead of two round trips per sandbox. Returns each
        record with its revision (a node may make its first transition without reading it)."""
        records = [msgspec.structs.replace(r, seq=1) for r in records]
        new = {"Nats-Expected-Last-Subject-Sequence": "0"}  # what kv.create sends: fail if the key exists
        firsts = [(r, self._event(r, None)) for r in records]
        # Both bursts in flight at once (one wait, not two). A `scheduled` event may so be stored
        # for a record that was not: for an unanswered batch, whose records the caller then ends
        # (`failed`), or for an id that another sandbox has (one chance in 2^48 per id), where
        # the event's id deduplicates it against that sandbox's own within two minutes.
        acks, _ = await asyncio.gather(
            self._burst([(f"$KV.{sandbox.KV_BUCKET}.{r.id}", encode(r), new) for r in records], timeout),
            self._pipelined([(events.sandbox_subject(r.id, e.name), encode(e), {"Nats-Msg-Id": f"{r.id}:{r.seq}"})
                             for r, e in firsts], timeout),
        )
        refused = {r.id: a.data[:200].decode(errors="replace") for r, a in zip(records, acks) if _refused(a)}
        if refused:
            raise BatchRefused(refused)
        return [(r, _ack.decode(a.data).seq) for r, a in zip(records, acks)]

    async def _pipelined(self, messages: list[tuple[str, bytes, dict[str, str]]], timeout: float) -> None:
        """Events appended to their stream; raises if any is refused or unacknowledged.

        Sent as fast-ingest batches (JetStream 2.14+, a stream with `allow_batched`): each
        stored as it arrives, one ack per batch of up to INGEST_CHUNK instead of one per event,
        which the sender would decode one by one. A stream without `allow_batched` (made by an
        older sandfleet, or tuned by an operator) gets publishes that each wait for their own
        ack: one that asked for none is dropped without a word when the stream's ingest queue
        is full. A retry is stored once either way (`Nats-Msg-Id`)."""
        if self._ingest:
            chunks = [messages[i : i + INGEST_CHUNK] for i in range(0, len(messages), INGEST_CHUNK)]
            failed = [f for f in await asyncio.gather(*(self._ingest_batch(c, timeout) for c in chunks)) if f]
            if not failed:
                return
            if not all(f == "disabled" for f in failed):
                raise errors.ServiceError(ErrorCode.CONFLICT, f"{len(failed)} event batch(es) refused: {failed[0]}")
            self._ingest = False  # nothing was stored: send them the old way
        refused = [r.data[:200].decode(errors="replace") for r in await self._burst(messages, timeout) if _refused(r)]
        if refused:
            raise errors.ServiceError(ErrorCode.CONFLICT, f"{len(refused)} write(s) refused: {refused[0]}")

    async def _ingest_batch(self, messages: list[tuple[str, bytes, dict[str, str]]], timeout: float) -> str:
        """One fast-ingest batch: "" once all are stored, else why not ("disabled": the stream
        takes no batches). The protocol is in the reply subject,
        `<inbox>.<flow>.<gap>.<batch seq>.<op>.$FI`, and the inbox's last token is the batch id:
        op 0 opens, 1 adds, 2 adds and commits; flow is how many messages per flow ack (the
        server answers at most every 500); gap `fail` makes a lost message fail the batch
        instead of leaving a hole. The frames come back on the messages' own reply subjects."""
        waiting = _Ingest(size=len(messages), done=asyncio.get_running_loop().create_future())
        last = len(messages) - 1

        def frames(reply: str) -> list[tuple[str, bytes, dict[str, str] | None, str]]:
            inbox = f"{reply}.{self._batch_base}{reply.rsplit('.', 1)[1]}"  # its last token: the batch id
            return [(subject, payload, headers,
                     f"{inbox}.{len(messages)}.fail.{n + 1}.{2 if n == last else 0 if n == 0 else 1}.$FI")
                    for n, (subject, payload, headers) in enumerate(messages)]

        await self._exchange(waiting, frames, timeout, lambda: f"a batch of {len(messages)} events unanswered")
        return waiting.error

    async def _open_reply(self, waiting: _Burst | _Ingest | _Batch) -> str:
        """A token for replies on this store's one reply subscription (made on first use)."""
        nc = self.bus.nc
        if self._mux is None:  # made once, also when bursts start together
            self._mux_prefix = nc.new_inbox()
            self._mux = asyncio.ensure_future(self.bus.subscribe_direct(self._mux_prefix + ".>", self._on_reply))
        mux = self._mux
        try:
            await asyncio.shield(mux)  # a burst cancelled while it waits must not cancel the others' set-up
        except asyncio.CancelledError:
            if mux.cancelled() and self._mux is mux:
                self._mux = None
            raise
        except Exception:
            if self._mux is mux:  # it failed: the next burst tries again
                self._mux = None
            raise
        self._bursts += 1
        token = str(self._bursts)
        self._waiting[token] = waiting
        return token

    async def _burst(self, messages: list[tuple[str, bytes, dict[str, str] | None]], timeout: float) -> list[Msg]:
        """Requests sent back to back, answered on this store's one reply subscription; their
        replies, in order."""
        if not messages:
            return []
        waiting = _Burst(replies=[None] * len(messages), left=len(messages),
                         done=asyncio.get_running_loop().create_future())
        await self._exchange(
            waiting, lambda reply: [(subject, payload, headers, f"{reply}.{n}")
                                    for n, (subject, payload, headers) in enumerate(messages)],
            timeout, lambda: f"{waiting.left} of {len(messages)} writes unanswered")
        return waiting.replies  # type: ignore[return-value]

    async def _exchange(self, waiting: _Burst | _Ingest | _Batch,
                        frames: Callable[[str], list[tuple[str, bytes, dict[str, str] | None, str]]],
                        timeout: float, unanswered: Callable[[], str]) -> None:
        """Send `frames(reply)` (`reply`: `<this store's reply prefix>.<a token of its own>`, for
        their reply subjects to start with) and wait until `waiting` has all its answers."""
        token = await self._open_reply(waiting)
        try:
            await self.bus.publish_many(frames(f"{self._mux_prefix}.{token}"))
            try:
                await asyncio.wait_for(asyncio.shield(waiting.done), timeout)
            except asyncio.TimeoutError:
                raise errors.ServiceError(ErrorCode.TIMEOUT, unanswered()) from None
        finally:
            self._waiting.pop(token, None)

    def _on_reply(self, msg: Msg) -> None:
        # <prefix>.<token>.<n> answers message n of a burst; a fast-ingest batch's frames come
        # on its messages' own reply subjects, <prefix>.<token>.<batch id>.<flow>...$FI
        token, _, rest = msg.subject[len(self._mux_prefix) + 1 :].partition(".")
        waiting = self._waiting.get(token)
        if isinstance(waiting, _Ingest):
            self._on_ingest_frame(waiting, msg)
            return
        if isinstance(waiting, _Batch):
            status = (msg.headers or {}).get("Status")
            if not status:
                waiting.found.append(msg)
            elif not waiting.done.done():
                waiting.status, waiting.description = status, (msg.headers or {}).get("Description", "")
                waiting.done.set_result(None)
            return
        n = int(rest) if rest.isdigit() else -1
        if waiting is None or not 0 <= n < len(waiting.replies) or waiting.replies[n] is not None:
            return  # a burst that gave up waiting
        waiting.replies[n] = msg
        waiting.left -= 1
        if waiting.left == 0 and not waiting.done.done():
            waiting.done.set_result(None)

    @staticmethod
    def _on_ingest_frame(waiting: _Ingest, msg: Msg) -> None:
        frame = _ingest_frame.decode(msg.data)
        if frame.error is not None and not waiting.error:
            waiting.error = ("disabled" if frame.error.err_code == _BATCH_DISABLED
                             else f"{frame.error.description} ({frame.error.err_code})")
        if frame.stream and not waiting.done.done():  # the terminal frame: the batch ended
            if not waiting.error and frame.count != waiting.size:
                waiting.error = f"the batch ended after {frame.count} of {waiting.size} events"
            waiting.done.set_result(None)

    async def transition_many(self, sandbox_ids: list[str], new: State, reason: Reason = Reason.NONE,
                              detail: str = "", known: dict[str, tuple[SandboxRecord, int]] | None = None
                              ) -> list[SandboxRecord | errors.ServiceError]:
        """`transition` for a batch, pipelined: one burst of reads (for records neither this process
        wrote last nor `known` gives with their revision), one of revision-checked writes, one of
        events. A write that loses a race (a stale `known` too) goes through `transition` on its
        own. Returns, per id, the record or the refusal."""
        known = {i: known[i] for i in sandbox_ids if i in known} if known else {}
        known |= {i: self._written.pop(i) for i in sandbox_ids if i in self._written}
        known |= await self.read_many([i for i in sandbox_ids if i not in known])
        now = time.time()
        out: dict[str, SandboxRecord | errors.ServiceError] = {}
        writes: list[tuple[SandboxRecord, SandboxRecord]] = []
        for i in sandbox_ids:
            if i not in known:
                out[i] = errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {i}")
                continue
            record, _ = known[i]
            if record.state is new:
                out[i] = record
            elif not sandbox.can_transition(record.state, new):
                out[i] = errors.ServiceError(
                    ErrorCode.CONFLICT, f"sandbox {i} is {record.state.value}, cannot become {new.value}")
            else:
                writes.append((record, msgspec.structs.replace(
                    record, state=new, reason=reason, detail=detail, updated_at=now, seq=record.seq + 1)))
        acks = await self._burst(
            [(f"$KV.{sandbox.KV_BUCKET}.{u.id}", encode(u), {"Nats-Expected-Last-Subject-Sequence": str(known[u.id][1])})
             for _, u in writes], 30.0)
        published = []
        for (old, updated), ack in zip(writes, acks):
            if _refused(ack):  # someone else changed it meanwhile: judge it on what the store holds now
                try:
                    out[updated.id] = await self.transition(updated.id, new, reason, detail)
                except errors.ServiceError as exc:
                    out[updated.id] = exc
                continue
            if new not in ENDED:
                self._written[updated.id] = (updated, _ack.decode(ack.data).seq)
            out[updated.id] = updated
            published.append((updated, self._event(updated, old.state)))
        await self._pipelined([(events.sandbox_subject(r.id, e.name), encode(e), {"Nats-Msg-Id": f"{r.id}:{r.seq}"})
                               for r, e in published], 30.0)
        return [out[i] for i in sandbox_ids]

    async def transition(
        self,
        sandbox_id: str,
        new: State,
        reason: Reason = Reason.NONE,
        detail: str = "",
        change: Callable[[SandboxRecord], SandboxRecord] | None = None,
        only_from: frozenset[State] | None = None,
        known: tuple[SandboxRecord, int] | None = None,
    ) -> SandboxRecord:
        """Move a sandbox to `new`, retrying on concurrent writers; refuses illegal moves, and
        moves from a state outside `only_from` (e.g. placement failing a launch whose reply was
        lost must not fail a sandbox the node did start). `known`: the record and revision as the
        caller last saw them, tried (like what this process wrote last) before a read."""
        sent: tuple[SandboxRecord, State] | None = None
        for attempt in range(20):
            cached = (self._written.pop(sandbox_id, None) or known) if attempt == 0 else None
            record, revision = cached or await self.get(sandbox_id)
            if cached and (record.state is new or not sandbox.can_transition(record.state, new)):
                continue  # judge only on what the store holds now
            if sent is not None and record == sent[0]:  # our write landed; its ack was lost in a failover
                await self._publish(record, sent[1])
                return record
            if record.state is new:
                return record
            if not sandbox.can_transition(record.state, new) or (only_from and record.state not in only_from):
                raise errors.ServiceError(
                    ErrorCode.CONFLICT, f"sandbox {sandbox_id} is {record.state.value}, cannot become {new.value}"
                )
            updated = msgspec.structs.replace(
                record, state=new, reason=reason, detail=detail, updated_at=time.time(), seq=record.seq + 1
            )
            if change is not None:
                updated = change(updated)
            sent = (updated, record.state)
            try:
                revision = await self._update(sandbox_id, updated, revision)
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
                revision = await self._update(sandbox_id, updated, revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            self._written[sandbox_id] = (updated, revision)
            return updated
        raise errors.ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is being changed by others; retry")

    async def _update(self, sandbox_id: str, record: SandboxRecord, revision: int) -> int:
        payload = encode(record)
        return await through_failover(lambda: self.kv.update(sandbox_id, payload, last=revision), f"update {sandbox_id}")

    async def all(self, node_id: str | None = None, include_ended: bool = False) -> list[SandboxRecord]:
        """Every record (on `node_id`), read in one pass: an ordered consumer of each key's last
        value, not a key listing and then one read per key (at 32,000 sandboxes that was 64,000
        messages and 32,000 round trips a call)."""
        latest = await kv_values(self.kv, "list sandboxes")
        records = [decode(value, SandboxRecord) for value in latest.values()]
        return [r for r in records
                if (node_id is None or r.node == node_id) and (include_ended or r.state not in ENDED)]

    async def end_unrecorded(self, record: SandboxRecord, reason: Reason, detail: str) -> None:
        """The `failed` event of a sandbox whose record was never stored while its `scheduled`
        event may have been (`create_many` sends both at once): its trail ends instead of
        dangling. No record is written."""
        ended = msgspec.structs.replace(record, state=State.FAILED, reason=reason, detail=detail,
                                        updated_at=time.time(), seq=2)
        try:
            await self._publish(ended, State.SCHEDULED)
        except (errors.SandfleetError, nats.errors.Error):
            pass  # the bus that lost the record lost this too: nothing more to do

    async def forget(self, sandbox_id: str) -> None:
        """Drop an ended record; its events stay in the stream as the audit trail."""
        self._written.pop(sandbox_id, None)
        try:
            await self.kv.purge(sandbox_id)
        except (nats.errors.Error, nats.js.errors.Error):  # a timeout too: the sandbox is gone either way
            pass

    async def _publish(self, record: SandboxRecord, previous: State | None) -> None:
        event = self._event(record, previous)
        subject = events.sandbox_subject(record.id, event.name)
        await self.bus.publish_durable(subject, event, msg_id=f"{record.id}:{record.seq}")

    @staticmethod
    def _event(record: SandboxRecord, previous: State | None) -> events.SandboxEvent:
        kind = events.event_type(previous, record.state)
        return kind(
            sandbox_id=record.id,
            node=record.node,
            state=record.state,
            seq=record.seq,
            at=record.updated_at,
            reason=record.reason,
            detail=record.detail,
        )

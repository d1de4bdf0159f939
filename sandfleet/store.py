"""The sandbox records every service shares, in the `sandboxes` KV bucket (made with the rest of
the shared JetStream state by `sandfleet.buckets.ensure_state`, re-exported here).

`SandboxStore` is the only writer of sandbox records: every change is a revision-checked
update of one record that moves along the state machine (`sandfleet.records` decides each
move), and every accepted move hands its lifecycle event to the store's `EventPublisher`.
Batches of records go through `BatchedJetStream`, one burst of writes for a whole batch.
Placement stores a launch's sandboxes as one batch record (`schemas.sandbox.SandboxBatch`):
until a sandbox's own record is first written, reads give it as its batch says, with
revision 0, so that first write is one that expects no own record yet. A sandbox's own record
is keyed by its node and id (`<node>.<id>`, so each node may be allowed to write its own only);
a read by id asks for `*.<id>` and trusts one node's key (`sandfleet.record_keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from sandfleet import errors, record_keys, records
from sandfleet.bus import FAILOVER_S, Bus, encode, kv_values, through_failover
from sandfleet.buckets import ensure_state  # noqa: F401  (re-exported: every service's start)
from sandfleet.event_publisher import EventPublisher, JetStreamEventPublisher
from sandfleet.jetstream import BatchedJetStream, kv_subject, refusal
from schemas import sandbox
from schemas.errors import ErrorCode
from schemas.sandbox import ENDED, Reason, SandboxRecord, State

log = logging.getLogger("sandfleet.store")

BATCHES_KEPT = 4096  # batch records a store keeps read (never changed once written)
NODES_KEPT = 65536  # ids whose node a store keeps, for a forget with no read first
GET_TIMEOUT_S = 5.0  # one try of `get`, as nats-py's kv.get had
_record = msgspec.json.Decoder(SandboxRecord)
_batch = msgspec.json.Decoder(sandbox.SandboxBatch)


class BatchRefused(errors.ServiceError):
    """Some records of a batch were not written: `refused` maps each id to the server's answer
    (an id that exists already is another sandbox's record, which the batch must not touch)."""

    def __init__(self, refused: dict[str, str]) -> None:
        super().__init__(ErrorCode.CONFLICT, f"{len(refused)} write(s) refused: {next(iter(refused.values()))}")
        self.refused = refused


class SandboxStore:
    def __init__(self, bus: Bus, kv: KeyValue, publisher: EventPublisher | None = None,
                 jetstream: BatchedJetStream | None = None) -> None:
        self.bus = bus
        self.kv = kv
        self.jetstream = jetstream or BatchedJetStream(bus)
        # Events go out through the same batched client by default: one reply subscription.
        self.publisher: EventPublisher = publisher or JetStreamEventPublisher(bus, self.jetstream)
        # What this process last wrote, so its next update needs no read first; a stale entry
        # only costs one failed update (the revision check) and a re-read.
        self._written: dict[str, tuple[SandboxRecord, int]] = {}
        self._nodes: dict[str, str] = {}  # id -> the node whose key holds its record, as last read or written
        self._batches: dict[str, sandbox.SandboxBatch] = {}  # token -> batch record, as read

    @classmethod
    async def open(cls, bus: Bus, publisher: EventPublisher | None = None) -> SandboxStore:
        return cls(bus, await bus.js.key_value(sandbox.KV_BUCKET), publisher)

    async def get(self, sandbox_id: str) -> tuple[SandboxRecord, int]:
        """The record and its revision (0: as its batch says, no own record yet); tried again
        while the cluster fails over, like any JetStream read (`through_failover`)."""
        deadline = asyncio.get_running_loop().time() + FAILOVER_S
        while True:
            try:
                found = await through_failover(lambda: self.read_many([sandbox_id], GET_TIMEOUT_S), f"get {sandbox_id}")
                break
            except errors.ServiceError as exc:  # unanswered: a replica may be taking over
                if exc.code is not ErrorCode.TIMEOUT or asyncio.get_running_loop().time() > deadline:
                    raise
        if sandbox_id not in found:
            raise errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}")
        return found[sandbox_id]

    async def read_many(self, sandbox_ids: list[str], timeout: float = 30.0) -> dict[str, tuple[SandboxRecord, int]]:
        """`get` for many ids, in batches: each record found, with its revision; an id with no
        record (never made, or purged) is left out. An id whose node this store knows (its batch
        record, kept once read, or an earlier read or write) is read by its exact key; any other
        as `*.<id>` (any node's key: a wildcard read costs the server ~3x an exact one), beside
        its batch record, in one round trip, to judge which node's key to trust."""
        known: dict[str, str] = {}
        tokens: set[str] = set()
        for i in sandbox_ids:
            placed = sandbox.batch_of(i)
            batch = self._batches.get(placed[0]) if placed is not None else None
            if batch is not None or i in self._nodes:
                known[i] = batch.node if batch is not None else self._nodes[i]
            elif placed is not None:
                tokens.add(placed[0])
        gone: set[str] = set()
        keys = [sandbox.record_key(known[i], i) if i in known else sandbox.record_filter(i) for i in sandbox_ids]
        own, batches = await asyncio.gather(
            self.jetstream.kv_read_many(sandbox.KV_BUCKET, keys, _record.decode, timeout, gone),
            self._read_batches(tokens | {p[0] for i in known if (p := sandbox.batch_of(i))}, timeout))
        resolved = record_keys.resolve(own, gone, batches)
        found = resolved.records | record_keys.unwritten(sandbox_ids, resolved, batches)
        if len(self._nodes) + len(resolved.nodes) > NODES_KEPT:
            self._nodes.clear()
        self._nodes.update(resolved.nodes)
        return found

    async def _read_batches(self, tokens: set[str], timeout: float) -> dict[str, sandbox.SandboxBatch]:
        """The batch records of `tokens` (kept once read: a batch record never changes)."""
        missing = [sandbox.batch_key(t) for t in tokens if t not in self._batches]
        if missing:
            if len(self._batches) + len(missing) > BATCHES_KEPT:
                self._batches.clear()
            read = await self.jetstream.kv_read_many(sandbox.KV_BUCKET, missing, _batch.decode, timeout)
            self._batches.update((batch.token, batch) for batch, _ in read.values())
        return {t: self._batches[t] for t in tokens if t in self._batches}

    def _key(self, record: SandboxRecord) -> str:
        if len(self._nodes) >= NODES_KEPT:
            self._nodes.clear()
        self._nodes[record.id] = record.node
        return sandbox.record_key(record.node, record.id)

    async def create(self, record: SandboxRecord) -> SandboxRecord:
        """Store a new record (state `scheduled`) and publish its first event."""
        record, event = records.first(record)
        try:  # placement writes once; not worth caching
            await through_failover(lambda: self.kv.create(self._key(record), encode(record)), f"create {record.id}")
        except nats.js.errors.KeyWrongLastSequenceError:
            if (await self.get(record.id))[0] != record:  # else: our own write, its ack lost in a failover
                raise errors.ServiceError(ErrorCode.CONFLICT, f"sandbox {record.id} exists") from None
        await self.publisher.publish(event)
        return record

    async def create_many(self, batch: list[SandboxRecord], timeout: float = 30.0) -> list[tuple[SandboxRecord, int]]:
        """`create` for a batch: every record, then every first event, each sent as one pipelined
        burst with one wait for the acks, instead of two round trips per sandbox. Returns each
        record with its revision (a node may make its first transition without reading it)."""
        firsts = [records.first(r) for r in batch]
        # Both bursts in flight at once (one wait, not two). A `scheduled` event may so be stored
        # for a record that was not: for an unanswered batch, whose records the caller then ends
        # (`failed`), or for an id that another sandbox has (one chance in 2^48 per id), where
        # the event's id deduplicates it against that sandbox's own within two minutes.
        (revisions, refused), _ = await asyncio.gather(
            self.jetstream.kv_write_many(sandbox.KV_BUCKET, [(self._key(r), encode(r), 0) for r, _ in firsts], timeout),
            self.publisher.publish_many([e for _, e in firsts], timeout),
        )
        if refused:
            raise BatchRefused({firsts[n][0].id: why for n, why in refused.items()})
        return [(r, revision) for (r, _), revision in zip(firsts, revisions)]

    async def create_batches(self, batches: list[sandbox.SandboxBatch], timeout: float = 30.0
                             ) -> list[list[tuple[SandboxRecord, int]]]:
        """`create_many` for batch records: each batch one stored message (written only if its
        key is new), every member's first event beside them in one burst. Per batch, its
        members' records with revision 0 (their own records are not written yet). A batch whose
        key exists (its token drawn twice) is refused whole: BatchRefused names its members."""
        members = [b.records() for b in batches]  # as stored: seq 1 each
        (revisions, refused), _ = await asyncio.gather(
            self._write_batches(batches, timeout),
            self.publisher.publish_many([records.lifecycle_event(r, None) for rs in members for r in rs], timeout))
        if refused:
            raise BatchRefused({i: why for n, why in refused.items() for i in batches[n].ids()})
        return [[(r, 0) for r in rs] for rs in members]

    async def record_batches(self, batches: list[sandbox.SandboxBatch], timeout: float = 30.0
                             ) -> tuple[list[list[tuple[SandboxRecord, int]]], Callable[[], Awaitable[None]]]:
        """`create_batches` in two steps, as `record_many`: returns once the batches are stored,
        with `announce`, which stores their members' first events and must be awaited before
        any member is handed on. Members of a refused batch get no event."""
        revisions, refused = await self._write_batches(batches, timeout)
        members = [b.records() for b in batches]  # as stored: seq 1 each

        async def announce() -> None:
            await self.publisher.publish_many([records.lifecycle_event(r, None) for n, rs in enumerate(members)
                                               if n not in refused for r in rs], timeout)

        if refused:
            with contextlib.suppress(errors.ServiceError, errors.SandfleetError, nats.errors.Error):
                await announce()
            raise BatchRefused({i: why for n, why in refused.items() for i in batches[n].ids()})
        return [[(r, 0) for r in rs] for rs in members], announce

    async def _write_batches(self, batches: list[sandbox.SandboxBatch], timeout: float
                             ) -> tuple[list[int], dict[int, str]]:
        return await self.jetstream.kv_write_many(
            sandbox.KV_BUCKET, [(sandbox.batch_key(b.token), encode(b), 0) for b in batches], timeout)

    async def record_many(self, batch: list[SandboxRecord], timeout: float = 30.0
                          ) -> tuple[list[tuple[SandboxRecord, int]], Callable[[], Awaitable[None]]]:
        """`create_many` in two steps, for a caller that may answer once the records are stored:
        returns when they are, with `announce`, which stores their first events (one wait for
        the acks; raises if refused or unanswered) and must be awaited before any sandbox of the
        batch is handed on, so no later event of one can come before its first. Sent one after
        the other, the events no longer compete with the records for the server, and none is
        stored for a record that was not. Records refused (BatchRefused) have no event; the
        written ones of that batch get theirs first, so their trail is whole when it ends."""
        firsts = [records.first(r) for r in batch]
        revisions, refused = await self.jetstream.kv_write_many(
            sandbox.KV_BUCKET, [(self._key(r), encode(r), 0) for r, _ in firsts], timeout)

        async def announce() -> None:
            await self.publisher.publish_many([e for n, (_, e) in enumerate(firsts) if n not in refused], timeout)

        if refused:
            with contextlib.suppress(errors.ServiceError, errors.SandfleetError, nats.errors.Error):
                await announce()
            raise BatchRefused({firsts[n][0].id: why for n, why in refused.items()})
        return [(r, revision) for (r, _), revision in zip(firsts, revisions)], announce

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
        moves: list[records.Move] = []
        for i in sandbox_ids:
            got = known.get(i)
            if got is None:
                out[i] = errors.ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {i}")
                continue
            try:
                move = records.advance(got[0], new, now, reason, detail)
            except errors.ServiceError as refusal:
                out[i] = refusal
                continue
            if move is None:
                out[i] = got[0]
            else:
                moves.append(move)
        revisions, _ = await self.jetstream.kv_write_many(
            sandbox.KV_BUCKET, [(self._key(r), encode(r), known[r.id][1]) for r, _ in moves], 30.0)
        keep = new not in ENDED  # an ended record is written no more: nothing to remember
        published = []
        for (updated, event), revision in zip(moves, revisions):
            if not revision:  # refused: someone else changed it meanwhile; judge it on what the store holds now
                try:
                    out[updated.id] = await self.transition(updated.id, new, reason, detail)
                except errors.ServiceError as exc:
                    out[updated.id] = exc
                continue
            if keep:
                self._written[updated.id] = (updated, revision)
            out[updated.id] = updated
            published.append(event)
        await self.publisher.publish_many(published, 30.0)
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
        """Move a sandbox to `new` (see `records.advance`), retrying on concurrent writers.
        `known`: the record and revision as the caller last saw them, tried (like what this
        process wrote last) before a read."""
        sent: records.Move | None = None
        for attempt in range(20):
            cached = (self._written.pop(sandbox_id, None) or known) if attempt == 0 else None
            record, revision = cached or await self.get(sandbox_id)
            if sent is not None and record == sent[0]:  # our write landed; its ack was lost in a failover
                await self.publisher.publish(sent[1])
                return record
            try:
                move = records.advance(record, new, time.time(), reason, detail, change, only_from)
            except errors.ServiceError:
                if cached:
                    continue  # judge a refusal only on what the store holds now
                raise
            if move is None:
                if cached:
                    continue  # likewise that there is nothing to do
                return record
            sent = move
            updated, event = move
            try:
                revision = await self._update(sandbox_id, updated, revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            if new not in ENDED:
                self._written[sandbox_id] = (updated, revision)
            await self.publisher.publish(event)
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
        payload, key = encode(record), self._key(record)
        return await through_failover(lambda: self.kv.update(key, payload, last=revision), f"update {sandbox_id}")

    async def all(self, node_id: str | None = None, include_ended: bool = False,
                  spent: list[str] | None = None) -> list[SandboxRecord]:
        """Every record (on `node_id`), read in one pass: an ordered consumer of each key's last
        value, not a key listing and then one read per key (at 32,000 sandboxes that was 64,000
        messages and 32,000 round trips a call). `spent`, if given, gets the keys of the batch
        records (on `node_id`) that no longer speak for any sandbox (`drop_batches`)."""
        gone: set[str] = set()
        latest = await kv_values(self.kv, "list sandboxes", gone=gone)
        batches = {b.token: b for b in (_batch.decode(v) for k, v in latest.items()
                                        if k.startswith(sandbox.BATCH_KEY_PREFIX))}
        resolved = record_keys.resolve({k: (_record.decode(v), 0) for k, v in latest.items()
                                        if sandbox.record_key_parts(k) is not None}, gone, batches)
        found = [r for r, _ in resolved.records.values()]
        for batch in batches.values():  # its members with no own record
            if node_id is None or batch.node == node_id:
                unwritten = record_keys.unwritten(batch.ids(), resolved, batches)
                found += [r for r, _ in unwritten.values()]
                if not unwritten and spent is not None:
                    spent.append(sandbox.batch_key(batch.token))
        return [r for r in found
                if (node_id is None or r.node == node_id) and (include_ended or r.state not in ENDED)]

    async def end_unrecorded(self, record: SandboxRecord, reason: Reason, detail: str) -> None:
        """The `failed` event of a sandbox whose record was never stored while its `scheduled`
        event may have been (`create_many` sends both at once): its trail ends instead of
        dangling. No record is written."""
        try:
            await self.publisher.publish(records.unrecorded_end(record, reason, detail, time.time()))
        except (errors.SandfleetError, nats.errors.Error):
            pass  # the bus that lost the record lost this too: nothing more to do

    async def forget(self, sandbox_id: str) -> None:
        """Drop an ended record; its events stay in the stream as the audit trail."""
        self._written.pop(sandbox_id, None)
        try:
            node_id = self._nodes.pop(sandbox_id, None) or (await self.get(sandbox_id))[0].node
            await self.kv.delete(sandbox.record_key(node_id, sandbox_id))  # the bucket takes no purges (`_bucket`)
        except (nats.errors.Error, nats.js.errors.Error, errors.ServiceError):  # a timeout too: the sandbox is gone either way
            pass

    async def rekey(self, timeout: float = 30.0) -> int:
        """Move the records of the layout before v3 (keyed by id alone) to `<node>.<id>`, for a
        platform upgraded with sandboxes on it, whose records readers would otherwise not find.
        For a user that may write every node's keys (placement, as it starts); safe to repeat
        and to run beside the nodes' writes: a new key written already (by a node since, or an
        earlier run) is kept, and the old key goes either way. Returns how many were moved."""
        latest = await kv_values(self.kv, "list sandboxes")
        old = {key: _record.decode(value) for key, value in latest.items()
               if "." not in key and not key.startswith(sandbox.BATCH_KEY_PREFIX)}
        old = {key: r for key, r in old.items() if r.id == key}
        if not old:
            return 0
        revisions, _ = await self.jetstream.kv_write_many(
            sandbox.KV_BUCKET, [(sandbox.record_key(r.node, r.id), encode(r), 0) for r in old.values()], timeout)
        marker = {"KV-Operation": "DEL"}
        refused = [why for why in map(refusal, await self.jetstream.burst(
            [(kv_subject(sandbox.KV_BUCKET, key), b"", marker) for key in old], timeout)) if why]
        if refused:
            log.warning("%d old record key(s) not deleted: %s", len(refused), refused[0])
        return sum(1 for revision in revisions if revision)

    async def drop_batches(self, keys: list[str], timeout: float = 30.0) -> None:
        """Purge batch records every member of which has its own record or was forgotten: they
        are read no more (an own record, or its purge marker, outranks the batch), and a batch
        of one would otherwise outlive its sandbox's record by its whole spec."""
        marker = {"KV-Operation": "PURGE"}  # what nats-py's kv.purge sends, less the rollup the bucket refuses
        refused = [why for why in map(refusal, await self.jetstream.burst(
            [(kv_subject(sandbox.KV_BUCKET, key), b"", marker) for key in keys], timeout)) if why]
        if refused:
            log.warning("%d spent batch record(s) not purged: %s", len(refused), refused[0])

    # -- what tests/test_placement_scale.py still reaches in for (their new names above) ----

    @property
    def _ingest(self) -> bool:
        return self.jetstream.fast_ingest

    async def _pipelined(self, messages: list[tuple[str, bytes, dict[str, str]]], timeout: float) -> None:
        await self.jetstream.append_many(messages, timeout)  # type: ignore[arg-type]

    _event = staticmethod(records.lifecycle_event)

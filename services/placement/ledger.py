"""The booking ledger every placement replica shares (KV `node-bookings`, one key per node).

A replica plans on its view, then books each node's share with a revision-checked update
of that node's key (one for all the requests waiting, every node's in one burst, see `book`);
if another replica booked the node meanwhile the update fails, the replica re-reads the key
and plans again, so two replicas never hand out the same room. A batch that cannot be booked
whole gives back what it booked. The same key carries the mark of a lost node: the replica
whose update sets `lost` fails that node's sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from sandfleet import errors
from sandfleet.bus import Bus, decode, encode
from sandfleet.jetstream import BatchedJetStream
from schemas.node import BOOKINGS_BUCKET, NodeBooking
from schemas.sandbox import SandboxSpec
from services.placement.policy import NoCapacity, NodeView, NoEligibleNode, UnknownNode, booked, released

log = logging.getLogger("sandfleet.placement")

ATTEMPTS = 8
WRITE_TIMEOUT_S = 5.0  # as nats-py's request timeout the single writes had


@dataclass
class _Request:
    spec: SandboxSpec
    count: int
    now: float
    node: str | None
    done: asyncio.Future
    raced: bool = False


class Ledger:
    def __init__(self, kv: KeyValue, view: NodeView, jetstream: BatchedJetStream) -> None:
        self.kv = kv
        self.view = view
        self.jetstream = jetstream  # a round's writes, one burst
        self.revisions: dict[str, int] = {}  # node → revision of the booking in the view
        self._booking = asyncio.Lock()
        self._waiting: list[_Request] = []

    @classmethod
    async def open(cls, bus: Bus, view: NodeView) -> Ledger:
        kv = await bus.js.create_key_value(
            KeyValueConfig(bucket=BOOKINGS_BUCKET, history=1, storage=StorageType.FILE, description="placement bookings")
        )
        return cls(kv, view, BatchedJetStream(bus))

    def seen(self, node_id: str, booking: NodeBooking | None, revision: int) -> None:
        """A booking from the watch or a read; an older revision than one we hold is ignored."""
        if revision < self.revisions.get(node_id, 0):
            return
        self.revisions[node_id] = revision
        self.view.set_booking(node_id, booking)

    async def refresh(self, node_id: str) -> None:
        try:
            entry = await self.kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            self.revisions[node_id] = 0
            self.view.set_booking(node_id, None)
            return
        self.revisions[node_id] = entry.revision
        self.view.set_booking(node_id, decode(entry.value, NodeBooking) if entry.value else None)

    async def _write(self, node_id: str, booking: NodeBooking, revision: int | None = None) -> bool:
        """Revision-checked write of one node's booking, against `revision` (the one the booking
        was computed from; by default the latest seen); False if another replica got there first
        or the bus did not answer (the node is then planned again on a fresh read)."""
        if revision is None:
            revision = self.revisions.get(node_id, 0)
        try:
            if revision == 0:
                new = await self.kv.create(node_id, encode(booking))
            else:
                new = await self.kv.update(node_id, encode(booking), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyValueError, nats.js.errors.APIError,
                nats.errors.Error):
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
                await self.refresh(node_id)
            return False
        self.seen(node_id, booking, new)
        return True

    async def _write_many(self, writes: dict[str, tuple[NodeBooking, int]]) -> dict[str, bool]:
        """`_write` for a round's nodes, sent as one burst with one wait for the acks (not one
        request each through nats-py): node → whether its write won."""
        nodes = list(writes)
        try:
            revisions, _ = await self.jetstream.kv_write_many(
                BOOKINGS_BUCKET, [(n, encode(b), revision) for n, (b, revision) in writes.items()], WRITE_TIMEOUT_S)
        except (errors.ServiceError, errors.SandfleetError, nats.errors.Error):
            revisions = [0] * len(nodes)  # unanswered: planned again on a fresh read, like a lost race
        for node_id, revision in zip(nodes, revisions):
            if revision:
                self.seen(node_id, writes[node_id][0], revision)
                continue
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
                await self.refresh(node_id)
        return {n: bool(revision) for n, revision in zip(nodes, revisions)}

    async def book(self, spec: SandboxSpec, count: int, now: float, node: str | None = None) -> dict[str, int]:
        """Book `count` sandboxes over the nodes (only `node` if given), all or nothing; returns node → count.

        One booking round at a time per replica, so requests of one replica never race each
        other for a node's revision: only another replica can make a write fail. Requests that
        arrive while a round's writes are out wait and are booked together in the next round,
        one revision-checked write per node for all of them (group commit), so a replica books
        as many batches per round trip as are waiting, not one."""
        request = _Request(spec, count, now, node, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        try:
            async with self._booking:
                if not request.done.done():
                    group, self._waiting = self._waiting, []
                    try:
                        await self._book_group(group)
                    finally:  # cancelled midway: the others learn it, and none waits for ever
                        for r in group:
                            if not r.done.done():
                                r.done.set_exception(NoCapacity("booking was interrupted; retry"))
        except asyncio.CancelledError:
            if request in self._waiting:
                self._waiting.remove(request)
            elif request.done.done() and not request.done.exception():
                asyncio.ensure_future(self.release(request.done.result(), spec))  # booked for nobody
            raise
        return request.done.result()

    async def _book_group(self, group: list[_Request]) -> None:
        """Plan every request in turn on the view (each sees the ones before it as booked), write
        each node's total once, revision-checked. A request with a share on a node whose write lost
        a race gives back what it got elsewhere and is planned again after a short random pause;
        one that then finds too little room may be seeing another replica's half-booked batch
        that is about to be given back, so it answers NoCapacity only after ATTEMPTS rounds."""
        left = group
        for attempt in range(ATTEMPTS):
            bases = dict(self.view.bookings)  # to put back what a planned request did not write
            planned: list[tuple[_Request, dict[str, int]]] = []
            totals: dict[str, NodeBooking] = {}
            for r in left:
                try:
                    plan = self.view.plan(r.spec, r.count, r.now, node=r.node)
                except (NoCapacity, UnknownNode, NoEligibleNode) as exc:  # this request's answer only
                    if isinstance(exc, NoCapacity) and r.raced and attempt < ATTEMPTS - 1:
                        planned.append((r, {}))  # again next round: a rival's batch may be given back
                    else:
                        r.done.set_exception(exc)
                    continue
                for node_id, k in plan.items():  # the next request plans on this one's shares
                    totals[node_id] = booked(self.view.nodes[node_id], self.view.bookings.get(node_id), k, r.spec)
                    self.view.bookings[node_id] = totals[node_id]
                planned.append((r, plan))
            # The revisions the totals were computed from, taken in the same step: a booking or
            # release seen before the writes run must make them fail, not be overwritten.
            revisions = {n: self.revisions.get(n, 0) for n in totals}
            for node_id in totals:
                self.view.set_booking(node_id, bases.get(node_id))
            written = await self._write_many({n: (b, revisions[n]) for n, b in totals.items()}) if totals else {}
            left = []
            for r, plan in planned:
                if plan and all(written[n] for n in plan):
                    r.done.set_result(plan)
                    continue
                await self.release({n: k for n, k in plan.items() if written[n]}, r.spec)
                r.raced = True
                left.append(r)
            if not left:
                return
            await asyncio.sleep(random.uniform(0.002, 0.02))
        for r in left:
            r.done.set_exception(NoCapacity(
                f"nodes kept being booked by other placement replicas; {r.count} unplaced, retry"))

    async def release(self, counts: dict[str, int], spec: SandboxSpec | None) -> None:
        """Give back bookings that will never reach their nodes (best effort, revision-checked)."""
        for node_id, k in counts.items():
            for _ in range(ATTEMPTS):
                current = self.view.bookings.get(node_id)
                if current is None or await self._write(node_id, released(current, k, spec)):
                    break

    async def mark_lost(self, node_id: str, lost: bool) -> bool:
        """Set or clear a node's lost mark; True for exactly one replica (the one whose
        revision-checked write won). The counts stay: if the node was only slow, what is on its
        way to it is still counted."""
        await self.refresh(node_id)
        current = self.view.bookings.get(node_id)
        if current is None or current.lost is lost:
            return False
        return await self._write(node_id, msgspec.structs.replace(current, lost=lost))

    async def watch(self) -> None:
        """Keep the view's bookings current, so a replica's first write usually wins."""
        while True:
            try:
                watcher = await self.kv.watchall()
                async for entry in watcher:
                    if entry is None:
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self.seen(entry.key, None, entry.revision)
                    else:
                        self.seen(entry.key, decode(entry.value, NodeBooking), entry.revision)
            except (nats.js.errors.Error, nats.errors.Error) as exc:
                log.warning("booking watch interrupted (%s); resuming", exc)
                await asyncio.sleep(0.5)

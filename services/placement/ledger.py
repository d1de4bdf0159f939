"""The booking ledger every placement replica shares (KV `node-bookings`, one key per node).

A replica plans on its view, then books each node's share with a revision-checked update
of that node's key; if another replica booked the node meanwhile the update fails, the
replica re-reads the key and plans the rest again, so two replicas never hand out the same
room. A batch that cannot be booked whole gives back what it booked. The same key carries
the mark of a lost node: the replica whose update sets `lost` fails that node's sandboxes.
"""

from __future__ import annotations

import asyncio
import logging
import random

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from sandfleet.bus import Bus, decode, encode
from schemas.node import BOOKINGS_BUCKET, NodeBooking
from schemas.sandbox import SandboxSpec
from services.placement.policy import NoCapacity, NodeView, booked, released

log = logging.getLogger("sandfleet.placement")

ATTEMPTS = 8


class Ledger:
    def __init__(self, kv: KeyValue, view: NodeView) -> None:
        self.kv = kv
        self.view = view
        self.revisions: dict[str, int] = {}  # node → revision of the booking in the view
        self._booking = asyncio.Lock()

    @classmethod
    async def open(cls, bus: Bus, view: NodeView) -> Ledger:
        kv = await bus.js.create_key_value(
            KeyValueConfig(bucket=BOOKINGS_BUCKET, history=1, storage=StorageType.FILE, description="placement bookings")
        )
        return cls(kv, view)

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

    async def _write(self, node_id: str, booking: NodeBooking) -> bool:
        """Revision-checked write of one node's booking; False if another replica got there first."""
        revision = self.revisions.get(node_id, 0)
        try:
            if revision == 0:
                new = await self.kv.create(node_id, encode(booking))
            else:
                new = await self.kv.update(node_id, encode(booking), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyValueError, nats.js.errors.APIError):
            await self.refresh(node_id)
            return False
        self.seen(node_id, booking, new)
        return True

    async def book(self, spec: SandboxSpec, count: int, now: float, node: str | None = None) -> dict[str, int]:
        """Book `count` sandboxes over the nodes (only `node` if given), all or nothing; returns node → count.

        One booking at a time per replica: requests of one replica never race each other for
        a node's revision, so only another replica can make a write fail. A batch that lost a
        race and then finds too little room may be seeing another replica's half-booked batch
        that is about to be given back: it gives back its own share and tries again after a
        short random pause before it answers NoCapacity."""
        async with self._booking:
            raced = False
            for _ in range(ATTEMPTS):
                done: dict[str, int] = {}
                try:
                    done, left = await self._book_once(spec, count, now, node)
                except NoCapacity:
                    if not raced:
                        raise
                    left = count
                if not left:
                    return done
                await self.release(done, spec)
                raced = True
                await asyncio.sleep(random.uniform(0.002, 0.02))
        raise NoCapacity(f"nodes kept being booked by other placement replicas; {count} unplaced, retry")

    async def _book_once(self, spec: SandboxSpec, count: int, now: float, node: str | None) -> tuple[dict[str, int], int]:
        """Book what the plan allows; on losing a race, plan the rest again. Returns the booked
        shares and how many are left (0: done). NoCapacity gives back what it booked first."""
        done: dict[str, int] = {}
        left = count
        for _ in range(ATTEMPTS):
            try:
                plan = self.view.plan(spec, left, now, node=node)
            except NoCapacity:
                await self.release(done, spec)
                raise
            results = await asyncio.gather(*(self._add(n, k, spec) for n, k in plan.items()))
            for (node_id, k), ok in zip(plan.items(), results):
                if ok:
                    done[node_id] = done.get(node_id, 0) + k
                    left -= k
            if not left:
                break
        return done, left

    async def _add(self, node_id: str, k: int, spec: SandboxSpec) -> bool:
        info = self.view.nodes.get(node_id)
        if info is None:
            return False
        return await self._write(node_id, booked(info, self.view.bookings.get(node_id), k, spec))

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

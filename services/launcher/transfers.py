"""The uploads and downloads in progress for one sandbox: chunks put back in order and checked
(the running digest of the transfer's check), a window bounding what the node holds per
transfer, and an idle sweep that removes a transfer whose
client vanished (with whatever it wrote). Attached to the sandbox's `Live`, so the sandbox's
end ends them too. Blocking disk work runs off the event loop, one call at a time per transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, field

from sandfleet.errors import ServiceError
from sandfleet.stream_check import RunningDigest, digest
from schemas.errors import ErrorCode
from schemas.files import WINDOW, Check
from services.launcher.drivers.base import DownloadSource, UploadSink

NAME = "files"  # its key in Live.attached
_FAILURES_KEPT = 16


@dataclass
class Transfer:
    id: str
    end: UploadSink | DownloadSource
    check: Check
    idle_s: float
    path: str = ""
    digest: RunningDigest = field(init=False)  # of the bytes written (upload) or read (download) so far, in order
    touched: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_seq: int = 0  # upload: the next chunk to write; download: the next to read
    held: dict[int, bytes] = field(default_factory=dict)  # chunks out of order (upload) or read ahead (download)
    acks: dict[int, asyncio.Future] = field(default_factory=dict)  # upload: held chunks' handlers, waiting
    writer: asyncio.Task | None = None  # upload: writing the held chunks in order (files._write_in_order)
    delivered: int = 0  # download: chunks below this were answered
    eof_seq: int = -1  # download: the chunk that was empty (the stream's end)
    failed: ServiceError | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.digest = digest(self.check)

    async def run(self, blocking, *args):
        """One blocking call on this transfer's end, off the loop; refused once it is closed."""
        if self.closed:
            raise ServiceError(ErrorCode.NOT_FOUND, f"transfer {self.id} has ended")
        return await asyncio.to_thread(blocking, *args)

    def hold(self, seq: int, data: bytes, waits: bool) -> asyncio.Future | None:
        """An upload's chunk kept until it is next; if it `waits`, a future done when it is
        written (or failed, or the transfer ended first)."""
        self.held[seq] = data
        if not waits:
            return None
        written = self.acks[seq] = asyncio.get_running_loop().create_future()
        return written

    def written(self, seq: int, failure: BaseException | None = None) -> None:
        """Chunk `seq` is written (or failed: then so does every chunk still held)."""
        ack = self.acks.pop(seq, None)
        if ack is not None and not ack.done():
            ack.set_result(None) if failure is None else ack.set_exception(failure)
        if failure is not None:
            self._let_go(failure)

    def _let_go(self, failure: BaseException) -> None:
        self.held.clear()
        for ack in self.acks.values():
            if not ack.done():
                ack.set_exception(failure)
        self.acks.clear()

    def write(self, data: bytes) -> None:
        """The upload's next chunk written and hashed (blocking: through `run`)."""
        self.end.write(data)  # type: ignore[union-attr]
        self.digest.update(data)

    def read(self) -> bytes:
        """The download's next chunk read and hashed (blocking: through `run`)."""
        data = self.end.read()  # type: ignore[union-attr]
        self.digest.update(data)
        return data

    async def close(self) -> None:
        """Abort an upload (what it wrote goes) or close a download; waits for the call in progress."""
        async with self.lock:
            if self.closed:
                return
            self.closed = True
            self._let_go(self.failed or ServiceError(ErrorCode.NOT_FOUND, f"transfer {self.id} has ended"))
            closing = getattr(self.end, "abort", None) or getattr(self.end, "close")
            await asyncio.to_thread(closing)


@dataclass
class Transfers:
    per_sandbox: int
    live: dict[str, Transfer] = field(default_factory=dict)
    # Why the last few transfers failed: their chunks still in flight get that, not "no transfer".
    failures: dict[str, ServiceError] = field(default_factory=dict)
    sweeper: asyncio.Task | None = None

    def add(self, end: UploadSink | DownloadSource, check: Check, idle_s: float, path: str) -> Transfer:
        transfer = Transfer(id=secrets.token_hex(12), end=end, check=check, idle_s=idle_s, path=path)
        self.live[transfer.id] = transfer
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return transfer

    def room(self) -> None:
        if len(self.live) >= self.per_sandbox:
            raise ServiceError(ErrorCode.CAPACITY, f"{len(self.live)} transfers in progress for this sandbox: "
                                                   "finish or close one first")

    def get(self, transfer_id: str) -> Transfer:
        transfer = self.live.get(transfer_id)
        if transfer is None and transfer_id in self.failures:
            raise self.failures[transfer_id]
        if transfer is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no transfer {transfer_id} in progress (it ended, or sat idle)")
        if transfer.failed is not None:
            raise transfer.failed
        transfer.touched = time.monotonic()
        return transfer

    async def close(self, transfer_id: str) -> bool:
        transfer = self.live.pop(transfer_id, None)
        if transfer is None:
            return False
        if transfer.failed is not None:
            self.failures[transfer_id] = transfer.failed
            while len(self.failures) > _FAILURES_KEPT:
                del self.failures[next(iter(self.failures))]
        await transfer.close()
        return True

    async def _sweep(self) -> None:
        while self.live:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for transfer in [t for t in self.live.values() if now - t.touched > t.idle_s and not t.lock.locked()]:
                await self.close(transfer.id)

    async def end(self) -> None:
        """The sandbox ends: every transfer is closed, partial uploads removed."""
        if self.sweeper is not None:
            self.sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sweeper
        for transfer_id in list(self.live):
            await self.close(transfer_id)


def in_window(transfer: Transfer, seq: int, low: int) -> None:
    if not low <= seq < low + 2 * WINDOW or seq in transfer.held:  # 2x: chunk requests may overtake each other
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"chunk {seq} is outside the transfer's window "
                                                      f"({low}..{low + 2 * WINDOW - 1}) or sent twice")

"""A bulk message's payload sent from its file by sendfile(2): the page cache's pages go to the
socket without being copied into Python and out of it again (natspy_bulk.publish_bulk calls
this for a `FileRange` payload). For a 1 GiB upload that was the client's largest cost after
reading the file to hash it: the copy into the socket (0.12 CPU-s a GiB here) and asyncio's copy
of whatever the socket did not take at once into its buffer (0.04), with a loop turn for each
part of it the socket took later.

The frame is written by a thread on a dup of the connection's socket while nothing else may
write to it: the asyncio transport's buffer is empty first, and nats-py's own writes (its
flusher, other publishes) are held in a list meanwhile (`_Held`) and written after, in order. A
plain TCP connection only: TLS and websockets keep the copying path (they cannot be bypassed).
A frame that could not be finished (the peer stopped reading past the deadline, the socket
failed) leaves the stream unusable, so the connection is aborted and nats-py reconnects.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
import weakref
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.transport import TcpTransport

_PAD = 1 << 20  # zeros written at a time where a file ended before its range did


@dataclass(frozen=True)
class FileRange:
    """A payload: `count` bytes of the open file `fd` from `offset`. Whoever made it read them
    once (to hash them); they are sent from the file again, so a file changed in between is
    caught by the transfer's end-to-end check, and one that shrank fails the send."""

    fd: int
    offset: int
    count: int

    def __len__(self) -> int:
        return self.count

    def read(self) -> bytes:
        """The bytes themselves (blocking), for a connection that cannot sendfile."""
        data = os.pread(self.fd, self.count, self.offset)
        if len(data) != self.count:
            raise FileShrank(self.count - len(data))
        return data


class FileShrank(ValueError):
    def __init__(self, missing: int) -> None:
        super().__init__(f"the file ended {missing} bytes before the range being sent (it changed while it was sent)")


class SendFailed(nats.errors.TimeoutError):
    """The frame could not go whole (the peer took nothing for the whole deadline, or the socket
    failed): the connection is aborted, and the request ends as one nobody answered in time
    (the bus's Timeout), as it did when asyncio's transport was left holding the bytes."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why

    def __str__(self) -> str:
        return self.why


_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one frame writer at a time per socket


def can_sendfile(transport: object) -> bool:
    writer = getattr(transport, "_io_writer", None)
    return (type(transport) is TcpTransport and writer is not None
            and writer is transport._bare_io_writer  # type: ignore[attr-defined]  # not upgraded to TLS
            and not writer.transport.is_closing() and writer.transport.get_extra_info("socket") is not None)


async def send_frame(nc: Client, head: bytes, part: FileRange, tail: bytes, timeout: float) -> None:
    """Write `head`, the file range and `tail` to nc's socket, as one frame nothing interleaves."""
    transport: TcpTransport = nc._transport  # type: ignore[assignment]
    stream = transport._io_writer.transport  # type: ignore[union-attr]
    lock = _locks.get(stream)
    if lock is None:
        lock = _locks[stream] = asyncio.Lock()
    async with lock:
        deadline = time.monotonic() + timeout
        while stream.get_write_buffer_size():  # what asyncio holds must reach the socket before our frame
            if stream.is_closing() or time.monotonic() > deadline:  # (rare: our frames leave nothing there)
                raise SendFailed("the bus took none of what was queued before a bulk message")
            await asyncio.sleep(0.0005)
        fd = os.dup(stream.get_extra_info("socket").fileno())  # if nats-py closes its own meanwhile
        held = _Held(transport)
        thread = asyncio.ensure_future(asyncio.to_thread(_write_frame, fd, head, part, tail, timeout))
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            await asyncio.wait([thread])  # the thread cannot be stopped: the frame is finished first
            raise
        except FileShrank:  # the frame went whole (padded)
            raise
        except OSError as exc:
            stream.abort()  # a half-written frame: the server would misread all that follows
            raise exc if isinstance(exc, SendFailed) else SendFailed(f"a bulk message's send failed: {exc}") from exc
        finally:
            os.close(fd)
            held.release()
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += part.count


class _Held:
    """nats-py's writes on `transport` kept in a list while a frame is written beside it, then
    written in the order they came (instance attributes shadow TcpTransport's methods)."""

    def __init__(self, transport: TcpTransport) -> None:
        self.transport, self.parts = transport, []
        transport.write = self.parts.append  # type: ignore[method-assign]
        transport.writelines = self.parts.extend  # type: ignore[method-assign]
        transport.drain = self._drained  # type: ignore[method-assign]

    @staticmethod
    async def _drained() -> None:
        return None

    def release(self) -> None:
        del self.transport.write, self.transport.writelines, self.transport.drain
        if self.parts and self.transport._io_writer is not None and not self.transport._io_writer.is_closing():
            self.transport.writelines(self.parts)


def _write_frame(fd: int, head: bytes, part: FileRange, tail: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    _write_all(fd, head, deadline)
    offset, end = part.offset, part.offset + part.count
    while offset < end:
        try:
            sent = os.sendfile(fd, part.fd, offset, end - offset)
        except BlockingIOError:
            _writable(fd, deadline)
            continue
        if sent == 0:
            break
        offset += sent
    missing = end - offset
    if missing:  # the frame is kept whole (zeros) so the connection stays usable, and the send fails
        pad = bytes(min(missing, _PAD))
        for at in range(0, missing, _PAD):
            _write_all(fd, memoryview(pad)[:min(_PAD, missing - at)], deadline)
    _write_all(fd, tail, deadline)
    if missing:
        raise FileShrank(missing)


def _write_all(fd: int, data: bytes | memoryview, deadline: float) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            _writable(fd, deadline)


def _writable(fd: int, deadline: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000):
        raise SendFailed("the bus took none of a bulk message's bytes before its deadline")

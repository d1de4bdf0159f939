"""Uploads and downloads of any size (`Sandbox.upload`, `Sandbox.download`): a file as its bytes,
a directory as a tar stream, in chunks of schemas.files.CHUNK_BYTES with up to WINDOW of them
in flight, hashed on both sides (the transfer's check: xxh3-128 unless sha256 is asked for,
sandfleet/stream_check.py) and compared at the end. A directory's tar stream is _tartree.py.

A download is written beside its destination under a temporary name and renamed into place,
so a local reader never sees half a file either. A tree from a sandbox is untrusted: its
members are unpacked only below the destination, never through a symlink, and devices, fifos
and setuid bits are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sandfleet import _tartree, natspy_sendfile, stream_check
from schemas import files as wire

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox

Progress = Callable[[int, int], None]  # (bytes so far, total bytes or -1 when unknown)
_TIMEOUT_S = 60.0
_HASH_PIECE = 256 << 10  # read and hashed at a time: stays in a core's cache between the two


# -- upload ---------------------------------------------------------------------------------

async def upload(sb: Sandbox, src: str | os.PathLike | bytes, path: str, *, mode: int | None = None,
                 progress: Progress | None = None, idle_s: float = 60.0,
                 check: wire.Check = "xxh3-128") -> wire.TransferDone:
    with contextlib.ExitStack() as opened:  # a file stays open until its last chunk is sent
        return await _upload(sb, src, path, opened, mode=mode, progress=progress, idle_s=idle_s, check=check)


async def _upload(sb: Sandbox, src: str | os.PathLike | bytes, path: str, opened: contextlib.ExitStack, *,
                  mode: int | None, progress: Progress | None, idle_s: float, check: wire.Check) -> wire.TransferDone:
    bus = sb._fleet.bus
    digest = stream_check.digest(check)  # updated by whoever makes the chunks, off the loop
    if isinstance(src, (bytes, bytearray, memoryview)):
        kind, total, chunks = "file", len(src), _bytes_chunks(bytes(src), digest)
        file_mode = 0o644 if mode is None else mode
    else:
        local = Path(src)
        st = local.stat()
        if stat.S_ISDIR(st.st_mode):
            kind, total, chunks, file_mode = "dir", -1, _tartree.tar_chunks(local, digest), 0
        else:
            f = opened.enter_context(open(local, "rb", buffering=0))
            kind, total, chunks = "file", st.st_size, _file_chunks(f.fileno(), digest)
            file_mode = stat.S_IMODE(st.st_mode) if mode is None else mode
    begin = wire.UploadRequest(sandbox_id=sb.id, path=path, kind=kind, mode=file_mode, idle_s=idle_s, check=check)
    transfer = await bus.request(sb._subject(wire.UPLOAD), begin, wire.Transfer, timeout=_TIMEOUT_S)
    size, seq = 0, 0
    inflight: set[asyncio.Task] = set()
    subject = sb._subject(wire.UPLOAD_CHUNK)
    try:
        async for data in chunks:
            while len(inflight) >= wire.WINDOW:
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                _raise_first(done)
            chunk = wire.UploadChunk(sandbox_id=sb.id, transfer_id=transfer.transfer_id, seq=seq)
            inflight.add(asyncio.ensure_future(
                bus.request_raw(subject, chunk, wire.ChunkAck, data=data, timeout=_TIMEOUT_S)))
            seq += 1
            size += len(data)
            if progress is not None:
                progress(size, total)
        if inflight:
            done, inflight = await asyncio.wait(inflight)
            _raise_first(done)
        end = wire.UploadEnd(sandbox_id=sb.id, transfer_id=transfer.transfer_id, chunks=seq, size=size,
                             digest=digest.hexdigest())
        done = await bus.request(sb._subject(wire.UPLOAD_END), end, wire.TransferDone, timeout=_TIMEOUT_S * 5)
    except BaseException:
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        await chunks.aclose()  # a tree's tar thread stops
        await _close_quietly(sb, transfer.transfer_id)
        raise
    if done.digest != digest.hexdigest():
        raise ValueError(f"upload of {path}: {check} {done.digest} on the node, {digest.hexdigest()} sent")
    return done


def _raise_first(done: set[asyncio.Task]) -> None:
    """The first failure among finished chunk requests (each one's exception retrieved)."""
    failures = [task.exception() for task in done]
    for failure in failures:
        if failure is not None:
            raise failure


async def _close_quietly(sb: Sandbox, transfer_id: str) -> None:
    with contextlib.suppress(Exception):
        req = wire.CloseRequest(sandbox_id=sb.id, transfer_id=transfer_id)
        await asyncio.shield(sb._fleet.bus.request(sb._subject(wire.CLOSE), req, wire.Closed, timeout=10))


async def _bytes_chunks(data: bytes, digest) -> AsyncIterator[memoryview]:
    view = memoryview(data)
    for i in range(0, len(data), wire.CHUNK_BYTES):
        chunk = view[i:i + wire.CHUNK_BYTES]
        await asyncio.to_thread(digest.update, chunk)
        yield chunk


def _hash_range(fd: int, offset: int, digest, scratch: bytearray) -> int:
    """Hash the next chunk of the file from `offset` (a thread: the read and the hash release the
    GIL); returns its length. Read in pieces of `scratch`'s size, each hashed while it is still
    in the CPU's cache, into one buffer used again and again."""
    view, got = memoryview(scratch), 0
    while got < wire.CHUNK_BYTES:
        n = os.preadv(fd, [view[:min(len(view), wire.CHUNK_BYTES - got)]], offset + got)
        if n == 0:
            break
        digest.update(view[:n])
        got += n
    return got


async def _file_chunks(fd: int, digest) -> AsyncIterator[natspy_sendfile.FileRange]:
    """The open file's chunks as ranges of it, each hashed here and sent from the file itself (by
    sendfile where the connection allows: natspy_sendfile.py), never copied into Python whole."""
    offset, scratch = 0, bytearray(_HASH_PIECE)
    while n := await asyncio.to_thread(_hash_range, fd, offset, digest, scratch):
        yield natspy_sendfile.FileRange(fd, offset, n)
        offset += n


# -- download -------------------------------------------------------------------------------

async def download(sb: Sandbox, path: str, dst: str | os.PathLike, *, progress: Progress | None = None,
                   idle_s: float = 60.0, check: wire.Check = "xxh3-128") -> wire.TransferDone:
    bus = sb._fleet.bus
    begin = wire.DownloadRequest(sandbox_id=sb.id, path=path, idle_s=idle_s, check=check)
    transfer = await bus.request(sb._subject(wire.DOWNLOAD), begin, wire.Transfer, timeout=_TIMEOUT_S)
    dst = Path(dst)
    temp = dst.parent / f".{dst.name}.sandfleet-{secrets.token_hex(6)}.part"
    sink = _FileSink(temp, transfer.mode) if transfer.kind == "file" else _tartree.TreeSink(temp)
    digest, size = stream_check.digest(transfer.check), 0
    chunks = _chunks(sb, transfer.transfer_id)
    # One chunk is written (in a thread) while the next ones come and more are asked for: written
    # inline, each write held the asking back, and a slow disk emptied the window.
    writing: asyncio.Future | None = None
    try:
        async for chunk, data in chunks:
            if writing is not None:
                await writing
                writing = None
            if chunk.eof:
                if chunk.digest != digest.hexdigest() or chunk.size != size:
                    raise ValueError(f"download of {path}: {transfer.check} {chunk.digest} ({chunk.size} bytes) on the node, "
                                     f"{digest.hexdigest()} ({size} bytes) received")
                break
            size += len(data)
            writing = asyncio.ensure_future(asyncio.to_thread(_write_hashed, sink, digest, data))
            if progress is not None:
                progress(size, transfer.size)
        if writing is not None:  # the stream ended without its eof chunk
            await writing
        await asyncio.to_thread(sink.commit, dst)
    except BaseException:
        if writing is not None:  # the sink is not aborted under a write still running
            await asyncio.gather(writing, return_exceptions=True)
        await asyncio.to_thread(sink.abort)
        raise
    finally:
        await chunks.aclose()  # the requests asked ahead are answered or cancelled first
        await _close_quietly(sb, transfer.transfer_id)
    return wire.TransferDone(size=size, digest=digest.hexdigest(), check=transfer.check)


def _write_hashed(sink: _FileSink | _tartree.TreeSink, digest, data: bytes) -> None:
    digest.update(data)
    sink.write(data)


async def _chunks(sb: Sandbox, transfer_id: str) -> AsyncIterator[tuple[wire.DownloadChunk, bytes]]:
    """The stream's chunks (each its header and bytes) in order, WINDOW requests ahead; the last
    one has `eof`."""
    bus = sb._fleet.bus
    subject = sb._subject(wire.DOWNLOAD_CHUNK)

    def ask(seq: int) -> asyncio.Future:
        req = wire.DownloadChunkRequest(sandbox_id=sb.id, transfer_id=transfer_id, seq=seq)
        return asyncio.ensure_future(bus.request_raw(subject, req, wire.DownloadChunk, timeout=_TIMEOUT_S))

    ahead = [ask(seq) for seq in range(wire.WINDOW)]
    asked = wire.WINDOW
    try:
        while True:
            chunk, data = await ahead.pop(0)
            yield chunk, data
            if chunk.eof:
                return
            ahead.append(ask(asked))
            asked += 1
    finally:
        for future in ahead:
            future.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)


class _FileSink:
    def __init__(self, temp: Path, mode: int) -> None:
        self.temp = temp
        self.f = open(temp, "xb")
        os.chmod(temp, mode & 0o777)

    def write(self, data: bytes) -> None:
        self.f.write(data)

    def commit(self, dst: Path) -> None:
        self.f.close()
        os.replace(self.temp, dst)

    def abort(self) -> None:
        self.f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp)


# -- the tree ---------------------------------------------------------------------------------

class Files:
    """`sb.files`: the sandbox's file tree. Paths are absolute in the sandbox; errors are NotFound
    (no such path), InvalidRequest (not a directory, not empty, escaping the root), Conflict
    (a quarantined sandbox is read-only)."""

    def __init__(self, sb: Sandbox) -> None:
        self._sb = sb

    async def _ask(self, verb: str, req, reply: type):
        return await self._sb._fleet.bus.request(self._sb._subject(verb), req, reply, timeout=_TIMEOUT_S)

    async def list(self, path: str = "/workspace", depth: int = 1) -> list[wire.Entry]:
        """What is under the directory `path`, `depth` levels down (symlinks listed, not followed)."""
        listing = await self._ask(wire.LIST, wire.ListRequest(sandbox_id=self._sb.id, path=path, depth=depth),
                                  wire.Listing)
        return listing.entries

    async def stat(self, path: str) -> wire.Entry:
        return await self._ask(wire.STAT, wire.StatRequest(sandbox_id=self._sb.id, path=path), wire.Entry)

    async def exists(self, path: str) -> bool:
        from sandfleet import errors
        try:
            await self.stat(path)
        except errors.NotFound:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        await self._ask(wire.MKDIR, wire.MkdirRequest(sandbox_id=self._sb.id, path=path, parents=parents, mode=mode),
                        wire.Done)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._ask(wire.REMOVE, wire.RemoveRequest(sandbox_id=self._sb.id, path=path, recursive=recursive),
                        wire.Done)

    async def rename(self, src: str, dst: str) -> None:
        await self._ask(wire.RENAME, wire.RenameRequest(sandbox_id=self._sb.id, src=src, dst=dst), wire.Done)

    def watch(self, path: str = "/workspace", *, recursive: bool = False, idle_s: float = 60.0) -> Watch:
        """Changes under the directory `path`: `async with sb.files.watch(p) as w: async for event in w`.
        Iteration ends when the directory goes, the sandbox ends or the watch is closed."""
        return Watch(self._sb, path, recursive, idle_s)


class Watch:
    """A watch of a sandbox directory, started by `async with` (or `await start()`), read by
    long polls. `dropped` counts events the node had to drop for a reader too slow."""

    def __init__(self, sb: Sandbox, path: str, recursive: bool, idle_s: float) -> None:
        self._sb, self.path, self._recursive, self._idle_s = sb, path, recursive, idle_s
        self.watch_id = ""
        self.dropped = 0
        self.ended = False

    async def start(self) -> Watch:
        req = wire.WatchRequest(sandbox_id=self._sb.id, path=self.path, recursive=self._recursive, idle_s=self._idle_s)
        reply = await self._sb._fleet.bus.request(self._sb._subject(wire.WATCH), req, wire.Watching, timeout=_TIMEOUT_S)
        self.watch_id = reply.watch_id
        return self

    async def __aenter__(self) -> Watch:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def poll(self, wait_s: float = 10.0) -> list[wire.FileEvent]:
        """The events since the last poll, waiting up to `wait_s` for one; [] once ended."""
        from sandfleet import errors
        if self.ended:
            return []
        req = wire.WatchNextRequest(sandbox_id=self._sb.id, watch_id=self.watch_id, wait_s=wait_s)
        try:
            got = await self._sb._fleet.bus.request(self._sb._subject(wire.WATCH_NEXT), req, wire.WatchEvents,
                                                    timeout=wait_s + 30)
        except errors.NotFound:  # the sandbox (or the watch) has ended
            self.ended = True
            return []
        self.dropped += got.dropped
        self.ended = got.ended
        return got.events

    async def __aiter__(self) -> AsyncIterator[wire.FileEvent]:
        while not self.ended:
            for event in await self.poll():
                yield event

    async def close(self) -> None:
        if self.watch_id and not self.ended:
            self.ended = True
            req = wire.WatchCloseRequest(sandbox_id=self._sb.id, watch_id=self.watch_id)
            with contextlib.suppress(Exception):
                await self._sb._fleet.bus.request(self._sb._subject(wire.WATCH_CLOSE), req, wire.Closed, timeout=10)

"""Uploads and downloads of any size (`Sandbox.upload`, `Sandbox.download`): a file as its bytes,
a directory as a tar stream, in chunks of schemas.files.CHUNK_BYTES with up to WINDOW of them
in flight, hashed (sha256) on both sides and compared at the end. Pure Python (stdlib tarfile).

A download is written beside its destination under a temporary name and renamed into place,
so a local reader never sees half a file either. A tree from a sandbox is untrusted: its
members are unpacked only below the destination, never through a symlink, and devices, fifos
and setuid bits are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import queue
import secrets
import shutil
import stat
import tarfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import files as wire

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox

Progress = Callable[[int, int], None]  # (bytes so far, total bytes or -1 when unknown)
_TIMEOUT_S = 60.0


# -- upload ---------------------------------------------------------------------------------

async def upload(sb: Sandbox, src: str | os.PathLike | bytes, path: str, *, mode: int | None = None,
                 progress: Progress | None = None, idle_s: float = 60.0) -> wire.TransferDone:
    bus = sb._fleet.bus
    digest = hashlib.sha256()  # updated by whoever makes the chunks, off the loop
    if isinstance(src, (bytes, bytearray, memoryview)):
        kind, total, chunks = "file", len(src), _bytes_chunks(bytes(src), digest)
        file_mode = 0o644 if mode is None else mode
    else:
        local = Path(src)
        st = local.stat()
        if stat.S_ISDIR(st.st_mode):
            kind, total, chunks, file_mode = "dir", -1, _tar_chunks(local, digest), 0
        else:
            kind, total, chunks = "file", st.st_size, _file_chunks(local, digest)
            file_mode = stat.S_IMODE(st.st_mode) if mode is None else mode
    begin = wire.UploadRequest(sandbox_id=sb.id, path=path, kind=kind, mode=file_mode, idle_s=idle_s)
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
                             sha256=digest.hexdigest())
        done = await bus.request(sb._subject(wire.UPLOAD_END), end, wire.TransferDone, timeout=_TIMEOUT_S * 5)
    except BaseException:
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        await chunks.aclose()  # a tree's tar thread stops
        await _close_quietly(sb, transfer.transfer_id)
        raise
    if done.sha256 != digest.hexdigest():
        raise ValueError(f"upload of {path}: sha256 {done.sha256} on the node, {digest.hexdigest()} sent")
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


def _read_hashed(f, digest) -> bytes:
    """The next chunk of `f`, hashed here (a thread: hashlib and read release the GIL)."""
    data = f.read(wire.CHUNK_BYTES)
    digest.update(data)
    return data


async def _file_chunks(local: Path, digest) -> AsyncIterator[bytes]:
    with open(local, "rb", buffering=0) as f:
        while data := await asyncio.to_thread(_read_hashed, f, digest):
            yield data


class _ToLoop(io.RawIOBase):
    """What a tar thread writes, handed to the event loop in chunks through a bounded queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue, digest) -> None:
        self._loop, self._out, self._held, self._digest = loop, out, bytearray(), digest
        self.abandoned = threading.Event()  # the upload failed: the tar thread stops at its next write

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._held += data
        while len(self._held) >= wire.CHUNK_BYTES:
            self._hand(bytes(self._held[:wire.CHUNK_BYTES]))
            del self._held[:wire.CHUNK_BYTES]
        return len(data)

    def _hand(self, data: bytes | BaseException | None) -> None:
        if isinstance(data, bytes):
            self._digest.update(data)
        handed = asyncio.run_coroutine_threadsafe(self._out.put(data), self._loop)
        while True:
            try:
                return handed.result(timeout=0.2)
            except TimeoutError:
                if self.abandoned.is_set():
                    handed.cancel()
                    raise BrokenPipeError("the upload was abandoned") from None

    def finish(self, error: BaseException | None) -> None:
        if self._held and error is None:
            self._hand(bytes(self._held))
        self._hand(error)


def _pack_tree(tar: tarfile.TarFile, top: Path) -> None:
    """The tree under `top` into `tar`, as `tar.add` would but without its user and group name
    look-ups per member, and with whole-second mtimes (a float one costs each member a pax
    header of its own): directories, regular files, symlinks and hard links; nothing else."""
    seen: dict[tuple[int, int], str] = {}  # (device, inode) of a file with several links: its first name
    stack = [(str(top), ".")]
    while stack:
        path, arc = stack.pop()
        st = os.lstat(path)
        info = tarfile.TarInfo(arc)
        info.mode, info.mtime, info.uid, info.gid = stat.S_IMODE(st.st_mode), int(st.st_mtime), st.st_uid, st.st_gid
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
            with os.scandir(path) as entries:
                names = sorted(e.name for e in entries)
            stack.extend((os.path.join(path, n), f"{arc}/{n}") for n in reversed(names))  # in order, depth first
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
                info.type, info.linkname = tarfile.LNKTYPE, seen[(st.st_dev, st.st_ino)]
                tar.addfile(info)
                continue
            if st.st_nlink > 1:
                seen[(st.st_dev, st.st_ino)] = arc
            with open(path, "rb") as f:
                info.size = os.fstat(f.fileno()).st_size
                tar.addfile(info, f)


async def _tar_chunks(local: Path, digest) -> AsyncIterator[bytes]:
    out: asyncio.Queue = asyncio.Queue(wire.WINDOW)
    writer = _ToLoop(asyncio.get_running_loop(), out, digest)

    def pack() -> None:
        error = None
        try:
            with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                _pack_tree(tar, local)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(Exception):
            writer.finish(error)

    thread = threading.Thread(target=pack, daemon=True)
    thread.start()
    try:
        while (item := await out.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        writer.abandoned.set()


# -- download -------------------------------------------------------------------------------

async def download(sb: Sandbox, path: str, dst: str | os.PathLike, *, progress: Progress | None = None,
                   idle_s: float = 60.0) -> wire.TransferDone:
    bus = sb._fleet.bus
    begin = wire.DownloadRequest(sandbox_id=sb.id, path=path, idle_s=idle_s)
    transfer = await bus.request(sb._subject(wire.DOWNLOAD), begin, wire.Transfer, timeout=_TIMEOUT_S)
    dst = Path(dst)
    temp = dst.parent / f".{dst.name}.sandfleet-{secrets.token_hex(6)}.part"
    sink = _FileSink(temp, transfer.mode) if transfer.kind == "file" else _TreeSink(temp)
    digest, size = hashlib.sha256(), 0
    chunks = _chunks(sb, transfer.transfer_id)
    try:
        async for chunk, data in chunks:
            if chunk.eof:
                if chunk.sha256 != digest.hexdigest() or chunk.size != size:
                    raise ValueError(f"download of {path}: sha256 {chunk.sha256} ({chunk.size} bytes) on the node, "
                                     f"{digest.hexdigest()} ({size} bytes) received")
                break
            size += len(data)
            await asyncio.to_thread(_write_hashed, sink, digest, data)
            if progress is not None:
                progress(size, transfer.size)
        await asyncio.to_thread(sink.commit, dst)
    except BaseException:
        await asyncio.to_thread(sink.abort)
        raise
    finally:
        await chunks.aclose()  # the requests asked ahead are answered or cancelled first
        await _close_quietly(sb, transfer.transfer_id)
    return wire.TransferDone(size=size, sha256=digest.hexdigest())


def _write_hashed(sink: _FileSink | _TreeSink, digest, data: bytes) -> None:
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


class _Pipe(io.RawIOBase):
    def __init__(self) -> None:
        self.chunks: queue.Queue = queue.Queue(wire.WINDOW)
        self.held = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.held:
            item = self.chunks.get()
            if item is None:
                return 0
            self.held = item
        n = min(len(buffer), len(self.held))
        buffer[:n] = self.held[:n]
        self.held = self.held[n:]
        return n


class _TreeSink:
    """A tar stream unpacked, in a thread, into a fresh directory that becomes the destination."""

    def __init__(self, temp: Path) -> None:
        self.temp = temp
        temp.mkdir(mode=0o700)
        self.pipe = _Pipe()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._unpack, daemon=True)
        self.thread.start()

    def _unpack(self) -> None:
        try:
            dirs: list[tuple[Path, int]] = []
            with tarfile.open(fileobj=io.BufferedReader(self.pipe, 1 << 20), mode="r|") as tar:
                for member in tar:
                    _unpack_member(tar, member, self.temp, dirs)
            for where, mode in reversed(dirs):  # last: a read-only directory must not stop its children
                os.chmod(where, mode)
            while self.pipe.readinto(bytearray(1 << 16)):  # padding after the tar's end
                pass
        except BaseException as exc:
            self.error = exc
            while self.pipe.chunks.get() is not None:  # let the writer finish
                pass

    def write(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.pipe.chunks.put(data)

    def commit(self, dst: Path) -> None:
        self.pipe.chunks.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        old = None
        if dst.is_symlink() or dst.exists():
            old = dst.parent / f".{dst.name}.sandfleet-{secrets.token_hex(6)}.old"
            os.rename(dst, old)
        os.rename(self.temp, dst)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else os.unlink(old)

    def abort(self) -> None:
        if self.thread.is_alive():
            self.error = self.error or BrokenPipeError()
            with contextlib.suppress(queue.Full):
                self.pipe.chunks.put(None, timeout=1)
            self.thread.join(timeout=5)
        shutil.rmtree(self.temp, ignore_errors=True)


def _unpack_member(tar: tarfile.TarFile, member: tarfile.TarInfo, top: Path, dirs: list[tuple[Path, int]]) -> None:
    parts = [p for p in member.name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"tar member {member.name!r} climbs out of the tree")
    member.mode &= 0o777 | stat.S_ISVTX
    if member.isdir():
        dirs.append((top.joinpath(*parts), member.mode))
        member.mode |= 0o700
    if not parts:
        return
    where = top
    for part in parts[:-1]:  # nothing written through a symlink the tree itself planted
        where = where / part
        if where.is_symlink() or not where.is_dir():
            raise ValueError(f"tar member {member.name!r} goes through a symlink or a non-directory")
    if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
        return  # devices, fifos: left out
    if member.islnk():
        link = [p for p in member.linkname.split("/") if p not in ("", ".")]
        if ".." in link or not link:
            raise ValueError(f"tar member {member.name!r}: a hard link out of the tree")
    tar.extract(member, top, set_attrs=not member.issym())


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

"""A directory as a tar stream, on the client: packed in a thread into chunks for an upload
(headers written here), and unpacked in a thread from a download's chunks by schemas/ustar.py,
the node's reader too. Pure Python.

A tree from a sandbox is untrusted: its members are unpacked only below the destination, never
through a symlink; devices and fifos are refused, setuid and setgid bits dropped, and nobody's
ownership is taken from the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import queue
import secrets
import shutil
import stat
import tarfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import schemas.ustar as ustar
from schemas import files as wire


class ToLoop(io.RawIOBase):
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


def _pack_tree(out: ToLoop, top: Path) -> None:
    """The tree under `top` as a tar stream written to `out`, headers made by `ustar.header` (tarfile's
    TarFile.add costs ~90 us a member in name look-ups, copies and checksums): directories,
    regular files, symlinks and hard links; nothing else. Whole-second mtimes (a float one
    would cost each member a pax header)."""
    seen: dict[tuple[int, int], str] = {}  # (device, inode) of a file with several links: its first name
    stack = [(str(top), ".")]
    written = 0
    while stack:
        path, arc = stack.pop()
        st = os.lstat(path)
        info = tarfile.TarInfo(arc)
        info.mode, info.mtime, info.uid, info.gid = stat.S_IMODE(st.st_mode), int(st.st_mtime), st.st_uid, st.st_gid
        parts: list[bytes] = []
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            parts.append(ustar.header(info))
            with os.scandir(path) as entries:
                names = sorted(e.name for e in entries)
            stack.extend((os.path.join(path, n), f"{arc}/{n}") for n in reversed(names))  # in order, depth first
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
            parts.append(ustar.header(info))
        elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
            info.type, info.linkname = tarfile.LNKTYPE, seen[(st.st_dev, st.st_ino)]
            parts.append(ustar.header(info))
        elif stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1:
                seen[(st.st_dev, st.st_ino)] = arc
            # os.open, not open(): a file object and its fstat were ~11 us of a small member's ~40
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                info.size = left = st.st_size  # as lstat saw it: what more it grew to since is not sent
                parts.append(ustar.header(info))
                while left:
                    data = os.read(fd, min(left, 1 << 20))
                    if not data:
                        raise OSError(f"{path} shrank while it was packed")
                    parts.append(data)
                    left -= len(data)
                    if left and len(parts) > 4:
                        written += out.write(b"".join(parts))
                        parts = []
            finally:
                os.close(fd)
            parts.append(ustar.padding(info.size))
        else:
            continue  # sockets, fifos and devices do not travel
        written += out.write(b"".join(parts))
    out.write(ustar.end(written))


async def tar_chunks(local: Path, digest) -> AsyncIterator[bytes]:
    out: asyncio.Queue = asyncio.Queue(wire.WINDOW)
    writer = ToLoop(asyncio.get_running_loop(), out, digest)

    def pack() -> None:
        error = None
        try:
            _pack_tree(writer, local)
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OneAtATime:
    """schemas.ustar.Beneath on any POSIX system: each directory on a member's way opened from
    its parent's fd with O_NOFOLLOW, so a symlink (one the tree itself planted) is never followed
    and nothing lands outside the top."""

    def __init__(self, top: int) -> None:
        self._top, self._parts, self._fd = top, None, -1

    def parts(self, name: str) -> list[str]:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"tar member {name!r} climbs out of the tree")
        return parts

    def open_dir(self, parts: list[str]) -> int:
        fd = os.dup(self._top)
        try:
            for part in parts:
                try:
                    below = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise ValueError(f"a tar member goes through a symlink or a non-directory: {'/'.join(parts)!r}") \
                        from None
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    def parent(self, parts: list[str]) -> int:
        if parts[:-1] != self._parts:
            self.close()
            self._fd, self._parts = self.open_dir(parts[:-1]), parts[:-1]
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._parts = -1, None


class TreeSink:
    """A tar stream unpacked, in a thread, into a fresh directory that becomes the destination."""

    def __init__(self, temp: Path) -> None:
        self.temp = temp
        temp.mkdir(mode=0o700)
        self.chunks: queue.Queue[bytes | bytearray | None] = queue.Queue(wire.WINDOW)  # None: the stream's end
        self._ended = False  # the unpack took the end
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._unpack, daemon=True)
        self.thread.start()

    def _next_chunk(self) -> bytes | bytearray:
        item = self.chunks.get()
        if item is None:
            self._ended = True
            return b""
        return item

    def _unpack(self) -> None:
        try:
            top = os.open(self.temp, _DIR_FLAGS)
            try:
                ustar.unpack(self._next_chunk, top, _OneAtATime(top))
            finally:
                os.close(top)
        except BaseException as exc:
            self.error = exc
            while not self._ended and self.chunks.get() is not None:  # let the writer finish
                pass

    def write(self, data: bytes | bytearray) -> None:
        if self.error is not None:
            raise self.error
        self.chunks.put(data)

    def commit(self, dst: Path) -> None:
        self.chunks.put(None)
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
                self.chunks.put(None, timeout=1)
            self.thread.join(timeout=5)
        shutil.rmtree(self.temp, ignore_errors=True)

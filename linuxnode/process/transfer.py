"""One upload or download of a sandbox's file or tree, fed or drained a chunk at a time.

An upload (`FileSink`, `TreeSink`) writes to a temporary name in the target's directory and
only `commit` renames it into place (a tree replacing what was there by an atomic exchange),
so nobody sees it half done; `abort` removes whatever it wrote. A download (`FileSource`,
`TreeSource`) reads a file, or packs a tree into a tar stream, a chunk at a time. The bytes'
end-to-end check is the caller's (the launcher's, the transfer protocol's). A tree's tar runs in a thread of its own joined to the chunks by a
bounded pipe, so a slow or vanished peer holds a few chunks, never the tree. Methods block
(disk I/O): the caller runs them off its event loop, one at a time per transfer.
"""

from __future__ import annotations

import ctypes
import os
import queue
import secrets
import shutil
import stat
import threading

from linuxnode import userns
from linuxnode.process import tree, ustar
from linuxnode.process.model import InitProcess
from linuxnode.process.resolve import IN_ROOT, check_path, exchange, open_in_sandbox, open_parent, sandbox_root_id

_EOF = b""
_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


class _Pipe:
    """Bytes from one thread to another through a bounded queue; `close` unblocks both ends."""

    def __init__(self, depth: int) -> None:
        self._queue: queue.Queue[bytes] = queue.Queue(depth)
        self.closed = threading.Event()

    def put(self, data: bytes) -> None:
        while not self.closed.is_set():
            try:
                return self._queue.put(data, timeout=0.2)
            except queue.Full:
                continue
        raise BrokenPipeError("the transfer was closed")

    def get(self) -> bytes:
        while not self.closed.is_set():
            try:
                return self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
        raise BrokenPipeError("the transfer was closed")


class _ChunkWriter:
    """The writing side of a pipe as a file for tarfile, handing on chunks of `size` bytes."""

    def __init__(self, pipe: _Pipe, size: int) -> None:
        self._pipe, self._size, self._parts, self._held = pipe, size, [], 0

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        self._held += len(data)
        if self._held >= self._size:
            joined = b"".join(self._parts)
            while len(joined) >= self._size:
                self._pipe.put(joined[:self._size])
                joined = joined[self._size:]
            self._parts, self._held = [joined], len(joined)
        return len(data)

    def flush_all(self) -> None:
        if self._held:
            self._pipe.put(b"".join(self._parts))
        self._pipe.put(_EOF)


class _Thread:
    """The tar side of a transfer; a failure closes its pipe (so the other side never waits on
    it) and is raised by the transfer's next call."""

    def __init__(self, pipe: _Pipe, target, *args) -> None:
        self.error: BaseException | None = None
        self._pipe = pipe
        self._thread = threading.Thread(target=self._run, args=(target, *args), daemon=True, name="sandfleet-tar")
        self._thread.start()

    def _run(self, target, *args) -> None:
        _libc.prctl(_PR_SET_NAME, b"sandfleet-tar", 0, 0, 0)  # so a leak check can find one left over
        try:
            target(*args)
        except BaseException as exc:
            self.error = exc
            self._pipe.closed.set()

    def join(self) -> None:
        self._thread.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class _Upload:
    """A temporary entry beside the target, renamed over it at the end."""

    def __init__(self, init: InitProcess, path: str) -> None:
        self.path = check_path(path)
        self.id_host = sandbox_root_id(init)  # what is made is made as the sandbox's root
        self.parent, self.name = open_parent(init, self.path)
        self.temp = f".{self.name[:200]}.sandfleet-{secrets.token_hex(6)}.part"
        self.size = 0
        self.done = False

    def _exists(self) -> os.stat_result | None:
        try:
            return os.stat(self.name, dir_fd=self.parent, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _close_parent(self) -> None:
        if self.parent >= 0:
            os.close(self.parent)
            self.parent = -1


class FileSink(_Upload):
    def __init__(self, init: InitProcess, path: str, mode: int) -> None:
        super().__init__(init, path)
        self.mode = mode & 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
        try:
            found = self._exists()
            if found is not None and stat.S_ISDIR(found.st_mode):
                raise IsADirectoryError(21, "Is a directory", self.path)
            with userns.acting_as(self.id_host):
                self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600, dir_fd=self.parent)
        except BaseException:
            self._close_parent()
            raise

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.size += len(data)

    def commit(self) -> None:
        os.fchmod(self.fd, self.mode)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.temp, self.name, src_dir_fd=self.parent, dst_dir_fd=self.parent)
        self.done = True
        self._close_parent()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.parent >= 0 and not self.done:
            try:
                os.unlink(self.temp, dir_fd=self.parent)
            except FileNotFoundError:
                pass
        self._close_parent()


class TreeSink(_Upload):
    def __init__(self, init: InitProcess, path: str, depth: int) -> None:
        super().__init__(init, path)
        try:
            with userns.acting_as(self.id_host):
                os.mkdir(self.temp, 0o700, dir_fd=self.parent)
            self.top = os.open(self.temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=self.parent)
        except BaseException:
            self._close_parent()
            raise
        self.pipe = _Pipe(depth)
        self.thread = _Thread(self.pipe, self._unpack)

    def _unpack(self) -> None:
        with userns.acting_as(self.id_host):  # in this thread, where the entries are made
            ustar.unpack(self.pipe.get, self.top)  # tree.py's rules at a third of tarfile's cost a member

    def write(self, data: bytes) -> None:
        self.thread.raise_error()
        if data:
            try:
                self.pipe.put(data)
            except BrokenPipeError:
                self.thread.join()
                self.thread.raise_error()
                raise
        self.size += len(data)

    def commit(self) -> None:
        try:
            self.pipe.put(_EOF)
        except BrokenPipeError:
            pass  # the unpacking failed: its error follows
        self.thread.join()
        self.thread.raise_error()
        os.close(self.top)
        self.top = -1
        if self._exists() is None:
            os.rename(self.temp, self.name, src_dir_fd=self.parent, dst_dir_fd=self.parent)
        else:  # swapped in at once, then what was there goes
            exchange(self.parent, self.temp, self.name)
        self.done = True
        self._remove_temp()
        self._close_parent()

    def _remove_temp(self) -> None:
        try:
            found = os.stat(self.temp, dir_fd=self.parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(found.st_mode):
            shutil.rmtree(self.temp, dir_fd=self.parent)  # fd-based: never follows a symlink out
        else:
            os.unlink(self.temp, dir_fd=self.parent)

    def abort(self) -> None:
        self.pipe.closed.set()
        self.thread.join()
        if self.top >= 0:
            os.close(self.top)
            self.top = -1
        if self.parent >= 0 and not self.done:
            self._remove_temp()
        self._close_parent()


class FileSource:
    kind = "file"

    def __init__(self, fd: int, st: os.stat_result, chunk: int) -> None:
        self.fd, self.size, self.mode, self.chunk = fd, st.st_size, st.st_mode & 0o7777, chunk
        self.sent = 0

    def read(self) -> bytes:
        data = os.read(self.fd, self.chunk)
        self.sent += len(data)
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class TreeSource:
    kind = "dir"

    def __init__(self, fd: int, st: os.stat_result, chunk: int, depth: int) -> None:
        self.fd, self.size, self.mode = fd, -1, st.st_mode & 0o7777
        self.sent = 0
        self.pipe = _Pipe(depth)
        self.writer = _ChunkWriter(self.pipe, chunk)
        self.thread = _Thread(self.pipe, self._pack)

    def _pack(self) -> None:
        tree.pack(self.fd, self.writer)
        self.writer.flush_all()

    def read(self) -> bytes:
        try:
            data = self.pipe.get()
        except BrokenPipeError:
            self.thread.join()
            self.thread.raise_error()
            raise
        if not data:
            self.thread.join()
            self.thread.raise_error()
        self.sent += len(data)
        return data

    def close(self) -> None:
        self.pipe.closed.set()
        self.thread.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_source(init: InitProcess, path: str, chunk: int, depth: int) -> FileSource | TreeSource:
    """What a download of `path` reads: a regular file, or a directory packed as tar."""
    path = check_path(path)
    fd = open_in_sandbox(init, path, os.O_RDONLY | os.O_NONBLOCK, IN_ROOT)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return TreeSource(fd, st, chunk, depth)
        if stat.S_ISREG(st.st_mode):
            return FileSource(fd, st, chunk)
        raise ValueError(f"{path} is neither a regular file nor a directory")
    except BaseException:
        os.close(fd)
        raise

"""Reading and writing a sandbox's files from the launcher. Each path is resolved with
openat2(RESOLVE_IN_ROOT) from the init's root, so no path or planted symlink leaves the
sandbox, and the sandbox's read-only mounts hold for the launcher too."""

from __future__ import annotations

import errno
import os
import stat

from linuxnode import syscalls as linux
from linuxnode.process.lifecycle import is_alive
from linuxnode.process.model import InitProcess
from linuxnode.process.resolve import as_sandbox_root

_RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS


def _sandbox_path(path: str) -> str:
    if "\0" in path:
        raise ValueError("path contains a NUL byte")
    return path if path.startswith("/") else "/workspace/" + path


def _open_in_sandbox(init: InitProcess, path: str, flags: int, mode: int = 0) -> int:
    try:
        root = os.open(f"/proc/{init.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running") from None
    try:
        if not is_alive(init):
            raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running")
        for _ in range(16):
            try:
                return linux.openat2(root, path, flags | os.O_CLOEXEC | os.O_NOCTTY, mode, _RESOLVE)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:  # a rename raced the resolution; resolve again
                    continue
                if exc.errno in (errno.EROFS, errno.EPERM, errno.EACCES):
                    raise PermissionError(exc.errno, exc.strerror, path) from None
                raise OSError(exc.errno, exc.strerror, path) from None
        raise OSError(errno.EAGAIN, "path kept changing while being resolved", path)
    finally:
        os.close(root)


def read_file(init: InitProcess, path: str, max_bytes: int) -> bytes:
    """A regular file of the sandbox; ValueError if it is larger than max_bytes or not regular.
    Relative paths are relative to /workspace."""
    path = _sandbox_path(path)
    fd = _open_in_sandbox(init, path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path} is {st.st_size} bytes, over the limit of {max_bytes}")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ValueError(f"{path} is over the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_file(init: InitProcess, path: str, data: bytes, mode: int = 0o644) -> int:
    """Create or replace a regular file of the sandbox (its directory must exist); returns
    the bytes written. Read-only places raise PermissionError."""
    path = _sandbox_path(path)
    with as_sandbox_root(init):
        fd = _open_in_sandbox(init, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode & 0o7777)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode & 0o7777)
        return len(data)
    finally:
        os.close(fd)

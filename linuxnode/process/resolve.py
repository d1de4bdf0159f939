"""Resolving a sandbox path from the host without ever leaving the sandbox's root.

Reads resolve with RESOLVE_IN_ROOT from the init's root (a symlink pointing out lands back
inside, as it would for the sandbox itself). Changes resolve with RESOLVE_BENEATH from that
root: a path through a symlink that points out of the root (absolute, or climbing above it)
is refused with `Escapes` instead of being followed, so it changes nothing. What the node
creates there it creates as the sandbox's root (`as_sandbox_root`). Inside a tree
being unpacked or packed nothing follows a symlink at all (RESOLVE_NO_SYMLINKS, O_NOFOLLOW).
"""

from __future__ import annotations

import ctypes
import errno
import os

from linuxnode import syscalls as linux
from linuxnode import userns
from linuxnode.process.lifecycle import is_alive
from linuxnode.process.model import InitProcess

IN_ROOT = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS
BENEATH = linux.RESOLVE_BENEATH | linux.RESOLVE_NO_MAGICLINKS
INSIDE_TREE = linux.RESOLVE_BENEATH | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS

_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


class Escapes(ValueError):
    """The path leads out of the sandbox's root (through a symlink); nothing was changed."""


def check_path(path: str) -> str:
    if "\0" in path:
        raise ValueError("path contains a NUL byte")
    if not path.startswith("/"):
        path = "/workspace/" + path
    if ".." in path.split("/"):
        raise Escapes(f"{path}: a path with '..' is refused")
    return path


def sandbox_root_id(init: InitProcess) -> int:
    """The host uid (and gid) of the sandbox's root: 0 without a user namespace."""
    try:
        return userns.mapped_root(init.pid)
    except OSError:
        raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running") from None


def as_sandbox_root(init: InitProcess):
    """A context in which this thread creates files as the sandbox's root (linuxnode.userns):
    what the node writes into a sandbox with a user namespace is its root's, as if it wrote it."""
    return userns.acting_as(sandbox_root_id(init))


def root_fd(init: InitProcess) -> int:
    try:
        fd = os.open(f"/proc/{init.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running") from None
    if not is_alive(init):
        os.close(fd)
        raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running")
    return fd


def openat(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2, again when a rename raced the resolution; EXDEV (it would leave) as `Escapes`."""
    flags |= os.O_CLOEXEC if flags & os.O_PATH else os.O_CLOEXEC | os.O_NOCTTY  # O_PATH takes no other flags
    if resolve & linux.RESOLVE_BENEATH:
        path = path.lstrip("/") or "."
    for _ in range(16):
        try:
            return linux.openat2(dirfd, path, flags, mode, resolve)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                continue
            if exc.errno == errno.EXDEV:
                raise Escapes(f"{path}: leads out of the sandbox's root through a symlink") from None
            if exc.errno == errno.ELOOP and resolve & linux.RESOLVE_NO_SYMLINKS:
                raise Escapes(f"{path}: goes through a symlink") from None
            raise OSError(exc.errno, exc.strerror, path) from None
    raise OSError(errno.EAGAIN, "path kept changing while being resolved", path)


def open_in_sandbox(init: InitProcess, path: str, flags: int, resolve: int = IN_ROOT, mode: int = 0) -> int:
    root = root_fd(init)
    try:
        return openat(root, path, flags, resolve, mode)
    finally:
        os.close(root)


def open_parent(init: InitProcess, path: str) -> tuple[int, str]:
    """The directory holding `path` (an O_PATH fd, resolved beneath the root) and the last name."""
    path = check_path(path).rstrip("/")
    parent, _, name = path.rpartition("/")
    if not name:
        raise ValueError("the sandbox's root itself cannot be replaced")
    return open_in_sandbox(init, parent or "/", os.O_PATH | os.O_DIRECTORY, BENEATH), name


def exchange(dirfd: int, a: str, b: str) -> None:
    """renameat2(RENAME_EXCHANGE): swap two names of one directory at once."""
    if _libc.renameat2(dirfd, a.encode(), dirfd, b.encode(), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), b)

"""inotify(7) through ctypes: one non-blocking instance, watches added on an open fd's inode
(through /proc/self/fd, so the path that was resolved safely is the one watched), events read
as typed tuples."""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_HEADER = struct.Struct("iIII")
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Event:
    wd: int
    mask: int
    cookie: int
    name: str


class Inotify:
    def __init__(self) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), "inotify_init1")
        self.fd = fd

    def add(self, dirfd: int, mask: int) -> int:
        """Watch the directory open as `dirfd` (any fd, O_PATH included); its watch descriptor."""
        wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dirfd}".encode(), mask | IN_ONLYDIR | IN_EXCL_UNLINK)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), "inotify_add_watch")
        return wd

    def remove(self, wd: int) -> None:
        _libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> list[Event]:
        """What is queued now (nothing, without blocking, if the queue is empty)."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        events, at = [], 0
        while at + _HEADER.size <= len(data):
            wd, mask, cookie, size = _HEADER.unpack_from(data, at)
            at += _HEADER.size
            name = data[at:at + size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            at += size
            events.append(Event(wd, mask, cookie, name))
        return events

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

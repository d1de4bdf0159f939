"""A directory tree as a tar stream packed from a directory fd of a sandbox, and the rules both
this and the unpacking (linuxnode/process/ustar.py) keep.

Nothing here follows a symlink: members are created relative to the tree's top with
RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, files opened O_NOFOLLOW, so a tar whose symlink
points out and a later member written "through" it is refused, and a sandbox's planted
symlink is packed as a symlink. Only directories, regular files, symlinks and hard links
travel; setuid/setgid bits are dropped (the node writes with host privileges, or as the sandbox's mapped root).
"""

from __future__ import annotations

import os
import stat
import tarfile
from typing import BinaryIO

import schemas.ustar as ustar  # the one module of schemas/ the node library reads: the wire format of a tree
from linuxnode.process.resolve import INSIDE_TREE, Escapes, openat

MAX_DEPTH = 256  # each level holds a directory fd while it is packed


def member_parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Escapes(f"tar member {name!r} climbs out of the tree")
    return parts


def parent_dir(top: int, parts: list[str]) -> int:
    if len(parts) == 1:
        return os.dup(top)
    return openat(top, "/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY, INSIDE_TREE)


class Parents:
    """The directory fd of the last member's parent, kept for the next member (a tar lists a
    directory's entries together): one openat2 per directory instead of one per member."""

    def __init__(self, top: int) -> None:
        self.top, self.parts, self.fd = top, None, -1

    def of(self, parts: list[str]) -> int:
        if parts[:-1] != self.parts:
            self.close()
            self.fd, self.parts = parent_dir(self.top, parts), parts[:-1]
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.parts = -1, None


def pack(top: int, out: BinaryIO) -> None:
    """The tree under the directory fd `top` as a tar stream written to `out` (names relative),
    headers by schemas/ustar.py (tarfile's TarFile.addfile cost ~70 us a member)."""
    written = _write(out, ustar.header(_info(".", os.fstat(top), tarfile.DIRTYPE)))
    written += _pack_dir(out, top, "", 0)
    out.write(ustar.end(written))


def _write(out: BinaryIO, data: bytes) -> int:
    out.write(data)
    return len(data)


def _info(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = st.st_mode & 0o7777
    info.mtime = int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    return info


def _pack_dir(out: BinaryIO, dirfd: int, prefix: str, depth: int) -> int:
    """The entries of `dirfd`, depth first, in name order; the bytes written."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{prefix}: the tree is deeper than {MAX_DEPTH} levels")
    written = 0
    for name in sorted(os.listdir(dirfd)):
        arc = prefix + name
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while being packed
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            try:
                written += _write(out, ustar.header(_info(arc, os.fstat(sub), tarfile.DIRTYPE)))
                written += _pack_dir(out, sub, arc + "/", depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    written += _pack_file(out, fd, arc, st)
            finally:
                os.close(fd)
        elif stat.S_ISLNK(st.st_mode):
            info = _info(arc, st, tarfile.SYMTYPE)
            info.linkname = os.readlink(name, dir_fd=dirfd)
            written += _write(out, ustar.header(info))
        # sockets, fifos and devices do not travel
    return written


def _pack_file(out: BinaryIO, fd: int, arc: str, st: os.stat_result) -> int:
    """A regular file's header, its `st_size` bytes (as they were when stat'ed: one that shrank
    meanwhile is an error, one that grew is cut there), its padding."""
    info = _info(arc, st, tarfile.REGTYPE)
    info.size = left = st.st_size
    written = _write(out, ustar.header(info))
    while left:
        data = os.read(fd, min(left, 1 << 20))
        if not data:
            raise OSError(f"{arc} shrank while it was packed")
        written += _write(out, data)
        left -= len(data)
    return written + _write(out, ustar.padding(st.st_size))

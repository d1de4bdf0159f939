"""A directory tree as a tar stream, packed from and unpacked into a directory fd of a sandbox.

Nothing here follows a symlink: members are created relative to the tree's top with
RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, files opened O_NOFOLLOW, so a tar whose symlink
points out and a later member written "through" it is refused, and a sandbox's planted
symlink is packed as a symlink. Only directories, regular files, symlinks and hard links
travel; setuid/setgid bits are dropped (the node writes as host root).
"""

from __future__ import annotations

import os
import stat
import tarfile
from typing import BinaryIO

from linuxnode.process.resolve import INSIDE_TREE, Escapes, openat

MAX_DEPTH = 256  # each level holds a directory fd while it is packed
_COPY = 1 << 20
_DROP = stat.S_ISUID | stat.S_ISGID


def _parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Escapes(f"tar member {name!r} climbs out of the tree")
    return parts


def _parent(top: int, parts: list[str]) -> int:
    if len(parts) == 1:
        return os.dup(top)
    return openat(top, "/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY, INSIDE_TREE)


class _Parents:
    """The directory fd of the last member's parent, kept for the next member (a tar lists a
    directory's entries together): one openat2 per directory instead of one per member."""

    def __init__(self, top: int) -> None:
        self.top, self.parts, self.fd = top, None, -1

    def of(self, parts: list[str]) -> int:
        if parts[:-1] != self.parts:
            self.close()
            self.fd, self.parts = _parent(self.top, parts), parts[:-1]
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.parts = -1, None


def unpack(stream: BinaryIO, top: int) -> None:
    """Every member of the tar `stream` under the directory `top` (empty, made by the caller)."""
    dir_modes: list[tuple[list[str], int, float]] = []
    parents = _Parents(top)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            parts = _parts(member.name)
            mode = member.mode & 0o7777 & ~_DROP
            if not parts:  # the top itself
                dir_modes.append((parts, mode, member.mtime))
                continue
            parent = parents.of(parts)
            name = parts[-1]
            try:
                if member.isdir():
                    try:
                        os.mkdir(name, 0o700, dir_fd=parent)
                    except FileExistsError:
                        if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                            raise
                    dir_modes.append((parts, mode, member.mtime))
                elif member.isreg():
                    _unpack_file(tar, member, parent, name, mode)
                elif member.issym():
                    os.symlink(member.linkname, name, dir_fd=parent)
                elif member.islnk():
                    source = _parts(member.linkname)
                    if not source:
                        raise ValueError(f"tar member {member.name!r}: a hard link to the top")
                    src_parent = _parent(top, source)
                    try:
                        os.link(source[-1], name, src_dir_fd=src_parent, dst_dir_fd=parent, follow_symlinks=False)
                    finally:
                        os.close(src_parent)
                else:
                    raise ValueError(f"tar member {member.name!r}: only files, directories and links travel")
            except BaseException:
                parents.close()
                raise
    parents.close()
    for parts, mode, mtime in reversed(dir_modes):  # last: a read-only directory must not stop its children
        fd = openat(top, "/".join(parts) or ".", os.O_RDONLY | os.O_DIRECTORY, INSIDE_TREE)
        try:
            os.fchmod(fd, mode)
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)


def _unpack_file(tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str, mode: int) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
    try:
        source = tar.extractfile(member)
        assert source is not None
        while data := source.read(_COPY):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        os.utime(fd, (member.mtime, member.mtime))
    finally:
        os.close(fd)


def pack(top: int, out: BinaryIO) -> None:
    """The tree under the directory fd `top` as a tar stream written to `out` (names relative)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        st = os.fstat(top)
        tar.addfile(_info(".", st, tarfile.DIRTYPE))
        _pack_dir(tar, top, "", 0)


def _info(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = st.st_mode & 0o7777
    info.mtime = int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    return info


def _pack_dir(tar: tarfile.TarFile, dirfd: int, prefix: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{prefix}: the tree is deeper than {MAX_DEPTH} levels")
    for name in sorted(os.listdir(dirfd)):
        arc = prefix + name
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while being packed
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            try:
                tar.addfile(_info(arc, os.fstat(sub), tarfile.DIRTYPE))
                _pack_dir(tar, sub, arc + "/", depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                info = _info(arc, st, tarfile.REGTYPE)
                info.size = st.st_size
                tar.addfile(info, f)
        elif stat.S_ISLNK(st.st_mode):
            info = _info(arc, st, tarfile.SYMTYPE)
            info.linkname = os.readlink(name, dir_fd=dirfd)
            tar.addfile(info)
        # sockets, fifos and devices do not travel

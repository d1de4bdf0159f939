"""A tree's tar stream (ustar, with pax `x` records and GNU long names: what sandfleet's client
and tarfile write) read without tarfile, and unpacked under a directory fd: the one reader of
the node (a tree upload, linuxnode/process/ustar.py) and of the client (a tree download,
sandfleet/_tartree.py); and the header blocks both write (`header`, `padding`, `end`).

tarfile costs ~60 us a member (a TarInfo, a checksum by struct, an ExFileObject and its buffers
per file); this reader parses the header blocks itself and writes each file's bytes to its fd
straight from the chunks that came over the bus, so a member costs little more than its
syscalls. The rules are the same on both sides: nothing written through a symlink (each member
made relative to its parent's fd, which the caller's `Beneath` opens beneath the top without
following any symlink), only directories, regular files, symlinks and hard links, setuid and
setgid dropped, nobody's ownership taken from the stream, directory modes set last. A
malformed stream (a bad checksum, a truncated member, a number that is not one) is a
ValueError, so the node answers it as a bad request.
"""

from __future__ import annotations

import os
import stat
import struct
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

BLOCK = 512
_RECORD = 20 * BLOCK
DROPPED_MODES = stat.S_ISUID | stat.S_ISGID
_REGULAR = (b"0", b"\0", b"7")  # 7: contiguous, a regular file to everyone but its maker
_KINDS = {b"5": "dir", b"2": "symlink", b"1": "link", **{t: "file" for t in _REGULAR}}
_PAX_KEYS = {"path", "linkpath", "size", "mtime"}


@dataclass
class Member:
    name: str
    kind: str  # "file", "dir", "symlink", "link", or "other" (a device, a fifo: refused)
    mode: int
    mtime: float
    size: int  # of its data in the stream (a file's; 0 for the others)
    linkname: str = ""


_ZERO_BLOCK = bytes(BLOCK)
_HALF = BLOCK // 2


def byte_sum(block: bytes) -> int:
    """The sum of a header block's bytes (its checksum's sum), by zlib's Adler-32, whose low half
    is 1 + the sum of the bytes modulo 65521: exact for 256 bytes (at most 65280), so two halves.
    `sum(block)` walks 512 Python ints, ~10 us a header at each end (a tenth of a 50K-file tree's
    time); this is well under a microsecond."""
    return (zlib.adler32(block[:_HALF]) & 0xFFFF) + (zlib.adler32(block[_HALF:]) & 0xFFFF) - 2


def _number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # base-256 (GNU), for what octal cannot hold
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 8)) if field[:1] == b"\xff" else value
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ValueError(f"a tar header field is not a number: {field!r}") from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


class Reader:
    """The members of a tar stream given as chunks by `next_chunk` (b"" at its end)."""

    def __init__(self, next_chunk: Callable[[], bytes | bytearray]) -> None:
        self._next = next_chunk
        self._chunk = memoryview(b"")
        self.ended = False  # next_chunk said b""

    def _more(self) -> bool:
        if self.ended:
            return False
        data = self._next()
        if not data:
            self.ended = True
            return False
        self._chunk = memoryview(data)
        return True

    def take(self, n: int) -> bytes:
        """The next `n` bytes of the stream; ValueError if it ends before."""
        if len(self._chunk) >= n:
            data, self._chunk = self._chunk[:n], self._chunk[n:]
            return bytes(data)
        parts, left = [bytes(self._chunk)], n - len(self._chunk)
        self._chunk = memoryview(b"")
        while left:
            if not self._more():
                raise ValueError("the tar stream ends inside a member")
            piece, self._chunk = self._chunk[:left], self._chunk[left:]
            parts.append(bytes(piece))
            left -= len(piece)
        return b"".join(parts)

    def copy_to(self, fd: int, size: int) -> None:
        """The next `size` bytes written to `fd` (straight from the chunks), then the padding skipped."""
        whole = size + -size % BLOCK
        if len(self._chunk) >= whole:  # the common small file: in the chunk at hand, one write
            piece = self._chunk[:size]
            while piece:
                piece = piece[os.write(fd, piece):]
            self._chunk = self._chunk[whole:]
            return
        left = size
        while left:
            if not self._chunk and not self._more():
                raise ValueError("the tar stream ends inside a file")
            piece = self._chunk[:left]
            self._chunk = self._chunk[len(piece):]
            left -= len(piece)
            while piece:
                piece = piece[os.write(fd, piece):]
        self.skip(-size % BLOCK)

    def skip(self, n: int) -> None:
        while n:
            if not self._chunk and not self._more():
                raise ValueError("the tar stream ends inside a member")
            step = min(n, len(self._chunk))
            self._chunk = self._chunk[step:]
            n -= step

    def drain(self) -> None:
        """Read to the stream's end (the tar's padding after its end blocks)."""
        self._chunk = memoryview(b"")
        while self._more():
            pass

    def members(self) -> Iterator[Member]:
        """Each member, its data next in the stream (read it with copy_to, or skip it); ends at
        the first zero block (or a stream that ends between members)."""
        pax: dict[str, str] = {}
        long_name = long_link = None
        while True:
            if not self._chunk and not self._more():
                return
            block = self.take(BLOCK)
            if block == _ZERO_BLOCK:
                return
            if _number(block[148:156]) != byte_sum(block) - sum(block[148:156]) + 8 * 32:
                raise ValueError("a tar header's checksum does not match (not a tar stream?)")
            kind, size = block[156:157], _number(block[124:136])
            if kind in (b"x", b"g", b"L", b"K"):
                data = self.take(size)
                self.skip(-size % BLOCK)
                if kind == b"x":
                    pax = _pax_records(data)
                elif kind == b"L":
                    long_name = _text(data)
                elif kind == b"K":
                    long_link = _text(data)
                continue  # b"g": global records, nothing of ours
            name = _text(block[0:100])
            if block[257:263] == b"ustar\0" and block[345]:  # POSIX ustar: a long name's directory part
                name = _text(block[345:500]) + "/" + name
            name = pax.get("path", long_name or name)
            member_kind = _KINDS.get(kind, "other")
            if member_kind == "file" and kind == b"\0" and name.endswith("/"):
                member_kind = "dir"  # an old tar's directory
            size = int(pax.get("size", size))
            member = Member(name=name, kind=member_kind, mode=_number(block[100:108]),
                            mtime=float(pax["mtime"]) if "mtime" in pax else _number(block[136:148]),
                            size=size if member_kind in ("file", "other") else 0,
                            linkname=pax.get("linkpath", long_link or _text(block[157:257])))
            pax, long_name, long_link = {}, None, None
            yield member


def _pax_records(data: bytes) -> dict[str, str]:
    """pax extended header records ("<length> <key>=<value>\\n"), the ones a member needs."""
    found: dict[str, str] = {}
    at = 0
    while at < len(data):
        space = data.find(b" ", at)
        if space < 0 or not data[at:space].isdigit():
            break
        length = int(data[at:space])
        if length <= space - at:
            raise ValueError("a malformed pax record in the tar stream")
        key, _, value = data[space + 1:at + length - 1].partition(b"=")
        text_key = key.decode("ascii", "replace")
        if text_key in _PAX_KEYS:
            found[text_key] = value.decode("utf-8", "surrogateescape")
        at += length
    return found


class Beneath(Protocol):
    """How an unpack reaches the places below its top, never leaving it: the caller's, since the
    node resolves with openat2 (Linux) and the client a component at a time (anywhere)."""

    def parts(self, name: str) -> list[str]:
        """A member's name as its components below the top ([] for the top); an error if it climbs."""

    def parent(self, parts: list[str]) -> int:
        """A directory fd of `parts[:-1]`, kept for the next member (a tar lists a directory's
        entries together), closed by `close`; an error if a symlink or a non-directory is in the way."""

    def open_dir(self, parts: list[str]) -> int:
        """A new fd of the directory `parts` (readable, for fchmod and utime), the caller's to close."""

    def close(self) -> None: ...


def unpack(next_chunk: Callable[[], bytes | bytearray], top: int, beneath: Beneath) -> None:
    """Every member of the tar stream given by `next_chunk` under the directory `top` (empty,
    made by the caller), then the stream read to its end."""
    reader = Reader(next_chunk)
    umask = _umask()
    dir_modes: list[tuple[list[str], int, float]] = []
    try:
        for member in reader.members():
            parts = beneath.parts(member.name)
            mode = member.mode & 0o7777 & ~DROPPED_MODES
            if not parts:  # the top itself
                dir_modes.append((parts, mode, member.mtime))
                reader.skip(member.size + -member.size % BLOCK)
                continue
            parent = beneath.parent(parts)
            name = parts[-1]
            if member.kind == "dir":
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                        raise
                dir_modes.append((parts, mode, member.mtime))
            elif member.kind == "file":
                _unpack_file(reader, member, parent, name, mode, umask)
            elif member.kind == "symlink":
                os.symlink(member.linkname, name, dir_fd=parent)
            elif member.kind == "link":
                source = beneath.parts(member.linkname)
                if not source:
                    raise ValueError(f"tar member {member.name!r}: a hard link to the top")
                src_parent = beneath.open_dir(source[:-1])
                try:
                    os.link(source[-1], name, src_dir_fd=src_parent, dst_dir_fd=parent, follow_symlinks=False)
                finally:
                    os.close(src_parent)
            else:
                raise ValueError(f"tar member {member.name!r}: only files, directories and links travel")
    finally:
        beneath.close()
    for parts, mode, mtime in reversed(dir_modes):  # last: a read-only directory must not stop its children
        fd = beneath.open_dir(parts)
        try:
            os.fchmod(fd, mode)
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)
    reader.drain()


def _unpack_file(reader: Reader, member: Member, parent: int, name: str, mode: int, umask: int) -> None:
    # Made with its mode at once where the umask leaves it whole (nobody else reaches the tree
    # before it is renamed into place: its top is the caller's, 0o700); a chmod after where not.
    whole = not mode & umask
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode if whole else 0o600,
                 dir_fd=parent)
    try:
        reader.copy_to(fd, member.size)
        if not whole:
            os.fchmod(fd, mode)
        os.utime(fd, (member.mtime, member.mtime))
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread
    for a moment); unknown (no /proc) counts as masking everything, so every file gets its chmod."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o7777


# -- writing --------------------------------------------------------------------------------------

_USTAR = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")


def header(info: tarfile.TarInfo) -> bytes:
    """The member's header block: written here for the common member (an ASCII name that fits
    ustar, small numbers) at a fraction of what TarInfo.tobuf costs, else by tobuf (pax)."""
    name = info.name + "/" if info.type == tarfile.DIRTYPE else info.name
    try:
        raw, link = name.encode("ascii"), info.linkname.encode("ascii")
    except UnicodeEncodeError:
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    prefix = b""
    if len(raw) > 100:  # ustar splits a long name at a slash: prefix (155) / name (100)
        cut = raw.rfind(b"/", 0, 156)
        if cut > 0 and len(raw) - cut - 1 <= 100:
            prefix, raw = raw[:cut], raw[cut + 1:]
    if len(raw) > 100 or len(link) > 100 or info.size >= 8 ** 11 or max(info.uid, info.gid) >= 8 ** 7 \
            or not 0 <= info.mtime < 8 ** 11:
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    block = _USTAR.pack(raw, b"%07o\0" % info.mode, b"%07o\0" % info.uid, b"%07o\0" % info.gid,
                        b"%011o\0" % info.size, b"%011o\0" % info.mtime, b" " * 8, info.type, link, b"ustar\0",
                        b"00", b"", b"", b"", b"", prefix)
    return block[:148] + b"%06o\0" % byte_sum(block) + block[155:]


def padding(size: int) -> bytes:
    """What follows a member's `size` bytes of data to its block's end."""
    return b"\0" * (-size % BLOCK)


def end(written: int) -> bytes:
    """The archive's end after `written` bytes: two zero blocks, then zeros to a whole record."""
    tail = 2 * BLOCK
    return b"\0" * (tail + (-(written + tail) % _RECORD))

"""The one tar reader (schemas/ustar.py), as the node unpacks an upload with it
(linuxnode/process/ustar.py: openat2 beneath the top) and as the client unpacks a download
(sandfleet/_tartree.py: a component at a time, O_NOFOLLOW): each unpacks what tarfile writes, in
every format, exactly as tarfile would, from chunks cut anywhere; and refuses what tree.py's
rules refuse, and a malformed stream, with a ValueError (a bad request on the node)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

import schemas.ustar as formats_ustar
from linuxnode.process import ustar
from linuxnode.process.resolve import Escapes
from sandfleet import _tartree


def _client_unpack(next_chunk, top: int) -> None:
    formats_ustar.unpack(next_chunk, top, _tartree._OneAtATime(top))


UNPACKERS = {"node": ustar.unpack, "client": _client_unpack}
# What each refuses a member leaving the top with: the node's Escapes answers as a bad request.
REFUSALS = {"node": Escapes, "client": ValueError}


@pytest.fixture(params=sorted(UNPACKERS))
def side(request) -> str:
    return request.param


def _tar(fmt: int, add) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        add(tar)
    return buf.getvalue()


def _member(tar: tarfile.TarFile, name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644,
            mtime: float = 1_600_000_000, linkname: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime, info.linkname, info.size = kind, mode, mtime, linkname, len(data)
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _tree(tar: tarfile.TarFile) -> None:
    long_dir = "d" * 120
    _member(tar, ".", tarfile.DIRTYPE, mode=0o755)
    _member(tar, "a", tarfile.DIRTYPE, mode=0o555)  # read-only: its children are written first
    _member(tar, "a/file.txt", data=b"hello\n" * 1000, mode=0o640)
    _member(tar, "a/empty", data=b"")
    _member(tar, "a/exec", data=os.urandom(70_000), mode=0o4755)  # setuid is dropped
    _member(tar, "a/link", tarfile.SYMTYPE, linkname="file.txt")
    _member(tar, "a/hard", tarfile.LNKTYPE, linkname="a/file.txt", mode=0o640)  # (tarfile chmods the inode to it)
    _member(tar, long_dir, tarfile.DIRTYPE)
    _member(tar, f"{long_dir}/{'n' * 90}", data=b"long name")  # ustar's prefix, or pax/GNU records
    _member(tar, "ünïcödé.txt", data="é".encode(), mtime=1_600_000_000.5)


def _chunks(data: bytes, size: int):
    pieces = [data[i:i + size] for i in range(0, len(data), size)] + [b""]
    return iter(pieces).__next__


def _unpack(side: str, data: bytes, where: Path, size: int = 1 << 20) -> None:
    where.mkdir()
    top = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        UNPACKERS[side](_chunks(data, size), top)
    finally:
        os.close(top)


def _seen(where: Path) -> list[tuple]:
    found = []
    for path in sorted(where.rglob("*")):
        st = path.lstat()
        body = path.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(path) if path.is_symlink() else ""
        found.append((str(path.relative_to(where)), stat.S_IMODE(st.st_mode) if not path.is_symlink() else 0,
                      st.st_mtime if not path.is_symlink() else 0, body, st.st_nlink if path.is_file() else 0))
    return found


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("size", [1 << 20, 511, 7])
def test_it_unpacks_what_tarfile_writes_as_tarfile_does(tmp_path, fmt, size, side):
    def plain(tar):  # what ustar alone holds: ascii names, a long one split at a slash
        _member(tar, "a", tarfile.DIRTYPE)
        _member(tar, "a/b", data=b"x" * 5000)
        _member(tar, "c" * 130, tarfile.DIRTYPE)
        _member(tar, "c" * 130 + "/" + "e" * 99, data=b"y")

    add = _tree if fmt != tarfile.USTAR_FORMAT else plain
    data = _tar(fmt, add)
    _unpack(side, data, tmp_path / "ours", size)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tmp_path / "theirs")
    ours, theirs = _seen(tmp_path / "ours"), _seen(tmp_path / "theirs")
    strip = stat.S_ISUID | stat.S_ISGID
    assert ours == [(p, m & ~strip, t, b, n) for p, m, t, b, n in theirs]
    assert len(ours) >= 2


def test_padding_after_the_end_is_read_to_the_stream_end(tmp_path, side):
    data = _tar(tarfile.PAX_FORMAT, lambda tar: _member(tar, "f", data=b"x")) + b"\0" * 20_000
    left = [data[i:i + 4096] for i in range(0, len(data), 4096)] + [b""]
    (tmp_path / "t").mkdir()
    top = os.open(tmp_path / "t", os.O_RDONLY | os.O_DIRECTORY)
    try:
        UNPACKERS[side](lambda: left.pop(0), top)
    finally:
        os.close(top)
    assert left == []  # read to the end marker, which the caller's pipe needs taken
    assert (tmp_path / "t" / "f").read_bytes() == b"x"


def test_a_symlink_planted_to_write_through_is_refused(tmp_path, side):
    def add(tar):
        _member(tar, "out", tarfile.SYMTYPE, linkname=str(tmp_path / "victim"))
        _member(tar, "out/pwned", data=b"x")

    (tmp_path / "victim").mkdir()
    with pytest.raises(REFUSALS[side]):
        _unpack(side, _tar(tarfile.PAX_FORMAT, add), tmp_path / "t")
    assert not (tmp_path / "victim" / "pwned").exists()


@pytest.mark.parametrize("name", ["../up", "a/../../up", "/abs/../../up"])
def test_a_member_climbing_out_is_refused(tmp_path, name, side):
    with pytest.raises(REFUSALS[side]):
        _unpack(side, _tar(tarfile.PAX_FORMAT, lambda tar: _member(tar, name, data=b"x")), tmp_path / "t")
    assert not (tmp_path / "up").exists()


def test_devices_and_fifos_are_refused(tmp_path, side):
    with pytest.raises(ValueError, match="only files, directories and links"):
        _unpack(side, _tar(tarfile.PAX_FORMAT, lambda tar: _member(tar, "fifo", tarfile.FIFOTYPE)), tmp_path / "t")


def test_garbage_a_bad_checksum_and_a_truncated_member_are_value_errors(tmp_path, side):
    good = _tar(tarfile.PAX_FORMAT, lambda tar: _member(tar, "f", data=b"x" * 3000))
    with pytest.raises(ValueError, match="checksum|not a number"):
        _unpack(side, os.urandom(4096), tmp_path / "garbage")
    flipped = bytearray(good)
    flipped[0] ^= 1  # the first header's checksum no longer matches it
    with pytest.raises(ValueError, match="checksum"):
        _unpack(side, bytes(flipped), tmp_path / "flipped")
    cut = good[:good.index(b"x" * 100) + 1000]
    with pytest.raises(ValueError, match="ends inside"):
        _unpack(side, cut, tmp_path / "cut")


def test_the_nodes_pack_is_a_tar_that_tarfile_and_our_reader_read_as_the_tree_it_was(tmp_path, side):
    from linuxnode.process import tree

    src = tmp_path / "src"
    (src / "a" / ("d" * 120)).mkdir(parents=True)
    (src / "a" / "file.txt").write_bytes(b"hello\n" * 1000)
    (src / "a" / "empty").write_bytes(b"")
    (src / "a" / ("d" * 120) / ("n" * 90)).write_bytes(os.urandom(70_000))  # past ustar's 100: prefix or pax
    (src / "ünïcödé.txt").write_bytes("é".encode())
    (src / "a" / "link").symlink_to("file.txt")
    os.chmod(src / "a" / "file.txt", 0o640)
    for path in [*src.rglob("*"), src]:
        if not path.is_symlink():
            os.utime(path, (1_600_000_000, 1_600_000_000))
    buf = io.BytesIO()
    top = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tree.pack(top, buf)
    finally:
        os.close(top)
    data = buf.getvalue()
    assert len(data) % (20 * 512) == 0  # whole records, as tar writes them
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tmp_path / "theirs")
    _unpack(side, data, tmp_path / "ours", 4096)
    assert _seen(tmp_path / "theirs") == _seen(src) == _seen(tmp_path / "ours")

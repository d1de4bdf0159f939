"""A microVM's files of any size and its file tree, through the guest agent: uploads and
downloads of one file in chunks, stat, list, mkdir, remove, rename (frames.FsOp). The agent
does each step in a child chrooted into the sandbox's root, so a path resolves as a process of
the sandbox would resolve it (the guest is the sandbox: there is no host tree to escape to).

These run on the launcher's worker threads (its transfer and file-tree calls block); `call`
runs one of the channel's coroutines on the event loop and waits for it. The launcher hashes what it
sends and what it receives itself (services/launcher/transfers.py): nothing of the guest's word is
trusted for a digest.
"""

from __future__ import annotations

import posixpath
import secrets
import tarfile
from collections.abc import Iterator
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from linuxnode.vm import frames
from linuxnode.vm.channel import AgentChannel
from linuxnode.vm.frames import Entry, FsOp

T = TypeVar("T")
Call = Callable[[Callable[[], Coroutine[Any, Any, T]]], T]


def _checked(path: str) -> str:
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise ValueError(f"{path[:200]!r} is not an absolute path")
    return posixpath.normpath(path) if path != "/" else "/"


def as_dict(entry: Entry) -> dict:
    """schemas.files.Entry's fields, as the other levels answer them."""
    return {"path": entry.path, "kind": entry.kind, "size": entry.size, "mode": entry.mode, "mtime": entry.mtime,
            "target": entry.target}


def stat(channel: AgentChannel, call: Call, path: str) -> dict:
    found = call(lambda: channel.file_tree(FsOp.STAT, _checked(path)))
    assert found is not None
    return as_dict(found.entries[0])


def list_dir(channel: AgentChannel, call: Call, path: str, depth: int, limit: int) -> tuple[list[dict], bool]:
    top = _checked(path)
    found = call(lambda: channel.file_tree(FsOp.LIST, max(depth, 1), min(limit, frames.MAX_LISTED), top))
    assert found is not None
    prefix = top.rstrip("/") + "/"
    for e in found.entries:  # a guest naming what was not asked
        parts = e.path[len(prefix):].split("/") if e.path.startswith(prefix) else [""]
        if any(part in ("", ".", "..") for part in parts):
            raise channel.fail("the guest listed entries outside the directory asked for")
    return [as_dict(e) for e in found.entries], found.truncated


def mkdir(channel: AgentChannel, call: Call, path: str, parents: bool, mode: int) -> None:
    call(lambda: channel.file_tree(FsOp.MKDIR, int(parents), mode & 0o7777, _checked(path)))


def remove(channel: AgentChannel, call: Call, path: str, recursive: bool) -> None:
    if _checked(path) == "/":
        raise ValueError("the root cannot be removed")
    call(lambda: channel.file_tree(FsOp.REMOVE, int(recursive), _checked(path)))


def rename(channel: AgentChannel, call: Call, src: str, dst: str) -> None:
    call(lambda: channel.file_tree(FsOp.RENAME, _checked(src), _checked(dst)))


class FileSink:
    """An upload of one file: written to a temporary name beside `path`, renamed over it at commit."""

    def __init__(self, channel: AgentChannel, call: Call, path: str, mode: int) -> None:
        self.channel, self.call = channel, call
        self.path = _checked(path)
        if self.path == "/":
            raise IsADirectoryError(21, "Is a directory", path)
        parent, name = posixpath.split(self.path)
        self.temp = posixpath.join(parent, f".{name[:200]}.sandfleet-{secrets.token_hex(6)}.part")
        self.mode = mode & 0o777  # no set-id bits from an upload, as at the other levels
        self.size = 0
        self.done = False
        try:
            if stat(channel, call, self.path)["kind"] == "dir":
                raise IsADirectoryError(21, "Is a directory", path)
        except FileNotFoundError:
            pass
        call(lambda: channel.write_file(self.temp, b"", self.mode))  # made now: a missing parent fails here

    def write(self, data: bytes) -> None:
        self.call(lambda: self.channel.write_file(self.temp, data, self.mode, append=True))
        self.size += len(data)


    def commit(self) -> None:
        rename(self.channel, self.call, self.temp, self.path)
        self.done = True

    def abort(self) -> None:
        if not self.done and not self.channel.broken:
            try:
                remove(self.channel, self.call, self.temp, False)
            except OSError:
                pass
        self.done = True


class FileSource:
    """A download of one file, read `chunk` bytes at a time from its offset."""

    kind = "file"

    def __init__(self, channel: AgentChannel, call: Call, path: str, chunk: int) -> None:
        self.channel, self.call = channel, call
        self.path = _checked(path)
        entry = stat(channel, call, self.path)
        if entry["kind"] == "dir":
            raise IsADirectoryError(21, "Is a directory", path)
        self.size, self.mode, self.chunk = entry["size"], entry["mode"], max(chunk, 1)
        self.sent = 0
        self.ended = False

    def read(self) -> bytes:
        out = bytearray()
        while len(out) < self.chunk and not self.ended:
            want = min(self.chunk - len(out), frames.MAX_READ)
            data, self.ended = self.call(lambda: self.channel.read_at(self.path, self.sent + len(out), want))
            out += data
        self.sent += len(out)
        return bytes(out)


    def close(self) -> None:
        self.ended = True


TREE_DEPTH = 256  # how deep a tree download lists


class TreeSource:
    """A download of a directory as a tar stream the node writes itself from the agent's listing
    and file reads (names checked to lie under the directory, sizes as listed: a file that grew or
    shrank meanwhile is cut or padded). A tree of more than frames.MAX_LISTED entries is refused."""

    kind = "dir"

    def __init__(self, channel: AgentChannel, call: Call, path: str, chunk: int, top: dict) -> None:
        self.channel, self.call = channel, call
        self.path, self.chunk = _checked(path), max(chunk, tarfile.BLOCKSIZE)
        self.size, self.mode = -1, top["mode"]
        entries, truncated = list_dir(channel, call, self.path, TREE_DEPTH, frames.MAX_LISTED)
        if truncated:
            raise ValueError(f"{path} holds more than {frames.MAX_LISTED} entries: download its parts")
        self.entries = entries
        self.sent = 0
        self._stream = self._tar()
        self._pending = bytearray()

    def _tar(self) -> Iterator[bytes]:
        written = 0
        for piece in self._members():
            written += len(piece)
            yield piece
        # Padded to whole records, as tarfile writes them: the client's unpack reads records, and
        # one cut short waits for an end its reader has already taken.
        yield b"\0" * (-written % tarfile.RECORDSIZE)

    def _members(self) -> Iterator[bytes]:
        prefix = self.path.rstrip("/") + "/"
        for entry in self.entries:
            info = tarfile.TarInfo(entry["path"][len(prefix):])
            info.mode, info.mtime = entry["mode"], int(entry["mtime"])
            if entry["kind"] == "dir":
                info.type = tarfile.DIRTYPE
            elif entry["kind"] == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, entry["target"]
            elif entry["kind"] == "file":
                info.size = entry["size"]
            else:
                continue  # devices, fifos, sockets: not carried (as at the other levels)
            yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            left, at = info.size, 0
            while left > 0:
                want = min(left, frames.MAX_READ)
                data, ended = self.call(lambda: self.channel.read_at(entry["path"], at, want))
                data = data[:want] if data else b"\0" * want  # shrunk meanwhile: padded
                at, left = at + len(data), left - len(data)
                yield data
                if ended and left > 0:
                    yield b"\0" * left
                    left = 0
            if info.size % tarfile.BLOCKSIZE:
                yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
        yield b"\0" * (2 * tarfile.BLOCKSIZE)

    def read(self) -> bytes:
        while len(self._pending) < self.chunk:
            piece = next(self._stream, None)
            if piece is None:
                break
            self._pending += piece
        out = bytes(self._pending[:self.chunk])
        del self._pending[:self.chunk]
        self.sent += len(out)
        return out


    def close(self) -> None:
        self._stream.close()


def open_source(channel: AgentChannel, call: Call, path: str, chunk: int) -> FileSource | TreeSource:
    top = stat(channel, call, path)
    if top["kind"] == "dir":
        return TreeSource(channel, call, path, chunk, top)
    if top["kind"] != "file":
        raise ValueError(f"{path} is neither a regular file nor a directory")
    return FileSource(channel, call, path, chunk)

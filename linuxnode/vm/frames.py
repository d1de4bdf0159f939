"""The wire between the node and a microVM's guest agent (guest/agent.c), over one
virtio-serial port: frames of a 4-byte big-endian length and a payload, both ways.

Requests (node → guest) are fixed binary layouts, `u8 op | u32 id | fields`, strings as
`u32 length | bytes`: the guest parses them in a few lines of C. Answers (guest → node) are
msgpack arrays, `[kind, id, ...]`, decoded here into one tagged union of frozen Structs whose
every field is typed and bounded. Nothing a guest sends is trusted: a frame over MAX_FRAME, a
payload that is not one of these messages, or a field out of its bounds is a `GuestProtocolError`,
and the node then kills the VM (see channel.py). No answer names a path or a command the host
acts on; the host only ever copies their bytes to the sandbox's caller.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

MAX_FRAME = (1 << 20) + 64  # the agent's own cap on a frame, plus its msgpack header
CHUNK = 64 << 10  # what the agent reads from a command's pipe at once
MAX_READ = 8 * CHUNK  # the most one read-file answer carries
# A forwarded connection's bytes in flight each way, acknowledged by the receiving end as it
# passes them on: a guest that sends beyond the node's acks is breaking the protocol, and the
# agent never holds more than this of the node's for a socket that does not read.
PORT_WINDOW = 4 * CHUNK
_LEN = struct.Struct(">I")


class GuestProtocolError(Exception):
    """The guest sent something the protocol does not allow: it is killed, its sandbox fails."""


class Op(IntEnum):
    EXEC = 1
    STDIN = 2
    CLOSE_STDIN = 3
    SIGNAL = 4
    WRITE_FILE = 5
    READ_FILE = 6
    PING = 7
    SETUP = 8
    RESET = 9
    # port forwards (see PORT_WINDOW): a TCP connection the agent opens to the guest's loopback
    PORT_OPEN = 10
    PORT_DATA = 11
    PORT_EOF = 12  # the node's side is done writing: the agent shuts down its socket's write side
    PORT_CLOSE = 13
    PORT_ACK = 14  # the node has passed on this many bytes of the guest's
    PORT_LISTENS = 15
    RESIZE = 16  # a terminal's window
    FS = 17  # one operation on the file tree (FsOp), done by the agent in the sandbox's root
    # saving a running machine's state: QUIESCE (answered, then the agent sends nothing), then
    # RESUME in the machine that goes on, DETACH in one restored from the state
    QUIESCE = 18
    RESUME = 19
    DETACH = 20


class FsOp(IntEnum):
    STAT = 1
    LIST = 2
    MKDIR = 3
    REMOVE = 4
    RENAME = 5


# -- requests -----------------------------------------------------------------------------------

def _string(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _LEN.pack(len(data)) + data


def request(op: Op, request_id: int, body: bytes = b"") -> bytes:
    payload = bytes([op]) + _LEN.pack(request_id) + body
    if len(payload) > MAX_FRAME - 64:
        raise ValueError(f"a request of {len(payload)} bytes is over the agent's frame size")
    return _LEN.pack(len(payload)) + payload


def exec_request(request_id: int, argv: list[str], env: dict[str, str], cwd: str,
                 terminal: tuple[int, int] | None = None) -> bytes:
    """`terminal` (cols, rows): the command's stdin, stdout and stderr are one terminal of the
    guest's, its output coming as stream 1."""
    if not argv:
        raise ValueError("an empty argv")
    for s in (*argv, cwd, *env, *env.values()):
        if "\0" in s:
            raise ValueError("a NUL byte in an argument, the environment or the cwd")
    body = _LEN.pack(len(argv)) + _LEN.pack(len(env))
    body += b"".join(_string(a) for a in argv) + b"".join(_string(f"{k}={v}") for k, v in env.items())
    body += _string(cwd)
    if terminal is not None:
        body += _LEN.pack(1) + window(*terminal)
    return request(Op.EXEC, request_id, body)


def window(cols: int, rows: int) -> bytes:
    if not (1 <= cols <= 1000 and 1 <= rows <= 1000):
        raise ValueError(f"a terminal of {cols}x{rows} (each 1..1000)")
    return _LEN.pack(cols) + _LEN.pack(rows)


def write_request(request_id: int, path: str, data: bytes, mode: int, append: bool) -> bytes:
    return request(Op.WRITE_FILE, request_id, _LEN.pack(int(append)) + _LEN.pack(mode) + _string(_path(path)) + data)


def read_request(request_id: int, path: str, offset: int, max_bytes: int) -> bytes:
    body = _LEN.pack(offset >> 32) + _LEN.pack(offset & 0xFFFFFFFF) + _LEN.pack(min(max_bytes, MAX_READ))
    return request(Op.READ_FILE, request_id, body + _string(_path(path)))


def signal_request(request_id: int, number: int) -> bytes:
    return request(Op.SIGNAL, request_id, _LEN.pack(number))


def setup_request(request_id: int, disk_mb: int) -> bytes:
    return request(Op.SETUP, request_id, _LEN.pack(disk_mb))


def fs_request(request_id: int, op: FsOp, *fields: int | str) -> bytes:
    """Numbers as u32, strings (paths) as length and bytes, in the op's order: STAT path; LIST
    depth limit path; MKDIR parents mode path; REMOVE recursive path; RENAME src dst."""
    body = _LEN.pack(op) + b"".join(_LEN.pack(f) if isinstance(f, int) else _string(_path(f)) for f in fields)
    return request(Op.FS, request_id, body)


def port_open_request(request_id: int, ipv6: bool, port: int) -> bytes:
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    return request(Op.PORT_OPEN, request_id, _LEN.pack(6 if ipv6 else 4) + _LEN.pack(port))


def port_listens_request(request_id: int, ipv6: bool, port: int) -> bytes:
    return request(Op.PORT_LISTENS, request_id, _LEN.pack(6 if ipv6 else 4) + _LEN.pack(port))


def port_ack_request(port_id: int, count: int) -> bytes:
    return request(Op.PORT_ACK, port_id, _LEN.pack(count))


def _path(path: str) -> str:
    if not path or "\0" in path:
        raise ValueError(f"{path!r} is not a path")
    return path


# -- answers --------------------------------------------------------------------------------------

RequestId = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
Release = Annotated[str, Meta(max_length=64)]


class _Answer(msgspec.Struct, frozen=True, array_like=True, tag_field="kind"):
    pass


class Hello(_Answer, tag="hello"):
    """Sent once when the agent starts (a cold boot); a restored guest sends none."""

    release: Release


class Pong(_Answer, tag="pong"):
    id: RequestId
    release: Release


class Started(_Answer, tag="started"):
    id: RequestId
    pid: Annotated[int, Meta(ge=1, le=1 << 22)]


class Output(_Answer, tag="out"):
    id: RequestId
    stream: Literal[1, 2]
    data: Annotated[bytes, Meta(max_length=CHUNK)]


class Exited(_Answer, tag="exited"):
    id: RequestId
    status: Annotated[int, Meta(ge=0, le=0xFFFF)]  # a wait status


class Failed(_Answer, tag="failed"):
    id: RequestId
    errno: Annotated[int, Meta(ge=1, le=4095)]
    what: Annotated[str, Meta(max_length=256)]


class Data(_Answer, tag="data"):
    id: RequestId
    data: Annotated[bytes, Meta(max_length=MAX_READ)]
    eof: bool


class Done(_Answer, tag="done"):
    id: RequestId
    count: Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]


class PortOpened(_Answer, tag="opened"):
    id: RequestId


class PortData(_Answer, tag="pdata"):
    id: RequestId
    data: Annotated[bytes, Meta(min_length=1, max_length=CHUNK)]


class PortAcked(_Answer, tag="packed"):
    id: RequestId
    count: Annotated[int, Meta(ge=1, le=PORT_WINDOW)]


class PortEof(_Answer, tag="peof"):
    """The guest's socket will send no more (it shut down its write side, or closed)."""

    id: RequestId


class PortClosed(_Answer, tag="pclosed"):
    """The answer to the node's PORT_CLOSE: the agent has closed its socket."""

    id: RequestId


MAX_LISTED = 10_000
GuestPath = Annotated[str, Meta(min_length=1, max_length=4096)]


class Entry(msgspec.Struct, frozen=True, array_like=True):
    path: GuestPath
    kind: Literal["file", "dir", "symlink", "other"]
    size: Annotated[int, Meta(ge=0, le=1 << 62)]
    mode: Annotated[int, Meta(ge=0, le=0o7777)]
    mtime: float
    target: Annotated[str, Meta(max_length=4096)]


class Entries(_Answer, tag="entries"):
    """A stat (one entry) or a listing, cut where the agent's frame was full (`truncated`)."""

    id: RequestId
    entries: Annotated[list[Entry], Meta(max_length=MAX_LISTED)]
    truncated: bool


Answer = Union[Hello, Pong, Started, Output, Exited, Failed, Data, Done, PortOpened, PortData, PortAcked, PortEof,
               PortClosed, Entries]
_decoder = msgspec.msgpack.Decoder(Answer)


class FrameReader:
    """Bytes from the guest in, whole answers out; a violation raises GuestProtocolError and the
    reader is useless afterwards (the guest is killed, there is nothing to resynchronise with)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Answer]:
        self._buffer += data
        answers: list[Answer] = []
        while len(self._buffer) >= 4:
            (size,) = _LEN.unpack_from(self._buffer)
            if size > MAX_FRAME:
                raise GuestProtocolError(f"a frame of {size} bytes (at most {MAX_FRAME})")
            if len(self._buffer) < 4 + size:
                break
            payload = bytes(self._buffer[4:4 + size])
            del self._buffer[:4 + size]
            try:
                answers.append(_decoder.decode(payload))
            except msgspec.DecodeError as exc:  # ValidationError is one
                raise GuestProtocolError(f"an answer that is not one: {str(exc)[:200]}") from None
        return answers

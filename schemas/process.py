"""Background processes of a sandbox (`node.v1.<node>.proc.*`), answered by the node's launcher.

A process is spawned and then talked to by its `pid`: a number the launcher gives it, unique
for the sandbox's whole life (never reused, unlike an OS pid, so a re-attach can never reach
another process), beside `os_pid`, its pid as the sandbox sees it. Its output goes into a
bounded buffer on the node, counted in bytes from the start of the process (stdout and
stderr on one count): a reader pulls from an offset with `proc.read`, which answers at once
when there is output past it and otherwise waits up to `wait_s`. When the buffer is full the
oldest output is dropped; a read from before what is kept is told how many bytes it missed.
Pulling keeps the node's memory bounded whatever the reader does (slow, gone, or many).

A read with `raw` is answered with version 2 of the reply, a raw message (sandfleet.bus.Raw):
`RawReadReply` as JSON in the `Sandfleet-Meta` header, the output bytes themselves as the body
(no base64), each `Span` saying which stream a run of them came from. Version 1 (`ReadReply`,
chunks base64 in JSON) stays the answer to a read without `raw`, so older readers go on as
they were. A reader that keeps reading holds the process back when it falls a buffer behind
(its pipe fills, the process waits), rather than losing output; one that stopped reading for
READER_GRACE_S does not, and the oldest output is dropped and counted as before.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.node import MAX_FILE_BYTES, AbsPath, Argv
from schemas.sandbox import SandboxId

SPAWN = "proc.spawn"
READ = "proc.read"
WRITE = "proc.write"  # stdin, and closing it
SIGNAL = "proc.signal"
WAIT = "proc.wait"
LIST = "proc.list"

STDOUT, STDERR = 1, 2
READ_BYTES = 256 * 1024  # a read's default (base64 in JSON: a third more)
MAX_READ_BYTES = 4 << 20  # one read reply's output at most: under the bus's 8 MB even as base64 in JSON
MAX_WAIT_S = 30.0
MAX_SPANS = 1024  # per raw read reply: ~60 KB of header at most
READER_GRACE_S = 2.0  # a reader not seen for this long no longer holds its process back

Pid = Annotated[int, Meta(ge=1, le=2**31)]


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class SpawnRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.spawn"):
    sandbox_id: SandboxId
    argv: Argv | None = None  # required unless image_command
    image_command: bool = False  # as ExecRequest's: the image's Entrypoint + (argv or its Cmd)
    env: Annotated[dict[str, str], Meta(max_length=1024)] = {}
    cwd: AbsPath = "/workspace"
    stdin: bool = False  # keep a stdin pipe open for proc.write; else stdin is empty
    # The node kills it (and its process group) after this long; None: it runs until it ends.
    timeout_s: Annotated[float, Meta(gt=0, le=7 * 24 * 3600)] | None = None
    # Output kept for readers; 0: the node's default. Capped by the node's maximum.
    buffer_bytes: Annotated[int, Meta(ge=0, le=1 << 30)] = 0


class Exit(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.exit"):
    """How a process ended: by itself (`exit_code`, or `signal` if a signal ended it), or with
    its sandbox (`sandbox_ended`: destroyed, expired, node shutdown; the record says why)."""

    exit_code: int  # as exec reports it: 128 + n when signal n ended it
    signal: int | None = None
    timed_out: bool = False
    sandbox_ended: bool = False


class ProcessInfo(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.info"):
    pid: int
    os_pid: int | None = None  # as seen inside the sandbox, while it runs
    argv: list[str]
    started_at: float  # unix time
    exit: Exit | None = None  # None while it runs
    stdin_open: bool = False
    written: int = 0  # output bytes produced so far (stdout and stderr)
    dropped: int = 0  # of which the buffer no longer holds (the oldest)


class Chunk(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.chunk"):
    stream: int  # STDOUT or STDERR
    offset: int  # of its first byte, on the process's one count
    data: bytes


class ReadRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.read"):
    sandbox_id: SandboxId
    pid: Pid
    offset: Annotated[int, Meta(ge=0)] = 0
    max_bytes: Annotated[int, Meta(ge=1, le=MAX_READ_BYTES)] = READ_BYTES
    wait_s: Annotated[float, Meta(ge=0, le=MAX_WAIT_S)] = 10.0
    raw: bool = False  # answer with RawReadReply and the bytes as the body (version 2)


class ReadReply(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.read.reply"):
    chunks: list[Chunk]
    next_offset: int  # where the next read starts
    dropped: int = 0  # bytes between the asked offset and the oldest kept: lost to this reader
    exit: Exit | None = None  # set once it ended and every byte up to next_offset is all there is


class Span(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.span"):
    """`size` bytes of a raw reply's body, from `stream`, starting at `offset` on the one count."""

    stream: int
    offset: int
    size: int


class RawReadReply(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.read.reply.v2"):
    """ReadReply's version 2: the META header of a raw reply whose body is the spans' bytes in order."""

    spans: list[Span]
    next_offset: int
    dropped: int = 0
    exit: Exit | None = None


class WriteRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.write"):
    sandbox_id: SandboxId
    pid: Pid
    data: Annotated[bytes, Meta(max_length=MAX_FILE_BYTES)] = b""
    close: bool = False  # close stdin after writing `data`


class WriteReply(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.write.reply"):
    written: int


class SignalRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.signal"):
    sandbox_id: SandboxId
    pid: Pid
    signal: Annotated[int, Meta(ge=1, le=64)] = 15  # to the process's group (it leads a session)


class WaitRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.wait"):
    sandbox_id: SandboxId
    pid: Pid
    wait_s: Annotated[float, Meta(ge=0, le=MAX_WAIT_S)] = 10.0


class ListRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.list"):
    sandbox_id: SandboxId


class ListReply(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="proc.list.reply"):
    processes: list[ProcessInfo]

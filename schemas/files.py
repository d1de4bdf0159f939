"""Files of any size and a sandbox's file tree, on the node that holds it (`node.v1.<node>.files_*`).

A transfer is a begin, chunks and an end: each chunk is one request of at most CHUNK_BYTES,
the client keeps up to WINDOW of them in flight (so a transfer is not one round trip per
chunk in series) and the node holds no more than that per transfer. Both sides hash the
whole stream and compare at the end (the transfer's `check`: xxh3-128 by default, sha256 on
request). A file travels as its bytes, a directory as a
tar stream (modes, symlinks and hard links kept). An upload is written to a temporary name
in the target's directory and renamed into place at the end, so nobody sees it half done.
A transfer left idle for `idle_s` (its client vanished) is removed with what it wrote.

Chunks travel raw (sandfleet.bus.Raw): the chunk's Struct below (`UploadChunk`, `DownloadChunk`)
is JSON in the `Sandfleet-Meta` header and its bytes are the message body as they are. That is
version 2 of the chunk messages, so their subjects are new (`files_upload_chunk.v2`,
`files_download_chunk.v2`) and their tags end in `.v2`; version 1 (bytes base64 in JSON, a
`data` field) is no longer served: a client of it gets no responders.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.sandbox import SandboxId

CHUNK_BYTES = 4 << 20  # raw, so well under the bus's 8 MB payload (infra, sandfleet/supervisor.py)
WINDOW = 4  # chunks in flight per transfer: 16 MiB, what 8 base64 chunks of 2 MiB were
MAX_IDLE_S = 600.0

UPLOAD = "files_upload"
UPLOAD_CHUNK = "files_upload_chunk.v2"
UPLOAD_END = "files_upload_end"
DOWNLOAD = "files_download"
DOWNLOAD_CHUNK = "files_download_chunk.v2"
CLOSE = "files_close"  # abandon a transfer: whatever it wrote is removed
LIST = "files_list"
STAT = "files_stat"
MKDIR = "files_mkdir"
REMOVE = "files_remove"
RENAME = "files_rename"
WATCH = "files_watch"
WATCH_NEXT = "files_watch_next"  # a long poll: the events since the last one, or wait for some
WATCH_CLOSE = "files_watch_close"

# Absolute, no NUL, no `..` component: a path that climbs is refused before anything resolves it.
SandboxPath = Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"^(?!.*(^|/)\.\.(/|$))/[^\x00]*$")]
TransferId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-f0-9]+$")]
Kind = Literal["file", "dir"]
# The end-to-end check of a transfer's bytes. xxh3-128 catches a corrupted, missing, repeated or
# reordered chunk as surely as sha256 does (no one on the path chooses the bytes to collide: the
# bus is authenticated) at a tenth of its CPU (0.07 against 0.65 CPU-s a GiB here, each side);
# sha256 stays for a caller who wants the file's well-known digest.
Check = Literal["xxh3-128", "sha256"]
Digest = Annotated[str, Meta(pattern=r"^([a-f0-9]{32}|[a-f0-9]{64})$")]  # hex, of the transfer's check


class _Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    sandbox_id: SandboxId


class UploadRequest(_Request, frozen=True, kw_only=True, tag="files.upload"):
    path: SandboxPath
    kind: Kind = "file"
    mode: Annotated[int, Meta(ge=0, le=0o7777)] = 0o644  # of a file; a tree's members carry their own
    idle_s: Annotated[float, Meta(ge=1, le=MAX_IDLE_S)] = 60.0
    check: Check = "xxh3-128"


class Transfer(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.transfer"):
    transfer_id: str
    kind: Kind = "file"
    size: int = -1  # of a file being downloaded (-1: a tree's tar stream, length unknown)
    mode: int = 0
    check: Check = "xxh3-128"  # what both sides hash the stream with


class UploadChunk(_Request, frozen=True, kw_only=True, tag="files.upload_chunk.v2"):
    """The META header of a raw chunk; its body (at most CHUNK_BYTES) is the chunk's bytes."""

    transfer_id: TransferId
    seq: Annotated[int, Meta(ge=0)]


class ChunkAck(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.chunk_ack"):
    seq: int


class UploadEnd(_Request, frozen=True, kw_only=True, tag="files.upload_end"):
    transfer_id: TransferId
    chunks: Annotated[int, Meta(ge=0)]
    size: Annotated[int, Meta(ge=0)]
    digest: Digest  # of the whole stream, by the transfer's check


class TransferDone(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.transfer_done"):
    size: int
    digest: str
    check: Check = "xxh3-128"


class DownloadRequest(_Request, frozen=True, kw_only=True, tag="files.download"):
    path: SandboxPath
    idle_s: Annotated[float, Meta(ge=1, le=MAX_IDLE_S)] = 60.0
    check: Check = "xxh3-128"


class DownloadChunkRequest(_Request, frozen=True, kw_only=True, tag="files.download_chunk"):
    transfer_id: TransferId
    seq: Annotated[int, Meta(ge=0)]


class DownloadChunk(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.download_chunk.v2"):
    """The META header of a raw reply; its body is the chunk's bytes (empty at eof)."""

    seq: int
    eof: bool = False
    size: int = 0  # at eof: the bytes of the whole stream and their digest (the transfer's check)
    digest: str = ""


class CloseRequest(_Request, frozen=True, kw_only=True, tag="files.close"):
    transfer_id: TransferId


class Closed(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.closed"):
    closed: bool  # false: there was no such transfer (it had ended)


class ListRequest(_Request, frozen=True, kw_only=True, tag="files.list"):
    path: SandboxPath
    depth: Annotated[int, Meta(ge=1, le=32)] = 1


class Entry(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.entry"):
    path: str
    kind: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    target: str = ""  # of a symlink


MAX_LISTED = 10_000


class Listing(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.listing"):
    entries: list[Entry]
    truncated: bool = False  # more than MAX_LISTED entries


class StatRequest(_Request, frozen=True, kw_only=True, tag="files.stat"):
    path: SandboxPath


class MkdirRequest(_Request, frozen=True, kw_only=True, tag="files.mkdir"):
    path: SandboxPath
    parents: bool = True
    mode: Annotated[int, Meta(ge=0, le=0o7777)] = 0o755


class RemoveRequest(_Request, frozen=True, kw_only=True, tag="files.remove"):
    path: SandboxPath
    recursive: bool = False


class RenameRequest(_Request, frozen=True, kw_only=True, tag="files.rename"):
    src: SandboxPath
    dst: SandboxPath


class Done(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.done"):
    path: str


class WatchRequest(_Request, frozen=True, kw_only=True, tag="files.watch"):
    """Watch the directory `path` (and, with `recursive`, its subdirectories) for changes. The node
    keeps a bounded buffer per watch: a reader too slow loses the oldest events and is told how
    many (`dropped`); a watch nobody polls for `idle_s` is closed."""

    path: SandboxPath
    recursive: bool = False
    idle_s: Annotated[float, Meta(ge=1, le=MAX_IDLE_S)] = 60.0


class Watching(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.watching"):
    watch_id: str
    path: str


class WatchNextRequest(_Request, frozen=True, kw_only=True, tag="files.watch_next"):
    watch_id: TransferId
    # 30.0 as schemas.process spells it: typing caches Annotated types by ==, so the two would share
    # one and the JSON Schema would print whichever module was imported first.
    wait_s: Annotated[float, Meta(ge=0, le=30.0)] = 10.0
    max_events: Annotated[int, Meta(ge=1, le=10_000)] = 1000


class FileEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.event"):
    kind: Literal["created", "modified", "removed"]
    path: str
    is_dir: bool = False


class WatchEvents(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="files.watch_events"):
    events: list[FileEvent]
    dropped: int = 0  # events lost since the last poll (the buffer was full, or the kernel's queue)
    ended: bool = False  # the directory went away or the sandbox ended: no more events


class WatchCloseRequest(_Request, frozen=True, kw_only=True, tag="files.watch_close"):
    watch_id: TransferId

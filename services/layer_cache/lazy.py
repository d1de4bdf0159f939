"""Lazily fetched images on a node's disk: a sparse file, a chunk map and the image's chunk index.

For an image `<hex>` the cache directory holds `<hex>.lazy` (the image's bytes, sparse: only
the chunks fetched so far take disk), `<hex>.lazy.map` (one byte per chunk, 1 once the chunk
is in the sparse file; written after the data, so a restart keeps what was fetched) and
`<hex>.lazy.json` (where each chunk sits in the store's stream and the sha256 each must have,
from the store's chunk manifest; written last and atomically: without it the other two are
leftovers). The FUSE daemon (`lazyfs.py`) serves these as
`<mount>/<hex>.erofs`; the layer-cache creates them (`prepare`) and deletes them on eviction.
Everything here but `chunk_index` is pure file logic, shared by both processes.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from sandfleet import jetstream
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import CHUNK_BYTES, OBJECT_BUCKET
from services.layer_cache.store import HASH_BYTES, read_manifest

DATA = ".lazy"
MAP = ".lazy.map"
INDEX = ".lazy.json"
STREAM = jetstream.object_stream(OBJECT_BUCKET)
INDEX_TIMEOUT_S = 30.0


class ChunkIndex(msgspec.Struct, frozen=True, kw_only=True):
    """Where the chunks of one image are: `seqs[i]` is the stream sequence of chunk i, and
    `hashes[32*i:32*i+32]` its sha256 (empty: the store had no manifest for the image)."""

    digest: str
    size: int
    chunk_bytes: int
    stream: str
    subject: str
    seqs: list[int]
    hashes: bytes = b""

    def hash_of(self, i: int) -> bytes:
        return self.hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES]


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_length(index: int, size: int, chunk_bytes: int) -> int:
    return max(0, min(chunk_bytes, size - index * chunk_bytes))


def chunks_of(offset: int, length: int, size: int, chunk_bytes: int) -> range:
    """The chunks a read of `length` bytes at `offset` touches (none past the end)."""
    end = min(offset + length, size)
    if offset >= end:
        return range(0)
    return range(offset // chunk_bytes, (end - 1) // chunk_bytes + 1)


def present_bytes(chunk_map: bytes, size: int, chunk_bytes: int) -> int:
    """Bytes of the image a chunk map says are on disk."""
    return sum(chunk_length(i, size, chunk_bytes) for i, have in enumerate(chunk_map) if have)


@dataclass(frozen=True)
class LazyFiles:
    """The three files of one lazily fetched image."""

    dir: Path
    hex: str

    @classmethod
    def of(cls, images_dir: Path, digest: str) -> LazyFiles:
        return cls(images_dir, digest.removeprefix("sha256:"))

    @property
    def data(self) -> Path:
        return self.dir / (self.hex + DATA)

    @property
    def map(self) -> Path:
        return self.dir / (self.hex + MAP)

    @property
    def index(self) -> Path:
        return self.dir / (self.hex + INDEX)

    def read_index(self) -> ChunkIndex:
        return msgspec.json.decode(self.index.read_bytes(), type=ChunkIndex)

    def create(self, index: ChunkIndex, complete: bool = False) -> None:
        """Empty sparse data and map first (or, `complete`, the data already written whole and
        a full map), the index last: a crash half way leaves no index."""
        if not complete:
            with open(self.data, "wb") as f:
                f.truncate(index.size)
        with open(self.map, "wb") as f:
            if complete:
                f.write(b"\1" * len(index.seqs))
            else:
                f.truncate(len(index.seqs))
        tmp = self.index.with_name(self.index.name + ".tmp")
        tmp.write_bytes(msgspec.json.encode(index))
        os.replace(tmp, self.index)

    def remove(self) -> None:
        for path in (self.index, self.map, self.data):  # the index first: without it the rest is a leftover
            path.unlink(missing_ok=True)

    def usage(self) -> tuple[int, int, bool]:
        """(bytes of the image present, bytes on disk, complete)."""
        index = self.read_index()
        chunk_map = self.map.read_bytes()
        present = present_bytes(chunk_map, index.size, index.chunk_bytes)
        complete = len(chunk_map) >= len(index.seqs) and all(chunk_map[: len(index.seqs)])
        try:
            disk = os.stat(self.data).st_blocks * 512 + os.stat(self.map).st_blocks * 512
        except FileNotFoundError:
            disk = 0
        return present, disk, complete


def leftovers(images_dir: Path) -> list[Path]:
    """Data and map files with no index (a prepare or a removal cut short)."""
    found = []
    for path in images_dir.iterdir():
        name = path.name
        hex_ = name.removesuffix(MAP) if name.endswith(MAP) else name.removesuffix(DATA) if name.endswith(DATA) else ""
        if hex_ and not (images_dir / (hex_ + INDEX)).exists():
            found.append(path)
        elif name.endswith(INDEX + ".tmp"):
            found.append(path)
    return found


async def chunk_index(js: JetStreamContext, digest: str) -> ChunkIndex:
    """Read where each chunk of the image sits: one headers-only pass over its chunk subject
    (a few bytes per chunk), so a read of chunk i later is one direct get of one message;
    and the image's chunk manifest, where the store has one that fits."""
    try:
        info = await js.object_store(OBJECT_BUCKET)
        meta = await info.get_info(digest)
    except nats.js.errors.NotFoundError:
        raise ServiceError(ErrorCode.NOT_FOUND, f"no image {digest} in the layer store") from None
    chunk_bytes = (meta.options.max_chunk_size if meta.options else 0) or 0
    subject = jetstream.object_chunk_subject(OBJECT_BUCKET, meta.nuid)
    want = meta.chunks or 0
    seqs: list[int] = []
    if want:
        sub = await js.subscribe(subject, ordered_consumer=True,
                                 config=ConsumerConfig(headers_only=True, deliver_policy=DeliverPolicy.ALL))
        try:
            while len(seqs) < want:
                msg = await sub.next_msg(timeout=INDEX_TIMEOUT_S)
                seqs.append(msg.metadata.sequence.stream)
        except (TimeoutError, asyncio.TimeoutError, nats.errors.TimeoutError):
            raise ServiceError(ErrorCode.TIMEOUT, f"the store listed {len(seqs)} of {want} chunks of {digest}") from None
        finally:
            await sub.unsubscribe()
    if not chunk_bytes and want:
        chunk_bytes = -(-meta.size // want)
    if chunk_count(meta.size, chunk_bytes) != want:
        raise ServiceError(ErrorCode.INTERNAL, f"image {digest}: {want} chunks do not fit {meta.size} bytes "
                                               f"in chunks of {chunk_bytes}")
    manifest = await read_manifest(info, digest) or b""
    if len(manifest) != want * HASH_BYTES or chunk_bytes != CHUNK_BYTES:
        manifest = b""  # none, or made for other chunks: the caller falls back to a whole fetch
    return ChunkIndex(digest=digest, size=meta.size, chunk_bytes=chunk_bytes, stream=STREAM, subject=subject,
                      seqs=seqs, hashes=manifest)

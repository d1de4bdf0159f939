"""The cluster's layer store: images in the Object Store bucket `layers`, references in KV `layers`.

Images are named by their digest, so an identical rebuild is stored once. A reference is a
KV key, `<name>` (the newest build) or `<name>.<tag>`; removing the last reference to an
image deletes the image from the store (nodes that cache it keep their copy until eviction).
Beside each image is its chunk manifest, object `<digest>.chunks`: the sha256 of every
CHUNK_BYTES chunk (32 bytes each, in order), which a lazy reader checks each chunk against.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from sandfleet.buckets import ensure_layer_buckets
from sandfleet.bus import decode, encode, kv_values
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import (
    CHUNK_BYTES,
    DIFF_BUCKET,
    KV_BUCKET,
    OBJECT_BUCKET,
    UPLOAD_BUCKET,
    UPLOAD_TTL_S,
    ImageConfig,
    Layer,
    StackLayer,
)

log = logging.getLogger("sandfleet.layer_cache")

DIGEST_PREFIX = "sha256:"


@dataclass(frozen=True)
class Ref:
    """A parsed layer reference: a digest, or a name with an optional tag."""

    digest: str = ""
    name: str = ""
    tag: str = ""

    @classmethod
    def parse(cls, ref: str) -> Ref:
        if ref.startswith(DIGEST_PREFIX):
            return cls(digest=ref)
        name, _, tag = ref.partition(":")
        return cls(name=name, tag=tag)

    @property
    def key(self) -> str:
        return f"{self.name}.{self.tag}" if self.tag else self.name

    @classmethod
    def from_key(cls, key: str) -> Ref:
        name, _, tag = key.partition(".")
        return cls(name=name, tag=tag)

    def __str__(self) -> str:
        return self.digest or (f"{self.name}:{self.tag}" if self.tag else self.name)


def object_digest(digest: str) -> str:
    """The Object Store's own form of a sha256 (`SHA-256=<base64url>`) for a `sha256:<hex>` digest."""
    raw = bytes.fromhex(digest.removeprefix(DIGEST_PREFIX))
    return "SHA-256=" + base64.urlsafe_b64encode(raw).decode()


MANIFEST_SUFFIX = ".chunks"
HASH_BYTES = 32


def manifest_name(digest: str) -> str:
    return digest + MANIFEST_SUFFIX


def chunk_hashes(path: Path, chunk_bytes: int = CHUNK_BYTES) -> bytes:
    """The manifest of an image file: sha256 of each chunk, concatenated."""
    out = bytearray()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            out += hashlib.sha256(chunk).digest()
    return bytes(out)


async def read_manifest(images: ObjectStore, digest: str) -> bytes | None:
    """The image's chunk manifest, or None where the store has none (an image stored before
    manifests existed). The Object Store checks the manifest's own sha256 on the way."""
    try:
        return (await images.get(manifest_name(digest))).data
    except nats.js.errors.NotFoundError:
        return None


async def write_manifest(images: ObjectStore, digest: str, manifest: bytes) -> None:
    await images.put(manifest_name(digest), manifest)


async def _bucket(js: JetStreamContext, name: str, config: ObjectStoreConfig) -> ObjectStore:
    try:
        return await js.create_object_store(name, config)
    except nats.js.errors.BadRequestError:  # exists with settings an operator changed; keep theirs
        return await js.object_store(name)


def images_of(layer: Layer) -> list[str]:
    """The digests a catalogue entry keeps in the store: its own, and its stack's."""
    return [part.digest for part in layer.stack] or [layer.digest]


class LayerStore:
    def __init__(self, kv: KeyValue, images: ObjectStore, uploads: ObjectStore, diffs: KeyValue | None = None) -> None:
        self.kv = kv
        self.images = images
        self.uploads = uploads
        self.diffs = diffs  # OCI diff id → StackLayer; None: no image has been imported through this store

    @classmethod
    async def open(cls, js: JetStreamContext) -> LayerStore:
        await ensure_layer_buckets(js)  # refusing rollups: any node puts keys of both
        kv = await js.key_value(KV_BUCKET)
        images = await _bucket(js, OBJECT_BUCKET, ObjectStoreConfig(storage=StorageType.FILE, description="layer images"))
        uploads = await _bucket(
            js, UPLOAD_BUCKET, ObjectStoreConfig(storage=StorageType.FILE, ttl=UPLOAD_TTL_S, description="build sources")
        )
        diffs = await js.key_value(DIFF_BUCKET)
        return cls(kv, images, uploads, diffs)

    # -- OCI layers by diff id --------------------------------------------------------

    async def by_diff_id(self, diff_id: str) -> StackLayer | None:
        """The image built from this OCI layer, if the store still holds it."""
        if self.diffs is None:
            return None
        try:
            entry = await self.diffs.get(diff_id.removeprefix(DIGEST_PREFIX))
        except nats.js.errors.NotFoundError:
            return None
        if entry is None or not entry.value:
            return None
        part = decode(entry.value, StackLayer)
        return part if await self.image_size(part.digest) == part.size else None

    async def record_diff_id(self, part: StackLayer) -> None:
        if self.diffs is not None and part.diff_id:
            await self.diffs.put(part.diff_id.removeprefix(DIGEST_PREFIX), encode(part))

    # -- images -----------------------------------------------------------------------

    async def image_size(self, digest: str) -> int | None:
        try:
            info = await self.images.get_info(digest)
        except nats.js.errors.NotFoundError:
            return None
        return info.size

    async def put_image(self, digest: str, path: Path) -> bool:
        """Store the image unless the store has it; true when it was stored now. Its chunk
        manifest goes first (so an image is never there without one), and is added to an image
        stored before manifests existed."""
        if await self.image_size(digest) == path.stat().st_size:
            if await read_manifest(self.images, digest) is None:
                await write_manifest(self.images, digest, await asyncio.to_thread(chunk_hashes, path))
            return False
        await write_manifest(self.images, digest, await asyncio.to_thread(chunk_hashes, path))
        meta = ObjectMeta(name=digest, options=ObjectMetaOptions(max_chunk_size=CHUNK_BYTES))
        with open(path, "rb") as f:
            info = await self.images.put(digest, f, meta=meta)
        if info.digest != object_digest(digest):
            await self.delete_image(digest)
            raise ServiceError(ErrorCode.INTERNAL, f"image {digest} changed while it was stored")
        return True

    async def fetch_image(self, digest: str, dest: Path) -> None:
        """Write the image to `dest`; the store checks the bytes against its sha256, which is the
        image's digest, so nothing is hashed twice."""
        try:
            info = await self.images.get_info(digest)
        except nats.js.errors.NotFoundError:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no image {digest} in the layer store") from None
        if info.digest != object_digest(digest):
            raise ServiceError(ErrorCode.INTERNAL, f"the store's image {digest} has another digest")
        with open(dest, "wb") as f:
            try:
                await self.images.get(digest, writeinto=f)
            except nats.js.errors.DigestMismatchError:
                raise ServiceError(ErrorCode.INTERNAL, f"image {digest} arrived corrupted") from None

    async def delete_image(self, digest: str) -> None:
        for name in (digest, manifest_name(digest)):
            try:
                await self.images.delete(name)
            except nats.js.errors.NotFoundError:
                pass

    # -- uploads (build sources) ------------------------------------------------------

    async def fetch_upload(self, name: str, dest: Path) -> None:
        with open(dest, "wb") as f:
            try:
                await self.uploads.get(name, writeinto=f)
            except nats.js.errors.NotFoundError:
                raise ServiceError(ErrorCode.NOT_FOUND, f"no upload {name} (uploads expire after an hour)") from None

    async def delete_upload(self, name: str) -> None:
        try:
            await self.uploads.delete(name)
        except nats.js.errors.NotFoundError:
            pass

    # -- references -------------------------------------------------------------------

    async def get(self, ref: Ref) -> Layer:
        try:
            entry = await self.kv.get(ref.key)
        except nats.js.errors.NotFoundError:
            entry = None
        if entry is None or not entry.value:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no layer {ref}")
        return decode(entry.value, Layer)

    async def resolve(self, ref: str) -> tuple[str, int]:
        """(digest, size) of a reference; a digest must name an image the store holds."""
        parsed = Ref.parse(ref)
        if parsed.digest:
            size = await self.image_size(parsed.digest)
            if size is None:
                raise ServiceError(ErrorCode.NOT_FOUND, f"no image {parsed.digest} in the layer store")
            return parsed.digest, size
        layer = await self.get(parsed)
        return layer.digest, layer.size

    async def stack(self, ref: str) -> tuple[list[tuple[str, int]], ImageConfig | None]:
        """(digest, size) of every image a reference stands for, bottom first (an image name: all
        its layers), and its image config."""
        parsed = Ref.parse(ref)
        if parsed.digest:
            return [await self.resolve(ref)], None
        layer = await self.get(parsed)
        return [(p.digest, p.size) for p in layer.stack] or [(layer.digest, layer.size)], layer.config

    async def record(self, layer: Layer) -> None:
        """Point `<name>` and each `<name>.<tag>` at this build."""
        value = encode(layer)
        await self.kv.put(layer.name, value)
        for tag in layer.tags:
            await self.kv.put(Ref(name=layer.name, tag=tag).key, value)

    async def all(self) -> dict[str, Layer]:
        """Every reference (KV key) and the build it points at."""
        found = {}
        for key in await kv_values(self.kv, "list layers"):
            try:
                found[key] = await self.get(Ref.from_key(key))
            except ServiceError:
                continue  # removed meanwhile
        return found

    async def remove(self, ref: Ref) -> tuple[list[str], list[str]]:
        """Drop a reference (a bare name: with all its tags); delete images left unreferenced."""
        refs = await self.all()
        if ref.tag:
            doomed = [ref.key] if ref.key in refs else []
        else:
            doomed = [k for k in refs if Ref.from_key(k).name == ref.name]
        if not doomed:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no layer {ref}")
        for key in doomed:
            await self.kv.delete(key)  # a marker, not a purge: the bucket refuses rollups (one value kept per key)
        still = {d for key, layer in refs.items() if key not in doomed for d in images_of(layer)}
        orphaned = sorted({d for k in doomed for d in images_of(refs[k])} - still)
        for digest in orphaned:
            await self.delete_image(digest)
        return [str(Ref.from_key(k)) for k in sorted(doomed)], orphaned


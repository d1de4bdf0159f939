"""`layer push` / `layer pull`: copy a layer between this cluster's store and another's.

The other store is any NATS server with JetStream (another sandfleet cluster, or a bare
server used as a registry); the layer-cache that takes the request connects to it for the
length of the copy. A layer travels with the images of the layers it was built on (its
recorded `parent_digest` chain) where the receiving store lacks them, so it can be composed
there. Images go through a file in the node's build dir; both stores check the bytes
against the sha256 that names them (the sending one on read, the receiving one on write),
so an image whose bytes do not match its digest never lands. An image's OCI diff ids go with
it into the receiving store's map, unless that store maps them already. The receiving store's name
(and tags) point at the copied build; the names of the layers under it are added only where
the receiving store has no layer of that name (a copy never moves someone else's name).

Another platform's bus takes credentials (and may present a certificate of its own CA): the
layer-cache signs in with what the operator filed for that address on this machine (`sandfleet
remote add URL --creds FILE [--ca FILE]`, under the data dir), else what a platform on this
machine registered for it, never with its own node's seed (sandfleet.credentials.remote_options).
A bus that refuses them is `forbidden`, not "cannot reach".
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.protocol.parser import AUTHORIZATION_VIOLATION

from sandfleet.credentials import CredentialsError, remote_options
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import KV_BUCKET, MAX_LAYERS, OBJECT_BUCKET, Layer, TransferReply, TransferRequest
from services.layer_cache.mounts import remove_tree
from services.layer_cache.store import LayerStore, Ref

log = logging.getLogger("sandfleet.layer_cache")

CONNECT_TIMEOUT_S = 5.0


class Remote:
    """A connection to the other store, closed when the copy is done."""

    def __init__(self, url: str, data_dir: Path) -> None:
        self.url, self.data_dir = url, data_dir
        self.nc: nats.NATS | None = None

    async def __aenter__(self) -> Remote:
        async def quiet(exc: Exception) -> None:  # nats-py logs a traceback per failed try otherwise
            log.debug("transfer connection to %s: %s", self.url, exc)

        try:
            options = remote_options(self.url, self.data_dir)
        except (OSError, CredentialsError) as exc:  # a filed credentials file that is unreadable or holds no seed
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"the credentials filed for {self.url}: {exc}") from None
        try:  # nats-py retries a refused first connect forever: bound it
            self.nc = await asyncio.wait_for(
                nats.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S, allow_reconnect=False,
                             max_reconnect_attempts=1, error_cb=quiet, name="sandfleet-layer-transfer", **options),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
            # nats-py raises the server's -ERR at connect as a plain Error, AuthorizationError later
            if isinstance(exc, nats.errors.AuthorizationError) or AUTHORIZATION_VIOLATION in str(exc).lower():
                raise ServiceError(ErrorCode.FORBIDDEN, f"the bus at {self.url} refused the credentials this node has "
                                   f"for it (`sandfleet remote add {self.url} --creds FILE` here)") from None
            why = str(exc) or type(exc).__name__
            raise ServiceError(ErrorCode.NOT_FOUND, f"cannot reach the store at {self.url}: {why}") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.nc is not None:
            await self.nc.close()

    async def store(self, create: bool) -> LayerStore:
        """The other store; `create` makes its buckets where they are missing (a push to a fresh server)."""
        js = self.nc.jetstream()
        try:
            if create:
                return await LayerStore.open(js)
            return LayerStore(await js.key_value(KV_BUCKET), await js.object_store(OBJECT_BUCKET), None)
        except nats.js.errors.BucketNotFoundError:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no layer store at {self.url}") from None
        except nats.errors.Error as exc:
            raise ServiceError(ErrorCode.UNSUPPORTED, f"the server at {self.url} has no usable JetStream: {exc}") from None


async def push(store: LayerStore, workdir: Path, data_dir: Path, req: TransferRequest) -> TransferReply:
    async with Remote(req.url, data_dir) as remote:
        return await copy(store, await remote.store(create=True), req.ref, workdir)


async def pull(store: LayerStore, workdir: Path, data_dir: Path, req: TransferRequest) -> TransferReply:
    async with Remote(req.url, data_dir) as remote:
        return await copy(await remote.store(create=False), store, req.ref, workdir)


async def chain(store: LayerStore, layer: Layer) -> list[Layer]:
    """`layer` and the recorded layers it was built on, bottom first (an image's: its whole stack)."""
    known = {entry.digest: entry for entry in (await store.all()).values()}
    found = [layer]
    while len(found) < MAX_LAYERS and found[0].parent_digest:
        parent = known.get(found[0].parent_digest)
        if parent is None:  # a parent whose every name is gone: its image may still be there
            digest, size = await store.resolve(found[0].parent_digest)
            parent = Layer(name="", digest=digest, size=size, built_from="", created_at=0.0)
        found.insert(0, parent)
    expanded: list[Layer] = []  # an image among them travels with every layer of its stack
    for entry in found:
        expanded += [Layer(name="", digest=p.digest, size=p.size, built_from="", created_at=0.0)
                     for p in entry.stack[:-1]]
        expanded.append(entry)
    return expanded


async def copy(src: LayerStore, dst: LayerStore, ref: str, workdir: Path) -> TransferReply:
    parsed = Ref.parse(ref)
    if parsed.digest:
        raise ServiceError(ErrorCode.INVALID_REQUEST, "push or pull a layer by its name or name:tag")
    started = time.perf_counter()
    layer = await src.get(parsed)
    layers = await chain(src, layer)
    copied, present, moved = [], [], 0
    tmp = workdir / f"transfer-{secrets.token_hex(8)}"
    tmp.mkdir(parents=True)
    try:
        for entry in layers:
            size = await src.image_size(entry.digest)
            if size is None:
                raise ServiceError(ErrorCode.NOT_FOUND, f"no image {entry.digest} in the sending store")
            if await dst.image_size(entry.digest) == size:
                present.append(entry.digest)
                continue
            image = tmp / entry.digest.removeprefix("sha256:")
            await src.fetch_image(entry.digest, image)  # checked against the digest as it is read
            await dst.put_image(entry.digest, image)  # and again as it is stored
            image.unlink()
            copied.append(entry.digest)
            moved += size
    finally:
        remove_tree(tmp, check=False)
    for part in (p for entry in layers for p in entry.stack if p.diff_id):
        # An image imported there later over the same OCI layers then reuses these images.
        if await dst.by_diff_id(part.diff_id) is None:
            await dst.record_diff_id(part)
    for entry in layers[:-1]:
        if entry.name and not await _has_name(dst, entry.name):
            await dst.record(msgspec.structs.replace(entry, tags=[], current=True))
    await dst.record(msgspec.structs.replace(layer, current=True))
    seconds = time.perf_counter() - started
    log.info("copied layer %s (%d images, %d bytes) in %.2fs", ref, len(copied), moved, seconds)
    return TransferReply(layer=layer, copied=copied, present=present, bytes=moved, seconds=seconds)


async def _has_name(store: LayerStore, name: str) -> bool:
    try:
        await store.get(Ref(name=name))
    except ServiceError:
        return False
    return True

"""Layer-cache endpoints: small functions of (deps, request) over the store, the cache and the composer."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import (
    BuildReply,
    BuildRequest,
    CachedImage,
    CacheListing,
    CacheRequest,
    ComposeRequest,
    GetRequest,
    Layer,
    LayerList,
    ListRequest,
    ReleaseRootfsReply,
    ReleaseRootfsRequest,
    RemoveReply,
    RemoveRequest,
    Rootfs,
)
from services.layer_cache.build import LayerBuilder
from services.layer_cache.cache import ImageCache
from services.layer_cache.compose import RootfsComposer
from services.layer_cache.store import LayerStore, Ref

log = logging.getLogger("sandfleet.layer_cache")


@dataclass
class Deps:
    node_id: str
    store: LayerStore
    images: ImageCache
    composer: RootfsComposer
    builder: LayerBuilder


async def build(deps: Deps, req: BuildRequest) -> BuildReply:
    return await deps.builder.build(req)


def catalogue(refs: dict[str, Layer], name: str | None = None) -> list[Layer]:
    """One entry per build (name and digest) with the tags that point at it, newest first."""
    builds: dict[tuple[str, str], tuple[Layer, set[str], bool]] = {}
    for key, layer in refs.items():
        ref = Ref.from_key(key)
        if name is not None and ref.name != name:
            continue
        found, tags, current = builds.get((ref.name, layer.digest), (layer, set(), False))
        builds[(ref.name, layer.digest)] = (found, tags | ({ref.tag} if ref.tag else set()), current or not ref.tag)
    entries = [
        Layer(**{**{f: getattr(layer, f) for f in Layer.__struct_fields__}, "tags": sorted(tags), "current": current})
        for layer, tags, current in builds.values()
    ]
    return sorted(entries, key=lambda e: (e.name, -e.created_at))


async def list_layers(deps: Deps, req: ListRequest) -> LayerList:
    return LayerList(layers=catalogue(await deps.store.all(), req.name))


async def get(deps: Deps, req: GetRequest) -> Layer:
    ref = Ref.parse(req.ref)
    if not ref.digest:
        return await deps.store.get(ref)
    for layer in catalogue(await deps.store.all()):
        if layer.digest == ref.digest:
            return layer
    digest, size = await deps.store.resolve(ref.digest)
    return Layer(name="", digest=digest, size=size, built_from="", created_at=0.0)


async def remove(deps: Deps, req: RemoveRequest) -> RemoveReply:
    ref = Ref.parse(req.ref)
    if ref.digest:
        raise ServiceError(ErrorCode.INVALID_REQUEST, "remove a layer by its name or name:tag")
    removed, deleted = await deps.store.remove(ref)
    return RemoveReply(removed=removed, deleted_images=deleted)


async def compose(deps: Deps, req: ComposeRequest) -> Rootfs:
    layers = await asyncio.gather(*(deps.store.resolve(ref) for ref in req.layers))
    return (await deps.composer.compose(req.sandbox_id, list(layers))).wire()


async def release(deps: Deps, req: ReleaseRootfsRequest) -> ReleaseRootfsReply:
    return ReleaseRootfsReply(released=await deps.composer.release(req.sandbox_id))


async def cache(deps: Deps, req: CacheRequest) -> CacheListing:
    names: dict[str, list[str]] = {}
    try:
        for key, layer in (await deps.store.all()).items():
            names.setdefault(layer.digest, []).append(str(Ref.from_key(key)))
    except Exception as exc:  # the listing is still worth having without names
        log.warning("no names for the cache listing: %s", exc)
    composer = deps.composer
    images = [
        CachedImage(
            digest=i.digest, size=i.size, disk_bytes=i.disk_bytes, last_used=i.last_used,
            mounted=i.digest in composer.mounts.mounted, users=composer.users(i.digest), complete=i.complete,
            names=sorted(names.get(i.digest, [])),
        )
        for i in sorted(deps.images.images.values(), key=lambda i: i.last_used, reverse=True)
    ]
    return CacheListing(
        node=deps.node_id, budget_bytes=deps.images.budget, used_bytes=deps.images.used, images=images,
        rootfs=[c.wire() for c in sorted(composer.live.values(), key=lambda c: c.created_at)],
    )

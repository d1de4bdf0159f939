"""Layer-cache endpoints: small functions of (deps, request) over the store, the cache and the composer."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from sandfleet.bus import Bus

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import (
    BuildReply,
    BuildRequest,
    CacheDropReply,
    CacheDropRequest,
    CachedImage,
    CacheListing,
    CacheRequest,
    ComposeRequest,
    FetchFailed,
    GetRequest,
    KnownDiffsReply,
    KnownDiffsRequest,
    Layer,
    LayerList,
    ListRequest,
    MAX_STACK,
    ReleaseRootfsReply,
    ReleaseRootfsRequest,
    RemoveReply,
    RemoveRequest,
    Rootfs,
    fetch_failed_subject,
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
    bus: Bus | None = None  # for events


async def build(deps: Deps, req: BuildRequest) -> BuildReply:
    return await deps.builder.build(req)


async def known_diffs(deps: Deps, req: KnownDiffsRequest) -> KnownDiffsReply:
    return KnownDiffsReply(known=[d for d in req.diff_ids if await deps.store.by_diff_id(d) is not None])


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
    """An image name stands for its whole stack; the root takes the config of the last image."""
    stacks = await asyncio.gather(*(deps.store.stack(ref) for ref in req.layers))
    layers = [part for parts, _ in stacks for part in parts]
    if len(layers) > MAX_STACK:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"{len(layers)} layers in all; a root takes {MAX_STACK} at most")
    config = next((config for _, config in reversed(stacks) if config is not None), None)
    return (await deps.composer.compose(req.sandbox_id, layers, req.disk_mb, config)).wire()


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
    await asyncio.to_thread(deps.images.refresh)
    images = [
        CachedImage(
            digest=i.digest, size=i.size, disk_bytes=i.disk_bytes, last_used=i.last_used,
            mounted=i.digest in composer.mounts.mounted, users=composer.users(i.digest), complete=i.complete,
            names=sorted(names.get(i.digest, [])), lazy=i.lazy, fetched_bytes=i.fetched_bytes,
            written_bytes=i.written_bytes,
        )
        for i in sorted(deps.images.images.values(), key=lambda i: i.last_used, reverse=True)
    ]
    return CacheListing(
        node=deps.node_id, budget_bytes=deps.images.budget, used_bytes=deps.images.used, images=images,
        rootfs=[c.wire(composer.broken.get(c.sandbox_id, ""))
                for c in sorted(composer.live.values(), key=lambda c: c.created_at)] if req.roots else [],
        fetch=deps.images.fetch_mode,
    )


async def cache_drop(deps: Deps, req: CacheDropRequest) -> CacheDropReply:
    """Forget every image no root uses (its idle mount goes too), e.g. to measure a cold start."""
    images = deps.images
    await asyncio.to_thread(images.refresh)
    dropped, kept, freed = [], [], 0
    for image in list(images.images.values()):
        if image.pins or deps.composer.users(image.digest):
            kept.append(image.digest)
            continue
        images.drop(image.digest)
        dropped.append(image.digest)
        freed += image.disk_bytes
    return CacheDropReply(dropped=sorted(dropped), freed_bytes=freed, kept=sorted(kept))


async def lazy_layers_lost(deps: Deps, reason: str) -> None:
    """The lazy-layer daemon is gone: mark the roots that read through it, and say so on the bus."""
    lost = deps.composer.lose_lazy_layers(reason)
    if deps.bus is None:
        return
    for digest, sandboxes in lost.items():
        event = FetchFailed(node=deps.node_id, digest=digest, chunk=-1, reason=reason, sandboxes=sandboxes,
                            at=time.time())
        try:
            await deps.bus.publish(fetch_failed_subject(deps.node_id), event)
        except Exception as exc:  # the bus may be what failed; the roots are marked either way
            log.warning("could not publish %s for %s: %s", reason, digest, exc)

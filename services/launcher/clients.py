"""Typed clients of the node-local services the launcher calls over the bus: the node agent
(a sandbox's confinement: cgroups, netns, BPF, Landlock) and the layer-cache (its composed
root, the node's cache listing, and the layer a checkpoint packs). Each method is one request
with its schema types; errors are the bus adapter's (sandfleet.errors) for the caller to judge.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import tarfile
import tempfile
from pathlib import Path

import msgspec
import nats.js.errors

from sandfleet import errors
from sandfleet.bus import Bus
from schemas import layers as layers_schema
from schemas import node as node_schema
from schemas.layers import (
    BuildReply,
    BuildRequest,
    CacheListing,
    CacheRequest,
    ComposeRequest,
    DirSource,
    ReleaseRootfsReply,
    ReleaseRootfsRequest,
    Rootfs,
)
from schemas.node import Confinement, ConfineRequest, ReleaseReply, ReleaseRequest
from schemas.sandbox import SandboxSpec

AGENT_TIMEOUT_S = 10.0
COMPOSE_TIMEOUT_S = 60.0  # fetching a layer the node lacks can take a while
LAYERS_TIMEOUT_S = 30.0
HEARTBEAT_LISTING_TIMEOUT_S = 1.0  # a heartbeat must not wait on a busy layer-cache


class NodeAgent:
    def __init__(self, bus: Bus, node_id: str) -> None:
        self.bus = bus
        self._confine = node_schema.subject(node_id, node_schema.CONFINE)
        self._release = node_schema.subject(node_id, node_schema.RELEASE)

    async def confine(self, sandbox_id: str, spec: SandboxSpec) -> Confinement:
        """The sandbox's confinement, made (or, for one that has it already, found again)."""
        request = ConfineRequest(
            sandbox_id=sandbox_id, isolation=spec.isolation, cpu=spec.cpu, memory_mb=spec.memory_mb, pids=spec.pids,
            allow=list(spec.allow), labels=dict(spec.labels),
        )
        return await self.bus.request(self._confine, request, Confinement, timeout=AGENT_TIMEOUT_S)

    async def release(self, sandbox_id: str) -> None:
        await self.bus.request(self._release, ReleaseRequest(sandbox_id=sandbox_id), ReleaseReply,
                               timeout=AGENT_TIMEOUT_S)


class LayerCache:
    def __init__(self, bus: Bus, node_id: str) -> None:
        self.bus = bus
        self._compose = node_schema.subject(node_id, layers_schema.ROOTFS_COMPOSE)
        self._release = node_schema.subject(node_id, layers_schema.ROOTFS_RELEASE)
        self._cache = node_schema.subject(node_id, layers_schema.CACHE)

    async def compose(self, sandbox_id: str, layers: list[str], disk_mb: int) -> Rootfs:
        request = ComposeRequest(sandbox_id=sandbox_id, layers=layers, disk_mb=disk_mb)
        return await self.bus.request(self._compose, request, Rootfs, timeout=COMPOSE_TIMEOUT_S)

    async def release(self, sandbox_id: str) -> None:
        await self.bus.request(self._release, ReleaseRootfsRequest(sandbox_id=sandbox_id), ReleaseRootfsReply,
                               timeout=LAYERS_TIMEOUT_S)

    async def listing(self, timeout: float = LAYERS_TIMEOUT_S) -> CacheListing:
        """The node's cached images and the roots it holds, by sandbox."""
        return await self.bus.request(self._cache, CacheRequest(), CacheListing, timeout=timeout)

    async def build_from_dir(self, name: str, path: Path, on: str, timeout: float) -> BuildReply:
        """Layer `name` over `on` from a directory of this node: sent as a tar through the upload
        bucket to whichever layer-cache takes the build (it owns the store)."""
        src = path.resolve()
        if not src.is_dir():
            raise errors.InvalidRequest(f"{src} is not a directory")
        with tempfile.TemporaryDirectory(prefix="sandfleet-layer-") as tmp:
            archive = Path(tmp) / "dir.tar"
            await asyncio.to_thread(_tar_directory, src, archive)
            upload = await self._upload(archive)
        raw = {"name": name, "source": msgspec.to_builtins(DirSource(upload=upload, path=str(src))), "on": on,
               "tags": [], "compression": "lz4"}
        try:
            request = msgspec.convert(raw, BuildRequest)  # checks the name and refs before the round trip
        except msgspec.ValidationError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        return await self.bus.request(layers_schema.BUILD, request, BuildReply, timeout=timeout)

    async def _upload(self, archive: Path) -> str:
        try:
            bucket = await self.bus.js.object_store(layers_schema.UPLOAD_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            raise errors.NoResponders("no layer-cache has run on this bus (its upload bucket is missing)") from None
        name = "up-" + secrets.token_hex(12)
        with open(archive, "rb") as f:
            await bucket.put(name, f)
        return name


def _tar_directory(src: Path, out: Path) -> None:
    """A pax tar of `src` (as `.`) keeping owners, modes, links, devices and extended attributes,
    which the builder unpacks as the layer's files. (The SDK packs a user's directory the same
    way; a shared packer would live below both.)"""

    def with_xattrs(info: tarfile.TarInfo) -> tarfile.TarInfo:
        path = src / info.name
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError:
            names = []
        for name in names:
            info.pax_headers[f"SCHILY.xattr.{name}"] = os.getxattr(path, name, follow_symlinks=False).decode(
                "utf-8", "surrogateescape")
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(src, arcname=".", filter=with_xattrs)

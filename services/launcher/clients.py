"""Typed clients of the node-local services the launcher calls over the bus: the node agent
(a sandbox's confinement: cgroups, netns, BPF, Landlock) and the layer-cache (its composed
root, the node's cache listing, and the layer a checkpoint packs). Each method is one request
with its schema types; errors are the bus adapter's (sandfleet.errors) for the caller to judge.
"""

from __future__ import annotations

from pathlib import Path

from sandfleet.bus import Bus
from sandfleet.layers_client import Layers
from schemas import layers as layers_schema
from schemas import node as node_schema
from schemas.layers import (
    BuildReply,
    CacheListing,
    CacheRequest,
    ComposeRequest,
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
            allow=list(spec.allow), labels=dict(spec.labels), host_view=spec.host_view,
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
        """Layer `name` over `on` from a directory of this node: the same cluster build request a
        user's `layer build --dir` makes (sent as a tar through the upload bucket to whichever
        layer-cache takes it: it owns the store), so it is the SDK's layer client that makes it."""
        return await Layers(self.bus).build_dir(name, path, on=on, timeout=timeout)

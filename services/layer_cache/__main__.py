"""Composition root of a node's layer-cache: store, image cache, mounts, recovery, endpoints.

Environment: SANDFLEET_LAYER_CACHE_MB (the image cache budget, default 10240) besides the
common SANDFLEET_NATS_URL, SANDFLEET_NODE_ID and SANDFLEET_DATA_DIR (state goes to
`<data dir>/layer-cache`). On SIGTERM idle layer mounts are unmounted; roots still in use
stay mounted for the next instance to re-adopt.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os

from sandfleet import runner
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from schemas import layers
from schemas import node as node_schema
from services.layer_cache import handlers
from services.layer_cache.build import LayerBuilder
from services.layer_cache.cache import ImageCache
from services.layer_cache.compose import RootfsComposer
from services.layer_cache.mounts import LayerMounts
from services.layer_cache.recovery import Layout
from services.layer_cache.store import LayerStore

log = logging.getLogger("sandfleet.layer_cache")

DEFAULT_BUDGET_MB = 10240


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    layout = Layout(config.data_dir / "layer-cache")
    budget = int(os.environ.get("SANDFLEET_LAYER_CACHE_MB", DEFAULT_BUDGET_MB)) << 20
    async with runner.service_bus(layers.SERVICE, config) as bus:
        store = await LayerStore.open(bus.js)
        images = ImageCache(layout.images, budget, store.fetch_image, lambda digest: composer.before_evict(digest))
        composer = RootfsComposer(layout, images, LayerMounts(layout.mnt))
        images.scan()
        composer.recover()
        deps = handlers.Deps(
            node_id=config.node_id, store=store, images=images, composer=composer,
            builder=LayerBuilder(layout, store, images, config.node_id),
        )
        h = functools.partial
        n = config.node_id
        on_node = layers.node_queue_group(n)
        await bus.serve(
            layers.SERVICE,
            [
                Endpoint("build", layers.BUILD, layers.BuildRequest, h(handlers.build, deps)),
                Endpoint("list", layers.LIST, layers.ListRequest, h(handlers.list_layers, deps)),
                Endpoint("get", layers.GET, layers.GetRequest, h(handlers.get, deps)),
                Endpoint("remove", layers.REMOVE, layers.RemoveRequest, h(handlers.remove, deps)),
                Endpoint("compose", node_schema.subject(n, layers.ROOTFS_COMPOSE), layers.ComposeRequest,
                         h(handlers.compose, deps), queue_group=on_node),
                Endpoint("release", node_schema.subject(n, layers.ROOTFS_RELEASE), layers.ReleaseRootfsRequest,
                         h(handlers.release, deps), queue_group=on_node),
                Endpoint("cache", node_schema.subject(n, layers.CACHE), layers.CacheRequest,
                         h(handlers.cache, deps), queue_group=on_node),
            ],
            queue_group=layers.QUEUE_GROUP,
        )
        log.info("layer-cache serving node %s (%d images cached, %d rootfs re-adopted)",
                 n, len(images.images), len(composer.live))
        await stop.wait()
    composer.shutdown()


if __name__ == "__main__":
    runner.run(layers.SERVICE, main)

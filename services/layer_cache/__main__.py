"""Composition root of a node's layer-cache: store, image cache, mounts, recovery, endpoints.

Environment: SANDFLEET_LAYER_CACHE_MB (the image cache budget, default 10240) and
SANDFLEET_LAYER_FETCH (`lazy`, the default: new images are mounted at once and their chunks
fetched when read; `full`: whole images are fetched first) besides the common
SANDFLEET_NATS_URL, SANDFLEET_NODE_ID and SANDFLEET_DATA_DIR (state goes to
`<data dir>/layer-cache`). On SIGTERM idle layer mounts are unmounted; roots still in use
stay mounted for the next instance to re-adopt, and so does the lazy-layer daemon while a
lazy image is mounted (it is ended with the last one). A daemon that cannot be adopted
leaves the roots over its images broken: they are marked so and an event says which.

Every mount it makes is in the node's roots namespace (linuxnode.roots_ns), entered before
anything else (the FUSE daemon it starts is born there too), so the host's mount table does
not grow with sandboxes; a clean stop that leaves no root unpins the namespace.
SANDFLEET_ROOTS_NS=host keeps them in the host's table instead (roots readable by their
paths from anywhere on the host, as the layer-cache's own module tests read them; the
launcher finds no pin and takes roots from its own namespace).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os

from linuxnode import roots_ns, userns
from sandfleet import metrics, runner
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from schemas import layers
from schemas import node as node_schema
from schemas.layers import FETCH_MODES
from services.layer_cache import handlers, transfer
from services.layer_cache.build import LayerBuilder
from services.layer_cache.cache import ImageCache
from services.layer_cache.compose import RootfsComposer
from services.layer_cache.daemon import LazyLayers
from services.layer_cache.mounts import LayerMounts
from services.layer_cache.recovery import Layout
from services.layer_cache.store import LayerStore

log = logging.getLogger("sandfleet.layer_cache")

DEFAULT_BUDGET_MB = 10240


def enter_roots_namespace(node_id: str) -> int:
    """Live in the node's roots namespace from here on (made and pinned if there is none);
    returns an fd of the host's, where the pin is undone at the end."""
    host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    ns = roots_ns.ensure(node_id)
    try:
        roots_ns.enter(ns)
    finally:
        os.close(ns)
    # Worker threads are started by the thread that submits to them: a fresh pool's are born
    # in the roots namespace (one made before the move would mount on the host).
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor())
    return host


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    own_namespace, host_ns = os.environ.get("SANDFLEET_ROOTS_NS", "") != "host", -1
    if own_namespace:
        try:
            host_ns = enter_roots_namespace(config.node_id)
        except OSError as exc:  # roots then go to the host's table, as before; the launcher finds no pin
            log.error("no roots namespace for node %s (%s): roots are mounted in the host's mount table",
                      config.node_id, exc)
            own_namespace = False
    layout = Layout(config.data_dir / "layer-cache")
    ids = userns.node_range(config.userns)  # sandbox roots' host ids: layers are mounted idmapped to them
    budget = int(os.environ.get("SANDFLEET_LAYER_CACHE_MB", DEFAULT_BUDGET_MB)) << 20
    if config.layer_fetch not in FETCH_MODES:
        raise SystemExit(f"SANDFLEET_LAYER_FETCH is {config.layer_fetch!r}; use one of {', '.join(FETCH_MODES)}")
    async with runner.service_bus(layers.SERVICE, config) as bus:
        store = await LayerStore.open(bus.js)
        lazy = LazyLayers(layout.root, layout.images, bus.js)
        images = ImageCache(layout.images, budget, store.fetch_image, lambda digest: composer.before_evict(digest),
                            lazy=lazy, fetch_mode=config.layer_fetch)
        composer = RootfsComposer(layout, images, LayerMounts(layout.mnt, ids))
        images.scan()
        metrics.LAYER_CACHE_BYTES.set_function(lambda: sum(i.fetched_bytes for i in list(images.images.values())),
                                               kind="fetched")
        metrics.LAYER_CACHE_BYTES.set_function(lambda: images.used, kind="disk")
        composer.recover()
        deps = handlers.Deps(
            node_id=config.node_id, store=store, images=images, composer=composer,
            builder=LayerBuilder(layout, store, images, config.node_id, ids), bus=bus,
        )
        lazy.daemon.on_lost = functools.partial(handlers.lazy_layers_lost, deps)
        if not await lazy.daemon.adopt():
            await handlers.lazy_layers_lost(deps, "lazy daemon died")
        h = functools.partial
        n = config.node_id
        on_node = layers.node_queue_group(n)
        await bus.serve(
            layers.SERVICE,
            [
                Endpoint("build", layers.BUILD, layers.BuildRequest, h(handlers.build, deps)),
                Endpoint("list", layers.LIST, layers.ListRequest, h(handlers.list_layers, deps)),
                Endpoint("get", layers.GET, layers.GetRequest, h(handlers.get, deps)),
                Endpoint("known-diffs", layers.KNOWN_DIFFS, layers.KnownDiffsRequest, h(handlers.known_diffs, deps)),
                Endpoint("remove", layers.REMOVE, layers.RemoveRequest, h(handlers.remove, deps)),
                Endpoint("push", layers.PUSH, layers.TransferRequest,
                         h(transfer.push, store, layout.builds, config.data_dir)),
                Endpoint("pull", layers.PULL, layers.TransferRequest,
                         h(transfer.pull, store, layout.builds, config.data_dir)),
                Endpoint("compose", node_schema.subject(n, layers.ROOTFS_COMPOSE), layers.ComposeRequest,
                         h(handlers.compose, deps), queue_group=on_node),
                Endpoint("release", node_schema.subject(n, layers.ROOTFS_RELEASE), layers.ReleaseRootfsRequest,
                         h(handlers.release, deps), queue_group=on_node),
                Endpoint("cache", node_schema.subject(n, layers.CACHE), layers.CacheRequest,
                         h(handlers.cache, deps), queue_group=on_node),
                Endpoint("cache-drop", node_schema.subject(n, layers.CACHE_DROP), layers.CacheDropRequest,
                         h(handlers.cache_drop, deps), queue_group=on_node),
            ],
            queue_group=layers.QUEUE_GROUP,
        )
        log.info("layer-cache serving node %s (fetch %s; %d images cached, %d rootfs re-adopted)",
                 n, images.fetch_mode, len(images.images), len(composer.live))
        await stop.wait()
    composer.shutdown()
    if not any(images.images[d].lazy for d in composer.mounts.mounted if d in images.images):
        lazy.daemon.stop()
    else:
        lazy.daemon.detach()  # roots read through it: it serves on for the next instance
    if own_namespace:
        if not composer.live and not composer.mounts.mounted:
            roots_ns.remove(config.node_id, host_ns)  # nothing in it is anyone's: it ends with us
        os.close(host_ns)


if __name__ == "__main__":
    runner.run(layers.SERVICE, main, node_scoped=True)

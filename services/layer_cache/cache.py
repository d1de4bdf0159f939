"""The node's image cache: EROFS files under a size budget, least recently used evicted first.

An image is pinned for as long as a composed root uses it, and a pinned image is never
evicted; an unpinned one may still be mounted (idle mounts keep their page cache warm for
the next sandbox) and is unmounted by the eviction hook before its file goes. The budget is
soft: when every image is pinned the cache grows past it rather than fail a sandbox.

The cache knows an image only as a path that EROFS can be mounted from, plus how many bytes
it takes on disk. A lazily fetched image (`lazy=True`) is a FUSE file whose chunks arrive
when read (`lazy.py`, `daemon.py`): its path is the FUSE file, its bytes on disk are what
has been fetched so far, and `complete` says whether every chunk is there. Which kind a new
image becomes is the node's fetch mode; an image keeps its kind until it is evicted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sandfleet import metrics, telemetry
from services.layer_cache.lazy import INDEX, LazyFiles, leftovers
from services.layer_cache.store import HASH_BYTES

log = logging.getLogger("sandfleet.layer_cache")

SUFFIX = ".erofs"
PARTIAL = ".part"
PERSIST_EVERY_S = 30.0  # how stale a file's mtime (its last use, for a restart) may get

Fetch = Callable[[str, Path], Awaitable[None]]  # (digest, destination file)


class LazySource(Protocol):
    """Lazy images for the cache (`daemon.LazyLayers` on a node)."""

    def files(self, digest: str) -> LazyFiles: ...
    def source(self, digest: str) -> Path: ...
    async def ready(self) -> None: ...
    async def prepare(self, digest: str) -> None: ...


@dataclass
class CachedImage:
    digest: str
    path: Path
    size: int
    disk_bytes: int
    last_used: float
    pins: int = 0
    complete: bool = True
    persisted: float = 0.0  # the last use written to the file's mtime
    lazy: bool = False
    fetched_bytes: int = 0  # from the store to this node (a whole image found at start counts as fetched)
    written_bytes: int = 0  # to this node's disk


def choose_victims(
    images: Iterable[CachedImage], budget: int, incoming: int = 0, keep: frozenset[str] = frozenset()
) -> list[str]:
    """Digests to drop, least recently used first, so that what stays plus `incoming` fits `budget`.

    Pinned images and those in `keep` are never chosen, so the result may not reach the budget.
    """
    images = list(images)
    used = sum(i.disk_bytes for i in images) + incoming
    victims = []
    candidates = (i for i in images if i.pins == 0 and i.digest not in keep)
    for image in sorted(candidates, key=lambda i: (i.last_used, i.digest)):
        if used <= budget:
            break
        victims.append(image.digest)
        used -= image.disk_bytes
    return victims


class ImageCache:
    def __init__(self, root: Path, budget: int, fetch: Fetch, before_evict: Callable[[str], None],
                 lazy: LazySource | None = None, fetch_mode: str = "full") -> None:
        self.root = root
        self.budget = budget
        self._fetch = fetch
        self._before_evict = before_evict
        self.lazy = lazy
        self.fetch_mode = fetch_mode if lazy is not None else "full"
        self.images: dict[str, CachedImage] = {}
        self._fetching: dict[str, asyncio.Future[CachedImage]] = {}

    def path(self, digest: str) -> Path:
        return self.root / (digest.removeprefix("sha256:") + SUFFIX)

    @property
    def used(self) -> int:
        return sum(i.disk_bytes for i in self.images.values())

    def refresh(self) -> None:
        """Bring the lazy images' byte counts up to date (the FUSE daemon fills them)."""
        for image in self.images.values():
            if image.lazy and self.lazy is not None:
                try:
                    present, image.disk_bytes, image.complete = self.lazy.files(image.digest).usage()
                except (FileNotFoundError, ValueError):
                    continue
                image.fetched_bytes = image.written_bytes = present

    def scan(self) -> None:
        """Index the files a previous instance left; half-fetched ones are dropped. The file's
        mtime is its last use, so the LRU order survives a restart."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in leftovers(self.root):
            path.unlink(missing_ok=True)
        for path in self.root.iterdir():
            if path.name.endswith(PARTIAL):
                path.unlink(missing_ok=True)
                continue
            if path.name.endswith(INDEX) and self.lazy is not None:
                digest = "sha256:" + path.name.removesuffix(INDEX)
                try:
                    index = self.lazy.files(digest).read_index()
                except ValueError:
                    self.lazy.files(digest).remove()
                    continue
                if len(index.hashes) != HASH_BYTES * len(index.seqs):
                    # Made before chunks were checked (no hashes): every unfetched chunk would fail
                    # its check. Dropped; the next mount prepares the image again, with its manifest.
                    self.lazy.files(digest).remove()
                    continue
                size = index.size
                mtime = path.stat().st_mtime
                self.images[digest] = CachedImage(digest, self.lazy.source(digest), size, 0, mtime, complete=False,
                                                  persisted=mtime, lazy=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            digest = "sha256:" + path.name.removesuffix(SUFFIX)
            st = path.stat()
            self.images[digest] = CachedImage(digest, path, st.st_size, st.st_blocks * 512, st.st_mtime,
                                              persisted=st.st_mtime, fetched_bytes=st.st_size,
                                              written_bytes=st.st_size)
        self.refresh()

    # -- use --------------------------------------------------------------------------

    def pin(self, digest: str) -> None:
        image = self.images.get(digest)
        if image is not None:
            image.pins += 1

    def unpin(self, digest: str) -> None:
        image = self.images.get(digest)
        if image is not None and image.pins > 0:
            image.pins -= 1
            self.touch(image)

    def touch(self, image: CachedImage) -> None:
        image.last_used = time.time()
        if image.last_used - image.persisted > PERSIST_EVERY_S:  # the copy on disk may lag a little
            try:
                os.utime(self.lazy.files(image.digest).index if image.lazy and self.lazy else image.path,
                         (image.last_used, image.last_used))
            except FileNotFoundError:
                pass
            image.persisted = image.last_used

    async def acquire(self, digest: str, size_hint: int = 0) -> CachedImage:
        """The image on this node, fetched if missing, pinned for the caller (one fetch per
        digest however many callers wait for it)."""
        metrics.LAYER_LOOKUPS.inc(result="hit" if digest in self.images else "miss")
        while (image := self.images.get(digest)) is None:  # evicted again before we woke: fetch again
            pending = self._fetching.get(digest)
            if pending is None:
                pending = self._fetching[digest] = asyncio.ensure_future(self._fetch_into_cache(digest, size_hint))
                pending.add_done_callback(lambda _: self._fetching.pop(digest, None))
            await asyncio.shield(pending)
        image.pins += 1
        self.touch(image)
        if image.lazy and self.lazy is not None:
            try:
                await self.lazy.ready()  # its daemon may have stopped with the previous instance
            except BaseException:
                image.pins -= 1
                raise
        return image

    async def _fetch_into_cache(self, digest: str, size_hint: int) -> CachedImage:
        attributes = {"sandfleet.layer.digest": digest, "sandfleet.layer.fetch": self.fetch_mode}
        with telemetry.phase("layer.fetch", attributes):
            return await self._fetch_now(digest, size_hint)

    async def _fetch_now(self, digest: str, size_hint: int) -> CachedImage:
        if self.fetch_mode == "lazy" and self.lazy is not None:
            return await self._prepare_lazy(digest)
        self.evict(incoming=size_hint)
        final = self.path(digest)
        partial = final.with_name(final.name + PARTIAL)
        try:
            await self._fetch(digest, partial)
            partial.rename(final)
        finally:
            partial.unlink(missing_ok=True)
        image = self.add(digest, final)
        image.fetched_bytes = image.written_bytes = image.size
        metrics.LAYER_FETCHED.inc(image.size)
        return image

    async def _prepare_lazy(self, digest: str) -> CachedImage:
        assert self.lazy is not None
        files = self.lazy.files(digest)
        try:
            await self.lazy.prepare(digest)
        except BaseException:
            files.remove()
            raise
        size = files.read_index().size
        image = CachedImage(digest, self.lazy.source(digest), size, 0, time.time(), complete=False, lazy=True,
                            persisted=time.time())
        self.images[digest] = image
        self.refresh()
        self.evict(keep=frozenset({digest}))
        return image

    def add(self, digest: str, path: Path) -> CachedImage:
        """Take in an image file (fetched, or built on this node) and evict to stay in budget."""
        final = self.path(digest)
        existing = self.images.get(digest)
        if existing is not None and path != final:
            path.unlink(missing_ok=True)  # an identical rebuild; the cached file may be mounted
            self.touch(existing)
            return existing
        if path != final:
            os.replace(path, final)
        st = final.stat()
        image = CachedImage(digest, final, st.st_size, st.st_blocks * 512, time.time(),
                            pins=existing.pins if existing else 0, persisted=st.st_mtime, written_bytes=st.st_size)
        self.images[digest] = image
        self.evict(keep=frozenset({digest}))
        return image

    # -- eviction ---------------------------------------------------------------------

    def evict(self, incoming: int = 0, keep: frozenset[str] = frozenset()) -> list[str]:
        self.refresh()
        victims = choose_victims(self.images.values(), self.budget, incoming, keep)
        for digest in victims:
            self.drop(digest)
        if victims:
            log.info("evicted %d image(s) to stay within %d bytes: %s", len(victims), self.budget, victims)
        if self.used + incoming > self.budget:
            log.warning("image cache holds %d bytes (+%d coming), over its budget of %d: the rest is in use",
                        self.used, incoming, self.budget)
        return victims

    def drop(self, digest: str) -> None:
        image = self.images[digest]
        if image.pins:
            raise RuntimeError(f"image {digest} is in use")
        self._before_evict(digest)
        if image.lazy and self.lazy is not None:
            self.lazy.files(digest).remove()
        else:
            image.path.unlink(missing_ok=True)
        del self.images[digest]

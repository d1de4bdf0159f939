"""A sandbox's root filesystem: overlayfs over the node's layer mounts, one upper dir per sandbox.

Each step of a compose registers its undo the moment it has happened (pin, mount, directory,
overlay), so a failure half way walks back exactly what was done; a release walks the same
steps. On start, `recover()` applies the plan of `recovery.py` to what a previous instance
left; on stop, only idle layer mounts go: composed roots belong to running sandboxes and are
re-adopted by the next instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import Rootfs
from services.layer_cache import mounts
from services.layer_cache.cache import ImageCache
from services.layer_cache.mounts import LayerMounts, remove_tree
from services.layer_cache.recovery import Layout, Plan, plan

log = logging.getLogger("sandfleet.layer_cache")


@dataclass(frozen=True)
class Composed:
    sandbox_id: str
    digests: tuple[str, ...]  # bottom first
    dir: Path
    created_at: float

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    @property
    def upper(self) -> Path:
        return self.dir / "upper"

    @property
    def work(self) -> Path:
        return self.dir / "work"

    def wire(self) -> Rootfs:
        return Rootfs(sandbox_id=self.sandbox_id, path=str(self.rootfs), upper=str(self.upper),
                      layers=list(self.digests), created_at=self.created_at)


class RootfsComposer:
    def __init__(self, layout: Layout, images: ImageCache, layer_mounts: LayerMounts) -> None:
        self.layout = layout
        self.images = images
        self.mounts = layer_mounts
        self.live: dict[str, Composed] = {}
        self._users: Counter[str] = Counter()  # digest → composed roots over it
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # lock, how many hold or wait

    @contextlib.asynccontextmanager
    async def _exclusive(self, sandbox_id: str) -> AsyncIterator[None]:
        """One compose or release at a time per sandbox; the lock goes when nobody waits."""
        lock, holders = self._locks.get(sandbox_id, (asyncio.Lock(), 0))
        self._locks[sandbox_id] = (lock, holders + 1)
        try:
            async with lock:
                yield
        finally:
            lock, holders = self._locks[sandbox_id]
            if holders == 1:
                del self._locks[sandbox_id]
            else:
                self._locks[sandbox_id] = (lock, holders - 1)

    def users(self, digest: str) -> int:
        return self._users[digest]

    def _add(self, composed: Composed) -> None:
        self.live[composed.sandbox_id] = composed
        self._users.update(composed.digests)

    def _remove(self, composed: Composed) -> None:
        del self.live[composed.sandbox_id]
        self._users.subtract(composed.digests)
        for digest in composed.digests:
            if self._users[digest] <= 0:
                del self._users[digest]

    # -- compose / release ------------------------------------------------------------

    async def compose(self, sandbox_id: str, layers: list[tuple[str, int]]) -> Composed:
        """`layers` is (digest, size) bottom first; composing the same sandbox again with the same
        layers returns the root it has (a retried request), with others it is a conflict."""
        digests = tuple(d for d, _ in layers)
        if len(set(digests)) != len(digests):
            raise ServiceError(ErrorCode.INVALID_REQUEST, "a layer appears twice in the list")
        async with self._exclusive(sandbox_id):
            existing = self.live.get(sandbox_id)
            if existing is not None:
                if existing.digests == digests:
                    return existing
                raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} already has a rootfs of other layers")
            with contextlib.ExitStack() as undo:
                fresh: list[str] = []  # layers this compose mounted; unmounted last, once unpinned
                undo.callback(self._unmount_if_idle, fresh)
                for digest, size in layers:
                    await self.images.acquire(digest, size)
                    undo.callback(self.images.unpin, digest)
                lowers = [str(self._mount_layer(d, fresh)) for d in digests]
                composed = Composed(sandbox_id, digests, self.layout.sandbox(sandbox_id), time.time())
                composed.dir.mkdir(parents=True, exist_ok=False)
                undo.callback(remove_tree, composed.dir)
                for path in (composed.upper, composed.work, composed.rootfs):
                    path.mkdir()
                _copy_root_attributes(Path(lowers[0]), composed.upper)
                mounts.mount_overlay(list(reversed(lowers)), composed.upper, composed.work, composed.rootfs)
                undo.callback(mounts.umount, str(composed.rootfs))
                self._add(composed)
                undo.pop_all()
            log.info("composed rootfs sandbox.id=%s layers=%d", sandbox_id, len(digests))
            return composed

    def _mount_layer(self, digest: str, fresh: list[str]) -> Path:
        if digest not in self.mounts.mounted:
            fresh.append(digest)
        return self.mounts.ensure(digest, self.images.path(digest))

    def _unmount_if_idle(self, digests: list[str]) -> None:
        """After a failed compose: its new mounts stay only where another compose uses them."""
        for digest in digests:
            image = self.images.images.get(digest)
            if (image is None or image.pins == 0) and self.users(digest) == 0:
                self.mounts.unmount(digest)

    async def release(self, sandbox_id: str) -> bool:
        async with self._exclusive(sandbox_id):
            composed = self.live.get(sandbox_id)
            if composed is None:
                return False
            # A plain unmount fails on a root with mounts beneath it; `umount` then detaches the
            # whole tree, so either way nothing is left under the directory.
            mounts.umount(str(composed.rootfs))
            self._remove(composed)
            await asyncio.to_thread(remove_tree, composed.dir, False)
            for digest in composed.digests:
                self.images.unpin(digest)
                if digest not in self.images.images and self.users(digest) == 0:
                    self.mounts.unmount(digest)  # adopted over an image file that is gone
            self.images.evict()
            log.info("released rootfs sandbox.id=%s", sandbox_id)
            return True

    # -- the images' eviction hook ----------------------------------------------------

    def before_evict(self, digest: str) -> None:
        if self.users(digest):
            raise RuntimeError(f"image {digest} is used by a rootfs")
        self.mounts.unmount(digest)

    # -- start and stop ---------------------------------------------------------------

    def recover(self) -> Plan:
        """Re-adopt the roots and layer mounts a previous instance left; undo everything else."""
        for path in (self.layout.mnt, self.layout.sandboxes):
            path.mkdir(parents=True, exist_ok=True)
        if self.layout.builds.exists():
            mounts.unmount_tree(self.layout.builds)
            remove_tree(self.layout.builds)
        found = plan(
            self.layout,
            mounts.read_mountinfo(),
            sorted(os.listdir(self.layout.sandboxes)),
            sorted(os.listdir(self.layout.mnt)),
        )
        for point in found.unmount:
            log.info("unmounting %s left by a previous instance", point)
            mounts.umount(point)
        for path in map(Path, found.remove):
            if path.is_dir():
                remove_tree(path)
        for digest in found.layer_mounts:
            self.mounts.adopt(digest)
        for sandbox_id, digests in found.rootfs.items():
            composed = Composed(sandbox_id, tuple(digests), self.layout.sandbox(sandbox_id),
                                self.layout.sandbox(sandbox_id).stat().st_mtime)
            self._add(composed)
            for digest in digests:
                self.images.pin(digest)
        for digest in list(self.mounts.mounted):
            if digest not in self.images.images and self.users(digest) == 0:
                self.mounts.unmount(digest)
        log.info("recovered %d rootfs and %d layer mounts; undid %d mounts and %d dirs",
                 len(self.live), len(self.mounts.mounted), len(found.unmount), len(found.remove))
        return found

    def shutdown(self) -> None:
        """Unmount idle layer mounts; keep what running sandboxes use for the next instance."""
        for digest in list(self.mounts.mounted):
            if self.users(digest) == 0:
                try:
                    self.mounts.unmount(digest)
                except OSError as exc:
                    log.warning("could not unmount %s: %s", digest, exc)


def _copy_root_attributes(base_layer: Path, upper: Path) -> None:
    """The overlay's root takes the upper dir's owner and mode: make them the base system's
    (a task layer built from a private temporary directory would make `/` mode 0700)."""
    want, have = base_layer.stat(), upper.stat()
    if (want.st_uid, want.st_gid) != (have.st_uid, have.st_gid):
        os.chown(upper, want.st_uid, want.st_gid)
    if want.st_mode & 0o7777 != have.st_mode & 0o7777:
        os.chmod(upper, want.st_mode & 0o7777)


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

import msgspec

from sandfleet.errors import ServiceError
from sandfleet import telemetry
from sandfleet.telemetry import SANDBOX_ID
from schemas.errors import ErrorCode
from schemas.layers import ImageConfig, Rootfs
from services.layer_cache import mounts
from services.layer_cache.cache import ImageCache
from services.layer_cache.mounts import LayerMounts, remove_tree
from services.layer_cache.recovery import Layout, Plan, plan

log = logging.getLogger("sandfleet.layer_cache")

CONFIG_FILE = "image-config.json"  # beside rootfs/upper/work: a restarted layer-cache reads it back


@dataclass(frozen=True)
class Composed:
    sandbox_id: str
    digests: tuple[str, ...]  # bottom first
    dir: Path
    created_at: float
    config: ImageConfig | None = None  # of the image it was composed over; kept beside the root
    id_host: int = 0  # the host id its (idmapped) layers' root is: the node's range (LayerMounts.ids)

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    @property
    def upper(self) -> Path:
        return self.dir / "upper"

    @property
    def work(self) -> Path:
        return self.dir / "work"

    def wire(self, broken: str = "") -> Rootfs:
        return Rootfs(sandbox_id=self.sandbox_id, path=str(self.rootfs), upper=str(self.upper),
                      layers=list(self.digests), created_at=self.created_at, broken=broken, config=self.config,
                      id_host=self.id_host)

    @property
    def config_file(self) -> Path:
        return self.dir / CONFIG_FILE


class RootfsComposer:
    def __init__(self, layout: Layout, images: ImageCache, layer_mounts: LayerMounts) -> None:
        self.layout = layout
        self.images = images
        self.mounts = layer_mounts
        self.live: dict[str, Composed] = {}
        self._users: Counter[str] = Counter()  # digest → composed roots over it
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # lock, how many hold or wait
        self._lazy_mounting = asyncio.Lock()
        self.broken: dict[str, str] = {}  # sandbox id → why its lazy layers cannot be read any more

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

    @property
    def _id_host(self) -> int:
        return self.mounts.ids.host if self.mounts.ids is not None else 0

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

    async def compose(self, sandbox_id: str, layers: list[tuple[str, int]], disk_mb: int = 0,
                      config: ImageConfig | None = None) -> Composed:
        """`layers` is (digest, size) bottom first; composing the same sandbox again with the same
        layers returns the root it has (a retried request), with others it is a conflict.
        `disk_mb` > 0 puts the upper dir on a tmpfs of that size: a write beyond it is ENOSPC in
        this sandbox only, and its pages are charged to the writer's memory cgroup."""
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
                with telemetry.phase("layer.mount", {SANDBOX_ID: sandbox_id, telemetry.LAYERS: list(digests)}):
                    lowers = [str(await self._mount_layer(d, fresh)) for d in digests]
                composed = Composed(sandbox_id, digests, self.layout.sandbox(sandbox_id), time.time(), config,
                                    self._id_host)
                composed.dir.mkdir(parents=True, exist_ok=False)
                undo.callback(remove_tree, composed.dir)
                if disk_mb:
                    mounts.mount("upper", str(composed.dir), "tmpfs", mounts.MS_NODEV, f"size={disk_mb}m,mode=0755")
                    undo.callback(mounts.umount, str(composed.dir))
                for path in (composed.upper, composed.work, composed.rootfs):
                    path.mkdir()
                if config is not None:
                    composed.config_file.write_bytes(msgspec.json.encode(config))
                _copy_root_attributes(Path(lowers[0]), composed.upper)
                with telemetry.phase("layer.compose_root", {SANDBOX_ID: sandbox_id}):
                    mounts.mount_overlay(list(reversed(lowers)), composed.upper, composed.work, composed.rootfs)
                undo.callback(mounts.umount, str(composed.rootfs))
                self._add(composed)
                undo.pop_all()
            log.info("composed the rootfs of %s from %d layers", sandbox_id, len(digests), extra={SANDBOX_ID: sandbox_id})
            return composed

    async def _mount_layer(self, digest: str, fresh: list[str]) -> Path:
        image = self.images.images[digest]
        if digest in self.mounts.mounted:
            return self.mounts.mountpoint(digest)
        if not image.lazy:
            fresh.append(digest)
            return self.mounts.ensure(digest, image.path)
        # EROFS reads its superblock through the FUSE daemon, maybe from the store: not on the loop.
        async with self._lazy_mounting:
            if digest not in self.mounts.mounted:
                fresh.append(digest)
                await asyncio.to_thread(self.mounts.ensure, digest, image.path)
            return self.mounts.mountpoint(digest)

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
            mounts.umount(str(composed.dir))  # the upper dir's tmpfs, where it has one
            self._remove(composed)
            if self.broken.pop(sandbox_id, None) is not None:
                self._save_broken()
            await asyncio.to_thread(remove_tree, composed.dir, False)
            for digest in composed.digests:
                self.images.unpin(digest)
                if digest not in self.images.images and self.users(digest) == 0:
                    self.mounts.unmount(digest)  # adopted over an image file that is gone
            self.images.evict()
            log.info("released the rootfs of %s", sandbox_id, extra={SANDBOX_ID: sandbox_id})
            return True

    # -- lazy layers whose FUSE daemon is gone -----------------------------------------

    def lose_lazy_layers(self, reason: str) -> dict[str, list[str]]:
        """The FUSE daemon is gone, so every image mounted from its files reads EIO from now on.
        Those mounts are detached, so the next compose mounts the image afresh over a new daemon;
        the roots over them keep the dead ones and are marked broken (in listings, and in a file
        so a restarted instance does not take them for healthy) until they are released.
        Returns digest → the sandboxes whose roots broke."""
        lazy_dir, mnt = str(self.layout.lazy) + "/", str(self.layout.mnt) + "/"
        lost: dict[str, list[str]] = {}
        for e in mounts.read_mountinfo():
            if e.fstype == "erofs" and e.source.startswith(lazy_dir) and e.mount_point.startswith(mnt):
                digest = "sha256:" + e.mount_point.rsplit("/", 1)[1]
                lost[digest] = sorted(c.sandbox_id for c in self.live.values() if digest in c.digests)
        for digest, sandboxes in lost.items():
            self.broken.update((sandbox_id, reason) for sandbox_id in sandboxes)
            try:
                mounts.linux.umount2(str(self.mounts.mountpoint(digest)), mounts.MNT_DETACH)
            except OSError as exc:
                log.warning("could not detach the lazy image mount of %s: %s", digest, exc)
            self.mounts.mounted.discard(digest)
        if lost:
            self._save_broken()
            log.error("%s: %d lazy image(s) lost, roots now broken: %s", reason, len(lost), sorted(self.broken))
        return lost

    def _save_broken(self) -> None:
        lines = "".join(f"{sandbox_id} {why}\n" for sandbox_id, why in sorted(self.broken.items()))
        tmp = self.layout.broken.with_name(self.layout.broken.name + ".tmp")
        tmp.write_text(lines)
        os.replace(tmp, self.layout.broken)

    def _load_broken(self) -> None:
        try:
            text = self.layout.broken.read_text()
        except FileNotFoundError:
            return
        for line in text.splitlines():
            sandbox_id, _, why = line.partition(" ")
            if sandbox_id in self.live:
                self.broken[sandbox_id] = why
        self._save_broken()

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
                                self.layout.sandbox(sandbox_id).stat().st_mtime, _read_config(self.layout.sandbox(sandbox_id)),
                                self._id_host)  # its layer mounts are re-adopted as they are: mapped alike
            self._add(composed)
            for digest in digests:
                self.images.pin(digest)
        for digest in list(self.mounts.mounted):
            if digest not in self.images.images and self.users(digest) == 0:
                self.mounts.unmount(digest)
        self._load_broken()
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


def _read_config(sandbox_dir: Path) -> ImageConfig | None:
    try:
        return msgspec.json.decode((sandbox_dir / CONFIG_FILE).read_bytes(), type=ImageConfig)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError) as exc:  # the root is still worth re-adopting without it
        log.warning("unreadable image config in %s: %s", sandbox_dir, exc)
        return None


def _copy_root_attributes(base_layer: Path, upper: Path) -> None:
    """The overlay's root takes the upper dir's owner and mode: make them the base system's
    (a task layer built from a private temporary directory would make `/` mode 0700)."""
    want, have = base_layer.stat(), upper.stat()
    if (want.st_uid, want.st_gid) != (have.st_uid, have.st_gid):
        os.chown(upper, want.st_uid, want.st_gid)
    if want.st_mode & 0o7777 != have.st_mode & 0o7777:
        os.chmod(upper, want.st_mode & 0o7777)


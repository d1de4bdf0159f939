"""The layer-cache's side of lazy layers: preparing an image for lazy reads, and the FUSE daemon's life.

The daemon (`lazyfs.py`) runs in a session of its own, so a layer-cache that restarts or
crashes leaves it serving the roots that read through it; the next instance finds it by its
pid file and the FUSE mount, and adopts it. A daemon that died, hangs, or is not ours is
ended and its mount detached. While the layer-cache runs it watches the daemon (a pidfd,
and a health probe of the mount with a deadline, because a stuck FUSE daemon makes every
reader wait); when the daemon is lost the layer-cache is told (`on_lost`) and starts a new
one for new mounts on the next lazy compose. A clean stop ends the daemon only when no lazy
image is mounted any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.layers import CHUNK_BYTES, OBJECT_BUCKET
from services.layer_cache import mounts
from services.layer_cache.lazy import ChunkIndex, LazyFiles, chunk_index
from services.layer_cache.store import LayerStore, chunk_hashes, write_manifest

log = logging.getLogger("sandfleet.layer_cache")

MODULE = "services.layer_cache.lazyfs"
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
PROBE_EVERY_S = 5.0
PROBE_TIMEOUT_S = 10.0
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class LazyDaemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.mountpoint = root / "lazy"
        self.pidfile = root / "lazyfs.pid"
        self.log = root / "lazyfs.log"
        self.pid = 0
        self._proc: subprocess.Popen | None = None
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None
        self.on_lost: Callable[[str], Awaitable[None]] | None = None

    # -- what is there ------------------------------------------------------------------

    def mounted(self) -> bool:
        return any(e.mount_point == str(self.mountpoint) and e.fstype.startswith("fuse")
                   for e in mounts.read_mountinfo())

    def ours(self, pid: int) -> bool:
        argv = _cmdline(pid)
        return MODULE in argv and str(self.root) in argv

    def running(self) -> bool:
        return bool(self.pid) and self.ours(self.pid)

    def _recorded_pid(self) -> int:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return 0

    # -- start, adopt, stop -------------------------------------------------------------

    async def adopt(self) -> bool:
        """Take over a daemon a previous instance left, if it is alive, mounted and answering;
        otherwise end whatever is left of it. True when one was adopted."""
        pid = self._recorded_pid()
        if pid and self.ours(pid) and self.mounted() and await self.probe():
            self.pid = pid
            self._start_watch()
            log.info("adopted the lazy-layer daemon (pid %d)", pid)
            return True
        await asyncio.to_thread(self._clear, pid)
        return False

    async def ensure(self) -> None:
        async with self._lock:
            if self.running():
                return
            await asyncio.to_thread(self._clear, self.pid or self._recorded_pid())
            self.mountpoint.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
            with open(self.log, "ab") as out:
                self._proc = subprocess.Popen([sys.executable, "-m", MODULE, str(self.root)], env=env, cwd=REPO_ROOT,
                                              stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
            self.pid = self._proc.pid
            self.pidfile.write_text(f"{self.pid}\n")
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self.mounted():
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    await asyncio.to_thread(self._clear, self.pid)
                    raise ServiceError(ErrorCode.INTERNAL, f"the lazy-layer daemon did not start; see {self.log}")
                await asyncio.sleep(0.05)
            self._start_watch()
            log.info("started the lazy-layer daemon (pid %d)", self.pid)

    def detach(self) -> None:
        """Stop watching and leave the daemon serving (for the next instance to adopt)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self.pid:
            log.info("leaving the lazy-layer daemon (pid %d) serving the roots in use", self.pid)

    def stop(self) -> None:
        """End the daemon and its mount (the caller knows no lazy image is mounted)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._clear(self.pid or self._recorded_pid())

    def _clear(self, pid: int, hung: bool = False) -> None:
        """End daemon `pid` if it is ours (a hung one at once), and take its mount away (detached:
        a dead FUSE mount may still be under an image mount that a root holds)."""
        if pid and self.ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if hung else signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.ours(pid) and time.monotonic() < deadline:
                self._reap(pid, 0.02)
            if self.ours(pid):
                log.warning("the lazy-layer daemon (pid %d) ignored SIGTERM; killing it", pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._reap(pid)
        if self.mounted():
            with contextlib.suppress(OSError):
                mounts.linux.umount2(str(self.mountpoint), mounts.MNT_DETACH)
        self.pid = 0
        self._proc = None
        self.pidfile.unlink(missing_ok=True)

    def _reap(self, pid: int, wait: float = 5.0) -> None:
        """Collect our own child's exit (an adopted daemon is reaped by whoever adopted it)."""
        if self._proc is not None and self._proc.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=wait)
            return
        deadline = time.monotonic() + wait
        while self.ours(pid) and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- watching -----------------------------------------------------------------------

    async def probe(self) -> bool:
        """Does the mount answer? A stat in a thread: a hung daemon blocks the caller, not the loop."""
        try:
            await asyncio.wait_for(asyncio.to_thread(os.statvfs, self.mountpoint), PROBE_TIMEOUT_S)
            return True
        except (OSError, asyncio.TimeoutError):
            return False

    def _start_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._watching(self.pid))

    async def _watching(self, pid: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = -1
        exited = loop.create_future()
        if fd >= 0:
            loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            while fd >= 0 and not exited.done():
                await asyncio.wait([exited], timeout=PROBE_EVERY_S)
                if not exited.done() and not await self.probe():
                    reason = "lazy daemon hung"
                    break
            else:
                reason = "lazy daemon died"
        finally:
            if fd >= 0:
                loop.remove_reader(fd)
                os.close(fd)
        if self.pid != pid:
            return
        log.error("%s (pid %d)", reason, pid)
        self._watch = None
        # A hung daemon is killed: its readers get EIO instead of waiting for ever.
        await asyncio.to_thread(self._clear, pid, reason.endswith("hung"))
        if self.on_lost is not None:
            await self.on_lost(reason)


class LazyLayers:
    """What the image cache needs for lazy images: prepare one, make sure it can be read, find it."""

    def __init__(self, root: Path, images_dir: Path, js: JetStreamContext) -> None:
        self.daemon = LazyDaemon(root)
        self.images_dir = images_dir
        self.js = js

    def files(self, digest: str) -> LazyFiles:
        return LazyFiles.of(self.images_dir, digest)

    def source(self, digest: str) -> Path:
        """The FUSE file EROFS mounts."""
        return self.daemon.mountpoint / (digest.removeprefix("sha256:") + ".erofs")

    async def ready(self) -> None:
        await self.daemon.ensure()

    async def prepare(self, digest: str) -> None:
        index = await chunk_index(self.js, digest)
        if index.hashes:
            await asyncio.to_thread(self.files(digest).create, index)
        else:
            await self._whole(index)
        await self.ready()

    async def _whole(self, index: ChunkIndex) -> None:
        """An image the store has no chunk manifest for (stored before manifests existed): its
        chunks cannot be checked one by one, so it is fetched whole (the store checks it against
        its digest), served complete, and its manifest is made from it and put beside it, so the
        next node (or this one after eviction) reads it lazily."""
        log.warning("image %s has no chunk manifest in the store: fetching it whole once", index.digest)
        files = self.files(index.digest)
        store = LayerStore(None, await self.js.object_store(OBJECT_BUCKET), None)  # type: ignore[arg-type]
        await store.fetch_image(index.digest, files.data)
        manifest = await asyncio.to_thread(chunk_hashes, files.data, index.chunk_bytes)
        if index.chunk_bytes == CHUNK_BYTES:  # a manifest of other chunks is never used: not worth storing
            try:
                await write_manifest(store.images, index.digest, manifest)
            except Exception as exc:  # the image is good here either way; the next one tries again
                log.warning("could not store the chunk manifest of %s: %s", index.digest, exc)
        await asyncio.to_thread(files.create, msgspec.structs.replace(index, hashes=manifest), True)

"""The lazy-layer FUSE daemon: serves each lazily fetched image as a read-only file, chunk by chunk.

One per node, started and watched by the layer-cache (`daemon.py`), in a session of its own
so that a layer-cache restart does not end it: EROFS mounts on its files, and the roots over
them, outlive the layer-cache that made them. `<mount>/<hex>.erofs` is the image whose
`<hex>.lazy.json` index is in the cache directory (`lazy.py`). A read takes the chunks it
touches from the sparse file, fetching the missing ones from the store first (one JetStream
direct get of one message each, concurrent reads of a chunk share one fetch), checking each
against its sha256 from the image's chunk manifest, and recording them in the chunk map; a
miss also starts fetches of the next few chunks (readahead), which the read does not wait for.
A chunk the store cannot deliver, or delivers with the wrong hash, fails that read with EIO
(only the reader sees it; the next read tries again) and publishes a `layer.fetch_failed` event.
Images are immutable, so the kernel keeps their pages cached (stable attributes, `keep_cache`):
the daemon sees a range once, however many sandboxes read it. `<mount>/.stats` counts what
the daemon did (JSON).

Run as `python -m services.layer_cache.lazyfs <layer-cache dir>`; SANDFLEET_NATS_URL and
SANDFLEET_NODE_ID as for the services, SANDFLEET_LAZY_FETCH_TIMEOUT_S (default 5),
SANDFLEET_LAZY_READAHEAD (chunks fetched after a missed one, default 2; 0 turns it off).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import pyfuse3
import pyfuse3.asyncio

from sandfleet import jetstream, runner
from sandfleet.bus import Bus
from sandfleet.config import ServiceConfig
from schemas.layers import FetchFailed, fetch_failed_subject
from services.layer_cache import mounts
from services.layer_cache.lazy import INDEX, ChunkIndex, LazyFiles, chunk_length, chunks_of

log = logging.getLogger("sandfleet.lazyfs")

EVENT_EVERY_S = 1.0  # at most one event per image and reason this often: a failing read repeats
# After the store failed to answer, fail other fetches at once for this long: the kernel retries
# a failed read page by page, and each would wait out its own timeout.
FAIL_FAST_S = 2.0
UNREACHABLE = ("timeout", "no responders")
READAHEAD_INFLIGHT_MAX = 32  # readahead fetches at once, over all images: demand reads come first
ATTR_TIMEOUT_S = 3600  # an image's size never changes: its name is its content's hash
# Fixed times: FUSE drops a file's cached pages when its mtime changes, and an image never does.
IMAGE_TIME_NS = 0
STATS = ".stats"
STATS_INODE = pyfuse3.ROOT_INODE + 1
FSNAME = "sandfleet-lazy"
NICE = -5
STOP_GRACE_S = 5.0
UNMOUNT_CHECK_S = 2.0


@dataclass(frozen=True)
class LazySettings:
    """The daemon's settings, read once when it starts."""

    fetch_timeout_s: float = 5.0  # SANDFLEET_LAZY_FETCH_TIMEOUT_S
    readahead: int = 2  # SANDFLEET_LAZY_READAHEAD: chunks fetched after a missed one; 0 turns it off

    @classmethod
    def from_env(cls) -> LazySettings:
        env = os.environ
        return cls(fetch_timeout_s=float(env.get("SANDFLEET_LAZY_FETCH_TIMEOUT_S") or cls.fetch_timeout_s),
                   readahead=max(0, int(env.get("SANDFLEET_LAZY_READAHEAD") or cls.readahead)))


class ChunkUnavailable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class OpenImage:
    """One image while EROFS (or anyone) has it open."""

    files: LazyFiles
    index: ChunkIndex
    data_fd: int
    map_fd: int
    present: bytearray
    opens: int = 0
    inflight: dict[int, asyncio.Future[None]] = field(default_factory=dict)

    @classmethod
    def open(cls, files: LazyFiles) -> OpenImage:
        index = files.read_index()
        data_fd = os.open(files.data, os.O_RDWR | os.O_CLOEXEC)
        map_fd = os.open(files.map, os.O_RDWR | os.O_CLOEXEC)
        present = bytearray(os.pread(map_fd, len(index.seqs), 0).ljust(len(index.seqs), b"\0"))
        return cls(files, index, data_fd, map_fd, present)

    def close(self) -> None:
        os.close(self.data_fd)
        os.close(self.map_fd)


@dataclass
class Stats:
    """What the daemon did since it started: reads that reached it, chunks it fetched."""

    reads: int = 0  # read calls on images (the kernel's page cache answers the rest)
    read_bytes: int = 0
    fetched: int = 0  # chunks fetched from the store, readahead included
    readahead: int = 0  # of those, started by readahead
    bad_hash: int = 0  # chunks the store delivered that did not match the manifest
    failed: int = 0  # reads failed with EIO

    def json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode() + b"\n"


class ChunkSource:
    """Chunks straight from the store's stream: a direct get by sequence, checked for subject and length."""

    def __init__(self, bus: Bus, fetch_timeout_s: float) -> None:
        self.bus = bus
        self.fetch_timeout_s = fetch_timeout_s
        self._down: tuple[float, str] = (0.0, "")  # until when, and why, the store is taken as unreachable

    async def get(self, index: ChunkIndex, i: int, ahead: bool = False) -> bytes:
        """Chunk i from the store. A timeout marks the store down for FAIL_FAST_S (so reads fail
        fast, not each after its own timeout), unless it was a readahead's (`ahead`): many run at
        once, and one slow one must not fail the demand reads."""
        want = chunk_length(i, index.size, index.chunk_bytes)
        until, why = self._down
        if time.monotonic() < until:
            raise ChunkUnavailable(why)
        try:
            msg = await self.bus.nc.request(jetstream.direct_get_subject(index.stream),
                                            json.dumps({"seq": index.seqs[i]}).encode(), timeout=self.fetch_timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            why = UNREACHABLE[0] if isinstance(exc, nats.errors.TimeoutError) else UNREACHABLE[1]
            if not ahead:
                self._down = (time.monotonic() + FAIL_FAST_S, why)
            raise ChunkUnavailable(why) from None
        except nats.errors.Error as exc:
            raise ChunkUnavailable(f"bus: {type(exc).__name__}") from None
        headers = msg.headers or {}
        if headers.get("Status"):
            raise ChunkUnavailable("not found" if headers["Status"] == "404" else f"status {headers['Status']}")
        if headers.get("Nats-Subject") != index.subject:
            raise ChunkUnavailable("chunk gone from the store")
        if len(msg.data) != want:
            raise ChunkUnavailable(f"short chunk ({len(msg.data)} of {want} bytes)")
        return msg.data


class LazyImages(pyfuse3.Operations):
    """The FUSE file system: a flat directory of `<hex>.erofs` files."""

    def __init__(self, root: Path, source: ChunkSource, node_id: str, readahead: int) -> None:
        super().__init__()
        self.readahead = readahead
        self.root = root
        self.images_dir = root / "images"
        self.source = source
        self.node_id = node_id
        self.inodes: dict[str, int] = {}  # hex → inode
        self.names: dict[int, str] = {}
        self.open_images: dict[int, OpenImage] = {}
        self.sizes: dict[str, int] = {}  # hex → image size, read once from its index
        self.stats = Stats()
        self._ahead = 0  # readahead fetches running
        self._last_event: dict[tuple[str, str], float] = {}

    # -- names --------------------------------------------------------------------------

    def _inode(self, hex_: str) -> int:
        if hex_ not in self.inodes:
            ino = STATS_INODE + 1 + len(self.inodes)
            self.inodes[hex_], self.names[ino] = ino, hex_
        return self.inodes[hex_]

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = ino
        attrs.entry_timeout = attrs.attr_timeout = ATTR_TIMEOUT_S
        attrs.st_uid = attrs.st_gid = 0
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = IMAGE_TIME_NS
        if ino == pyfuse3.ROOT_INODE:
            attrs.st_mode, attrs.st_nlink, attrs.st_size = stat.S_IFDIR | 0o555, 2, 0
            return attrs
        if ino == STATS_INODE:
            attrs.entry_timeout = attrs.attr_timeout = 0
            attrs.st_mode, attrs.st_nlink, attrs.st_size = stat.S_IFREG | 0o444, 1, 0
            return attrs
        hex_ = self.names[ino]
        files = LazyFiles(self.images_dir, hex_)
        try:
            size = self.sizes.get(hex_) if files.index.exists() else None
            if size is None:
                size = self.sizes[hex_] = files.read_index().size
        except (FileNotFoundError, ValueError):
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        attrs.st_mode, attrs.st_nlink, attrs.st_size = stat.S_IFREG | 0o444, 1, size
        attrs.st_blksize, attrs.st_blocks = 4096, -(-size // 512)
        return attrs

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        text = name.decode(errors="replace")
        if parent_inode == pyfuse3.ROOT_INODE and text == STATS:
            return self._attrs(STATS_INODE)
        hex_ = text.removesuffix(".erofs")
        if parent_inode != pyfuse3.ROOT_INODE or not text.endswith(".erofs") or not (self.images_dir / (hex_ + INDEX)).exists():
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self._inode(hex_))

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode not in (pyfuse3.ROOT_INODE, STATS_INODE) and inode not in self.names:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        hexes = sorted(p.name.removesuffix(INDEX) for p in self.images_dir.glob("*" + INDEX))
        for n, hex_ in enumerate(hexes[start_id:], start=start_id + 1):
            try:
                attrs = self._attrs(self._inode(hex_))
            except pyfuse3.FUSEError:
                continue
            if not pyfuse3.readdir_reply(token, f"{hex_}.erofs".encode(), attrs, n):
                break

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_namemax = 255
        return data

    # -- files --------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode == STATS_INODE:  # always read fresh
            return pyfuse3.FileInfo(fh=STATS_INODE, direct_io=True, keep_cache=False)
        if inode not in self.names:
            raise pyfuse3.FUSEError(errno.ENOENT)
        image = self.open_images.get(inode)
        if image is None:
            try:
                image = self.open_images[inode] = OpenImage.open(LazyFiles(self.images_dir, self.names[inode]))
            except (FileNotFoundError, ValueError):
                raise pyfuse3.FUSEError(errno.ENOENT) from None
        image.opens += 1
        # Through the page cache, kept across opens: the image never changes.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    async def release(self, fh: int) -> None:
        image = self.open_images.get(fh)
        if image is not None:
            image.opens -= 1
            self._close_if_idle(fh, image)

    def _close_if_idle(self, ino: int, image: OpenImage) -> None:
        """Close an image nobody has open once its last fetch is written (not before: it writes)."""
        if image.opens <= 0 and not image.inflight and self.open_images.get(ino) is image:
            del self.open_images[ino]
            image.close()

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh == STATS_INODE:
            return self.stats.json()[off:off + size]
        image = self.open_images.get(fh)
        if image is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        self.stats.reads += 1
        self.stats.read_bytes += size
        index = image.index
        wanted = chunks_of(off, size, index.size, index.chunk_bytes)
        missing = [i for i in wanted if not image.present[i]]
        if missing:
            pending = [self._start(image, i) for i in missing]  # demand first,
            self._read_ahead(image, wanted[-1] + 1)  # then the neighbours, which this read does not wait for
            results = await asyncio.gather(*(asyncio.shield(p) for p in pending), return_exceptions=True)
            failed = [(i, r) for i, r in zip(missing, results) if isinstance(r, BaseException)]
            if failed:
                i, exc = failed[0]
                reason = exc.reason if isinstance(exc, ChunkUnavailable) else f"{type(exc).__name__}: {exc}"
                self.stats.failed += 1
                await self._report(index, i, reason)
                raise pyfuse3.FUSEError(errno.EIO)
        return os.pread(image.data_fd, max(0, min(size, index.size - off)), off)

    def _start(self, image: OpenImage, i: int, ahead: bool = False) -> asyncio.Future[None]:
        """The fetch of chunk i, started now unless one is under way."""
        pending = image.inflight.get(i)
        if pending is None:
            pending = image.inflight[i] = asyncio.ensure_future(self._fetch(image, i, ahead))
            if ahead:
                self._ahead += 1
                self.stats.readahead += 1

            def done(fut: asyncio.Future[None]) -> None:
                if ahead:
                    self._ahead -= 1
                if not fut.cancelled() and fut.exception() is not None and ahead:
                    log.debug("readahead of chunk %d of %s failed: %s", i, image.index.digest, fut.exception())
                image.inflight.pop(i, None)
                self._close_if_idle(self.inodes.get(image.files.hex, 0), image)

            pending.add_done_callback(done)
        return pending

    def _read_ahead(self, image: OpenImage, first: int) -> None:
        """Start fetching chunks first.. (`readahead` of them) that are neither here nor coming.
        A failure is only logged: the read that needs such a chunk fetches it again and reports."""
        for i in range(first, min(first + self.readahead, len(image.present))):
            if self._ahead >= READAHEAD_INFLIGHT_MAX:
                return
            if not image.present[i] and i not in image.inflight:
                self._start(image, i, ahead=True)

    async def _fetch(self, image: OpenImage, i: int, ahead: bool = False) -> None:
        index = image.index
        if not index.hashes:  # never serve a chunk nothing can vouch for
            raise ChunkUnavailable("no chunk manifest")
        data = await self.source.get(index, i, ahead)
        self.stats.fetched += 1
        if hashlib.sha256(data).digest() != index.hash_of(i):
            self.stats.bad_hash += 1
            raise ChunkUnavailable("chunk hash mismatch")
        os.pwrite(image.data_fd, data, i * image.index.chunk_bytes)
        os.pwrite(image.map_fd, b"\1", i)  # after the data: a map entry never claims bytes that are not there
        image.present[i] = 1

    async def _report(self, index: ChunkIndex, chunk: int, reason: str) -> None:
        key = (index.digest, reason)
        now = time.monotonic()
        if now - self._last_event.get(key, 0.0) < EVENT_EVERY_S:
            return
        self._last_event[key] = now
        log.warning("chunk %d of %s unavailable: %s", chunk, index.digest, reason)
        event = FetchFailed(node=self.node_id, digest=index.digest, chunk=chunk, reason=reason,
                            sandboxes=roots_over(self.root, index.digest), at=time.time())
        try:
            await self.source.bus.publish(fetch_failed_subject(self.node_id), event)
        except nats.errors.Error as exc:
            log.warning("could not publish the fetch failure: %s", exc)


def _terminate() -> None:
    """Stop serving; if the session does not end (its mount is gone, say), exit anyway."""
    pyfuse3.terminate()
    asyncio.get_running_loop().call_later(STOP_GRACE_S, os._exit, 0)


async def _exit_when_unmounted(mountpoint: Path) -> None:
    """Someone else took the mount away (an operator, a test's cleanup): then nobody can
    reach this daemon any more, and pyfuse3 does not always notice. Leave."""
    while True:
        await asyncio.sleep(UNMOUNT_CHECK_S)
        if not any(e.mount_point == str(mountpoint) and e.source == FSNAME for e in mounts.read_mountinfo()):
            log.warning("the mount at %s is gone; exiting", mountpoint)
            os._exit(0)


def roots_over(root: Path, digest: str) -> list[str]:
    """Sandboxes whose root (an overlay under `<root>/sandboxes`) has this image as a lower layer."""
    layer = str(root / "mnt" / digest.removeprefix("sha256:"))
    prefix = str(root / "sandboxes") + "/"
    found = set()
    for e in mounts.read_mountinfo():
        if e.fstype == "overlay" and e.mount_point.startswith(prefix) and layer in e.options.get("lowerdir", "").split(":"):
            found.add(e.mount_point[len(prefix):].split("/")[0])
    return sorted(found)


async def serve(root: Path, config: ServiceConfig, settings: LazySettings) -> None:
    mountpoint = root / "lazy"
    mountpoint.mkdir(parents=True, exist_ok=True)
    bus = await Bus.connect(config.nats_url, "layer-cache-lazyfs")
    try:
        pyfuse3.asyncio.enable()
        fs = LazyImages(root, ChunkSource(bus, settings.fetch_timeout_s), config.node_id, settings.readahead)
        options = {f"fsname={FSNAME}", "subtype=sandfleet", "ro", "allow_other"}
        pyfuse3.init(fs, str(mountpoint), options)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _terminate)
        watch = asyncio.ensure_future(_exit_when_unmounted(mountpoint))
        log.info("serving lazy images of %s at %s", root, mountpoint)
        try:
            await pyfuse3.main(min_tasks=4, max_tasks=64)
        finally:
            watch.cancel()
            pyfuse3.close(unmount=True)
    finally:
        await bus.close()


def main() -> None:
    runner.setup_logging("layer-cache-lazyfs")
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m services.layer_cache.lazyfs <layer-cache dir>")
    try:  # every sandbox's first read of a lazy layer waits on this process: it goes before them
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
    except OSError as exc:
        log.warning("could not raise the daemon's priority: %s", exc)
    asyncio.run(serve(Path(sys.argv[1]), ServiceConfig.from_env(), LazySettings.from_env()))


if __name__ == "__main__":
    main()

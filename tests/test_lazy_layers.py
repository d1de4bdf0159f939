"""Lazy layers on the real kernel: a FUSE file per image, EROFS mounted on it, chunks from a real store.

The module starts its own nats-server and layer-cache (`--fetch lazy`, the default), builds
layers from busybox-static and a multi-MB blob, empties the node's cache so the layers must
come from the store, and reads through composed roots with chroot, the way a sandbox does.
The store going away is a stopped nats-server (SIGSTOP: nothing answers, nothing is lost).
What the FUSE daemon did is read from its `<mount>/.stats` counters and the chunk maps.
Its layer-cache composes in the host's own mount table (SANDFLEET_ROOTS_NS=host), so roots
are read by their paths; the node's roots namespace is tests/test_flat_mounts.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from sandfleet import errors
from sandfleet.bus import Bus
from sandfleet.layers_client import Layers, connect
from sandfleet.config import free_port
from sandfleet.supervisor import nats_server_binary
from schemas.layers import CHUNK_BYTES, OBJECT_BUCKET, FetchFailed, fetch_failed_subject
from services.layer_cache import mounts
from services.layer_cache.store import HASH_BYTES, manifest_name, read_manifest, write_manifest
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base
from tests.leaks import lazy_daemons

ROOT = Path(__file__).resolve().parent.parent
NODE = "lazy-test"
BLOB_MB = 24
FETCH_TIMEOUT_S = 2
READAHEAD = 2  # chunks the daemon fetches after a missed one (set for the service below)


def _kernel_ready() -> bool:
    with open("/proc/filesystems") as f:
        found = f.read()
    return all(fs in found for fs in ("erofs", "overlay", "fuse")) and shutil.which("mkfs.erofs") is not None


@dataclass
class Service:
    url: str
    data_dir: Path
    log: Path
    fetch: str = "lazy"
    proc: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.data_dir / "layer-cache"

    def start(self) -> None:
        self.env = {
            **os.environ, "SANDFLEET_NATS_URL": self.url, "SANDFLEET_DATA_DIR": str(self.data_dir),
            "SANDFLEET_NODE_ID": NODE, "SANDFLEET_ROOTS_NS": "host", "SANDFLEET_LAYER_FETCH": self.fetch, "PYTHONPATH": str(ROOT),
            "SANDFLEET_LAZY_FETCH_TIMEOUT_S": str(FETCH_TIMEOUT_S), "SANDFLEET_LAZY_READAHEAD": str(READAHEAD),
        }
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.layer_cache"], env=self.env, cwd=ROOT,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=30)
        self.proc = None
        return code

    def daemon_pid(self) -> int:
        try:
            return int((self.root / "lazyfs.pid").read_text())
        except (OSError, ValueError):
            return 0


async def _until_serving(layers: Layers, service: Service) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await layers.cache(NODE)
            return
        except (errors.NoResponders, errors.Timeout):
            if time.monotonic() > deadline or (service.proc and service.proc.poll() is not None):
                raise RuntimeError(f"layer-cache did not start:\n{service.log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)


async def _restart(layers: Layers, service: Service, sig: int = signal.SIGTERM, fetch: str | None = None) -> None:
    service.stop(sig)
    if fetch:
        service.fetch = fetch
    service.start()
    await _until_serving(layers, service)


@pytest.fixture(scope="module")
def kernel():
    require(os.geteuid() == 0, "mounting needs root")
    require(_kernel_ready(), "EROFS, overlayfs, FUSE and mkfs.erofs")
    require(os.path.exists("/dev/fuse"), "/dev/fuse")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")


@pytest.fixture(scope="module")
def nats_server(kernel, tmp_path_factory):
    base = tmp_path_factory.mktemp("lazy")
    port = free_port()
    proc = subprocess.Popen(
        [nats_server_binary(), "-js", "-sd", str(base / "js"), "-p", str(port), "-a", "127.0.0.1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    yield proc, f"nats://127.0.0.1:{port}", base
    proc.send_signal(signal.SIGCONT)  # should a test have stopped it
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def service(nats_server):
    _, url, base = nats_server
    svc = Service(url=url, data_dir=base / "data", log=base / "layer-cache.log")
    svc.start()
    yield svc
    if svc.proc is not None:
        svc.stop()
    left_mounts = [f"{e.fstype} {e.source} on {e.mount_point}" for e in mounts.read_mountinfo()
                   if str(base) in e.mount_point or str(base) in e.source]
    left_daemons = [d for d in lazy_daemons() if str(base) in d]
    mounts.unmount_tree(svc.root)  # what a failed test left must not outlive the module
    assert not left_mounts, f"the lazy layer tests left mounts behind: {left_mounts}"
    assert not left_daemons, f"the lazy layer tests left FUSE daemons behind: {left_daemons}"


@pytest.fixture(scope="module")
async def layers(service):
    client = await connect(service.url)
    await _until_serving(client, service)
    yield client
    await client.bus.close()


@pytest.fixture(scope="module")
async def built(layers, tmp_path_factory):
    """`big` (a 24 MiB blob and a small file), gone from the node's cache so it has to come
    from the store, and `base` (busybox), built afterwards, so cached whole."""
    src = tmp_path_factory.mktemp("src")
    make_busybox_base(src / "base")
    big = src / "big"
    (big / "data").mkdir(parents=True)
    (big / "data" / "blob").write_bytes(os.urandom(BLOB_MB << 20))  # incompressible
    (big / "data" / "small.txt").write_text("just this\n")
    await layers.build_dir("big", big)
    await layers.build_dir("big2", big, tags=["other"])  # the same image under another name is still one image
    dropped = await layers.cache_drop(NODE)
    assert len(dropped.dropped) == 1 and not dropped.kept
    assert (await layers.cache(NODE)).images == []
    await layers.build_dir("base", src / "base")
    return {"base": (await layers.get("base")).digest, "big": (await layers.get("big")).digest,
            "blob": hashlib.sha256((big / "data" / "blob").read_bytes()).hexdigest()}


@pytest.fixture(scope="module")
async def lazy_root(layers, built, service):
    """sb-lazy, a root over `big` fetched lazily, held while the module's tests run (its FUSE
    daemon lives as long as a lazy root is mounted); the test that kills the daemon releases it."""
    rootfs = await layers.compose(NODE, "sb-lazy", ["base", "big"])
    yield rootfs
    if service.proc is not None:
        await layers.release(NODE, "sb-lazy")


class Events:
    """`layer.fetch_failed` events of the test node, on a connection of the test's own."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def __aenter__(self) -> Events:
        self.bus = await Bus.connect(self.url, "lazy-test-events")
        self.sub = await self.bus.nc.subscribe(fetch_failed_subject(NODE))
        await self.bus.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.unsubscribe()  # so closing does not wait for events nobody reads
        await self.bus.close()

    async def next_for(self, digest: str, timeout: float = 15) -> FetchFailed:
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            event = msgspec.json.decode(msg.data, type=FetchFailed)
            if event.digest == digest:
                return event


def _image(listing, digest):
    return next(i for i in listing.images if i.digest == digest)


def _chroot(rootfs: str, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["chroot", rootfs, "/bin/sh", "-c", script], capture_output=True, text=True, timeout=timeout)


def _daemon_stats(service: Service) -> dict:
    return json.loads((service.root / "lazy" / ".stats").read_bytes())


def _chunk_map(service: Service, digest: str) -> bytes:
    return (service.root / "images" / (digest.removeprefix("sha256:") + ".lazy.map")).read_bytes()


@contextlib.asynccontextmanager
async def _objects(url: str):
    """The store's image bucket, on a connection of the test's own."""
    bus = await Bus.connect(url, "lazy-test-store")
    try:
        yield await bus.js.object_store(OBJECT_BUCKET)
    finally:
        await bus.close()


async def _chunk_holding(url: str, digest: str, data: bytes) -> int:
    """The chunk of the image (as the store has it) where `data` (random, so stored as is) starts."""
    async with _objects(url) as objects:
        image = (await objects.get(digest)).data
    at = image.find(data)
    assert at >= 0, "random file data is stored uncompressed in the image"
    return at // CHUNK_BYTES


def _erofs_source(service: Service, digest: str) -> str:
    point = str(service.root / "mnt" / digest.removeprefix("sha256:"))
    return next(e.source for e in mounts.read_mountinfo() if e.mount_point == point and e.fstype == "erofs")


# -- reading --------------------------------------------------------------------------


async def test_a_lazy_layer_fetches_only_what_is_read(layers, service, built, lazy_root):
    rootfs = lazy_root
    assert _erofs_source(service, built["big"]) == str(service.root / "lazy" / (built["big"][7:] + ".erofs"))
    out = _chroot(rootfs.path, "cat /data/small.txt")
    assert out.returncode == 0 and out.stdout == "just this\n", out.stderr

    listing = await layers.cache(NODE)
    big = _image(listing, built["big"])
    assert listing.fetch == "lazy" and big.lazy and not big.complete and big.mounted and big.users == 1
    assert big.size > BLOB_MB << 20
    # The superblock, a directory and one small file: a few chunks read, each miss bringing at
    # most READAHEAD more with it (the only lazy image read so far, so the daemon's counters are its).
    stats = _daemon_stats(service)
    demand = stats["fetched"] - stats["readahead"]
    assert 0 < demand <= 4 and stats["readahead"] <= demand * READAHEAD
    assert 0 < big.fetched_bytes <= stats["fetched"] * CHUNK_BYTES <= big.size // 10
    assert big.written_bytes == big.fetched_bytes and big.disk_bytes < big.size // 10
    base = _image(listing, built["base"])
    assert not base.lazy and base.complete  # built on this node, so whole

    out = _chroot(rootfs.path, "sha256sum /data/blob")  # now everything
    assert out.returncode == 0 and out.stdout.split()[0] == built["blob"], out.stderr
    big = _image(await layers.cache(NODE), built["big"])
    assert big.complete and big.fetched_bytes == big.size


async def test_a_repeated_read_is_served_by_the_page_cache_not_the_daemon(layers, service, built, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "blob").write_bytes(os.urandom(4 << 20))
    digest = (await layers.build_dir("again", tmp_path)).layer.digest
    await layers.cache_drop(NODE)
    rootfs = await layers.compose(NODE, "sb-again", ["base", "again"])
    read = "dd if=/data/blob of=/copy bs=64k 2>/copy.err && echo read"
    before = _daemon_stats(service)
    assert _chroot(rootfs.path, read).stdout == "read\n"
    first = _daemon_stats(service)
    assert first["reads"] > before["reads"] and first["fetched"] > before["fetched"] + 16  # from the store

    # Drop EROFS's own cached pages of the file: reading it again has to read the image file
    # again, and the kernel answers that from the FUSE file's page cache.
    fd = os.open(service.root / "mnt" / digest.removeprefix("sha256:") / "data" / "blob", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert _chroot(rootfs.path, read).stdout == "read\n"
    other = await layers.compose(NODE, "sb-again-2", ["base", "again"])  # and another sandbox over it
    assert _chroot(other.path, read).stdout == "read\n"
    again = _daemon_stats(service)
    assert (again["reads"], again["fetched"]) == (first["reads"], first["fetched"])
    assert await layers.release(NODE, "sb-again")
    assert await layers.release(NODE, "sb-again-2")


async def test_a_missed_chunk_brings_the_next_chunks_with_it(layers, service, built, tmp_path):
    blob = os.urandom(4 << 20)
    (tmp_path / "f").write_bytes(blob)
    digest = (await layers.build_dir("ahead", tmp_path)).layer.digest
    middle = 2 << 20
    chunk = await _chunk_holding(service.url, digest, blob[middle:middle + 4096])
    await layers.cache_drop(NODE)
    rootfs = await layers.compose(NODE, "sb-ahead", ["base", "ahead"])
    before = _daemon_stats(service)
    out = _chroot(rootfs.path, f"dd if=/f of=/copy bs=4096 skip={middle // 4096} count=1 2>/copy.err && echo read")
    assert out.stdout == "read\n", out.stderr
    deadline = time.monotonic() + 15  # readahead is not waited for by the read
    while not all(_chunk_map(service, digest)[chunk:chunk + 1 + READAHEAD]) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    present = _chunk_map(service, digest)
    assert all(present[chunk:chunk + 1 + READAHEAD])  # the chunk read and the READAHEAD after it
    assert not any(present[chunk + 1 + READAHEAD:chunk + 8])  # and not further
    assert _daemon_stats(service)["readahead"] - before["readahead"] >= READAHEAD
    assert await layers.release(NODE, "sb-ahead")


async def test_fetched_chunks_and_the_daemon_survive_a_layer_cache_restart(layers, service, built, lazy_root,
                                                                           tmp_path):
    # A fresh image (its name differs, its content too) so the chunks read now are all there is.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "blob").write_bytes(os.urandom(8 << 20))
    (tmp_path / "data" / "note").write_text("kept\n")
    digest = (await layers.build_dir("fresh", tmp_path)).layer.digest
    await layers.cache_drop(NODE)  # `fresh` goes; what sb-lazy uses stays
    rootfs = await layers.compose(NODE, "sb-restart", ["base", "fresh"])
    assert _chroot(rootfs.path, "cat /data/note").stdout == "kept\n"
    before = _image(await layers.cache(NODE), digest)
    daemon = service.daemon_pid()
    assert daemon

    await _restart(layers, service, signal.SIGKILL)  # a crash
    assert service.daemon_pid() == daemon  # adopted, not replaced
    assert _chroot(rootfs.path, "cat /data/note").stdout == "kept\n"
    await _restart(layers, service, signal.SIGTERM)  # a clean stop with lazy roots in use keeps the daemon too
    assert service.daemon_pid() == daemon
    after = _image(await layers.cache(NODE), digest)
    assert after.lazy and after.fetched_bytes == before.fetched_bytes < after.size // 4  # kept on disk, not refetched
    out = _chroot(rootfs.path, "dd if=/data/blob of=/copy bs=1M count=2 2>/copy.err && echo read")
    assert out.stdout == "read\n", out.stderr
    assert await layers.release(NODE, "sb-restart")
    assert {r.sandbox_id for r in (await layers.cache(NODE)).rootfs} == {"sb-lazy"}


# -- failure --------------------------------------------------------------------------


async def test_a_store_that_does_not_answer_fails_reads_in_that_sandbox_only(layers, service, built, lazy_root,
                                                                              nats_server, tmp_path):
    nats, url, _ = nats_server  # lazy_root holds `base`, so the cache drop below keeps it whole
    (tmp_path / "files").mkdir()
    for i in range(3):
        (tmp_path / "files" / f"f{i}").write_bytes(os.urandom(1 << 20))
    digest = (await layers.build_dir("cold", tmp_path)).layer.digest
    await layers.cache_drop(NODE)
    cold = await layers.compose(NODE, "sb-cold", ["base", "cold"])  # nothing of its files read yet
    warm = await layers.compose(NODE, "sb-warm", ["base"])  # a whole image on the node
    pids = (service.proc.pid, service.daemon_pid())
    async with Events(url) as events:
        nats.send_signal(signal.SIGSTOP)
        try:
            failed = await asyncio.to_thread(_chroot, cold.path, "cat /files/f1 > /copy")
            working = await asyncio.to_thread(_chroot, warm.path, "cat /etc/hostname; ls /bin | head -1")
        finally:
            nats.send_signal(signal.SIGCONT)
        assert failed.returncode != 0 and "Input/output error" in failed.stderr
        assert working.returncode == 0 and working.stdout.startswith("base\n"), working.stderr
        event = await events.next_for(digest)
        assert event.node == NODE and event.reason == "timeout" and event.sandboxes == ["sb-cold"] and event.chunk >= 0

    # The node kept serving: same processes, it answers, and the same read works again (once the
    # daemon's fail-fast window after the outage has passed).
    assert (service.proc.pid, service.daemon_pid()) == pids and service.proc.poll() is None
    assert os.path.exists(f"/proc/{pids[1]}")
    assert {r.sandbox_id for r in (await layers.cache(NODE)).rootfs} >= {"sb-cold", "sb-warm"}
    deadline = time.monotonic() + 15
    while (again := _chroot(cold.path, "cat /files/f1 > /copy")).returncode != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert again.returncode == 0 and (Path(cold.upper) / "copy").stat().st_size == 1 << 20, again.stderr
    assert await layers.release(NODE, "sb-warm")
    assert await layers.release(NODE, "sb-cold")


async def _failed_read_event(service, rootfs, digest, first=None):  # type: ignore[no-untyped-def]
    """Copy /f out of the sandbox's lazy image (after `first()`, if given, with the events already
    watched): the read fails with EIO in the sandbox; returns the event published for it."""
    async with Events(service.url) as events:
        if first is not None:
            await first()
        out = _chroot(rootfs.path, "cat /f > /copy")
        assert out.returncode != 0 and "Input/output error" in out.stderr
        return await events.next_for(digest)


async def test_an_image_deleted_from_the_store_fails_unread_chunks_with_an_event(layers, service, built, tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(2 << 20))
    (tmp_path / "g").write_text("read before\n")
    digest = (await layers.build_dir("doomed", tmp_path)).layer.digest
    await layers.cache_drop(NODE)
    rootfs = await layers.compose(NODE, "sb-doomed", ["base", "doomed"])
    assert _chroot(rootfs.path, "cat /g").stdout == "read before\n"

    async def delete() -> None:
        assert (await layers.remove("doomed")).deleted_images == [digest]

    event = await _failed_read_event(service, rootfs, digest, first=delete)
    assert event.reason == "not found" and event.sandboxes == ["sb-doomed"]
    assert _chroot(rootfs.path, "cat /g").stdout == "read before\n"  # what was fetched stays readable
    assert await layers.release(NODE, "sb-doomed")


async def test_a_chunk_that_does_not_match_its_manifest_fails_the_read_with_an_event(layers, service, built, tmp_path):
    blob = os.urandom(2 << 20)
    (tmp_path / "f").write_bytes(blob)
    (tmp_path / "g").write_text("fine\n")
    digest = (await layers.build_dir("tampered", tmp_path)).layer.digest
    bad = await _chunk_holding(service.url, digest, blob[1 << 20:(1 << 20) + 4096])  # in the middle of f
    async with _objects(service.url) as objects:  # the store's manifest no longer fits that chunk
        manifest = bytearray(await read_manifest(objects, digest))
        assert len(manifest) % HASH_BYTES == 0 and len(manifest) // HASH_BYTES > bad
        manifest[bad * HASH_BYTES] ^= 0xFF
        await write_manifest(objects, digest, bytes(manifest))
    await layers.cache_drop(NODE)
    rootfs = await layers.compose(NODE, "sb-tampered", ["base", "tampered"])
    other = await layers.compose(NODE, "sb-untouched", ["base"])
    bad_before = _daemon_stats(service)["bad_hash"]
    event = await _failed_read_event(service, rootfs, digest)
    assert event.reason == "chunk hash mismatch" and event.chunk == bad and event.sandboxes == ["sb-tampered"]
    assert _daemon_stats(service)["bad_hash"] > bad_before
    assert not _chunk_map(service, digest)[bad]  # the bad bytes were never kept
    assert _chroot(rootfs.path, "cat /g").stdout == "fine\n"  # the rest of the image reads
    good = _chroot(rootfs.path, "dd if=/f of=/head bs=64k count=4 2>/head.err && echo read")
    assert good.stdout == "read\n" and (Path(rootfs.upper) / "head").read_bytes() == blob[:256 << 10]
    assert _chroot(other.path, "cat /etc/hostname").stdout == "base\n"  # other sandboxes are untouched
    assert await layers.release(NODE, "sb-tampered")
    assert await layers.release(NODE, "sb-untouched")


async def test_an_image_stored_without_a_manifest_is_fetched_whole_once_and_gets_one(layers, service, built, tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(1 << 20))
    (tmp_path / "note").write_text("old\n")
    digest = (await layers.build_dir("legacy", tmp_path)).layer.digest
    async with _objects(service.url) as objects:  # as if stored before manifests existed
        await objects.delete(manifest_name(digest))
        assert await read_manifest(objects, digest) is None
    await layers.cache_drop(NODE)
    rootfs = await layers.compose(NODE, "sb-legacy", ["base", "legacy"])
    legacy = _image(await layers.cache(NODE), digest)
    assert legacy.lazy and legacy.complete and legacy.fetched_bytes == legacy.size  # whole, checked by its digest
    assert _chroot(rootfs.path, "cat /note").stdout == "old\n"
    async with _objects(service.url) as objects:
        image = (await objects.get(digest)).data
        manifest = await read_manifest(objects, digest)
    assert manifest == b"".join(hashlib.sha256(image[i:i + CHUNK_BYTES]).digest()
                                for i in range(0, len(image), CHUNK_BYTES))  # now there for the next reader
    assert await layers.release(NODE, "sb-legacy")


async def test_a_dead_daemon_marks_its_roots_broken_and_a_new_one_serves_new_roots(layers, service, built, lazy_root):
    async with Events(service.url) as events:
        old = service.daemon_pid()
        os.kill(old, signal.SIGKILL)
        event = await events.next_for(built["big"])
        assert event.reason == "lazy daemon died" and event.sandboxes == ["sb-lazy"] and event.chunk == -1
    listing = await layers.cache(NODE)
    assert next(r for r in listing.rootfs if r.sandbox_id == "sb-lazy").broken == "lazy daemon died"
    assert not any(d for d in lazy_daemons() if f" {old}:" in f" {d}")

    fresh = await layers.compose(NODE, "sb-after", ["base", "big"])  # mounted again, over a new daemon
    assert service.daemon_pid() not in (0, old)
    out = _chroot(fresh.path, "cat /data/small.txt")
    assert out.returncode == 0 and out.stdout == "just this\n", out.stderr
    assert not next(r for r in (await layers.cache(NODE)).rootfs if r.sandbox_id == "sb-after").broken

    await _restart(layers, service, signal.SIGKILL)  # the mark outlives a restart
    listing = await layers.cache(NODE)
    assert {r.sandbox_id: r.broken for r in listing.rootfs} == {"sb-lazy": "lazy daemon died", "sb-after": ""}
    assert await layers.release(NODE, "sb-lazy")
    assert await layers.release(NODE, "sb-after")


async def test_a_hung_daemon_is_killed_so_readers_get_eio_instead_of_waiting(layers, service, built):
    rootfs = await layers.compose(NODE, "sb-hung", ["base", "big"])
    daemon = service.daemon_pid()
    async with Events(service.url) as events:
        os.kill(daemon, signal.SIGSTOP)  # alive, but answers nothing
        try:
            out = await asyncio.to_thread(_chroot, rootfs.path, "cat /data/blob > /copy", 120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon, signal.SIGCONT)
        assert out.returncode != 0 and ("Input/output error" in out.stderr or "not connected" in out.stderr), out.stderr
        event = await events.next_for(built["big"])
        assert event.reason == "lazy daemon hung" and "sb-hung" in event.sandboxes
    assert not os.path.exists(f"/proc/{daemon}/cmdline") or not open(f"/proc/{daemon}/cmdline").read()
    listing = await layers.cache(NODE)
    assert next(r for r in listing.rootfs if r.sandbox_id == "sb-hung").broken == "lazy daemon hung"
    assert await layers.release(NODE, "sb-hung")


# -- full fetch, the command line, and nothing left -----------------------------------


async def test_full_fetch_mode_takes_whole_images_and_counts_their_bytes(layers, service, built):
    await _restart(layers, service, fetch="full")
    try:
        await layers.cache_drop(NODE)
        rootfs = await layers.compose(NODE, "sb-full", ["base", "big"])
        listing = await layers.cache(NODE)
        big = _image(listing, built["big"])
        assert listing.fetch == "full" and not big.lazy and big.complete
        assert big.fetched_bytes == big.written_bytes == big.size
        assert _erofs_source(service, built["big"]) == str(service.root / "images" / (built["big"][7:] + ".erofs"))
        assert _chroot(rootfs.path, "sha256sum /data/blob").stdout.split()[0] == built["blob"]
        assert await layers.release(NODE, "sb-full")
    finally:
        await _restart(layers, service, fetch="lazy")


async def test_command_line_shows_fetched_bytes_and_drops_the_cache(layers, service, built):
    await layers.cache_drop(NODE)
    rootfs = await layers.compose(NODE, "sb-cli", ["base", "big"])
    _chroot(rootfs.path, "cat /data/small.txt")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sandfleet.cli", "layer", "cache", *args, "--nats", service.url,
                               "--node", NODE], env=service.env, cwd=ROOT, capture_output=True, text=True, timeout=60)

    out = cli()
    assert out.returncode == 0, out.stderr
    assert "(fetch lazy)" in out.stdout and "FETCHED" in out.stdout and "WRITTEN" in out.stdout
    big_row = next(line for line in out.stdout.splitlines() if line.startswith(built["big"][7:19]))
    assert " lazy " in big_row and "big" in big_row
    listing = json.loads(cli("--json").stdout)
    assert any(i["lazy"] and i["fetched_bytes"] > 0 for i in listing["images"])
    out = cli("--drop")
    assert out.returncode == 0 and "dropped 0 image(s)" in out.stdout and "2 in use kept" in out.stdout, out.stdout
    assert await layers.release(NODE, "sb-cli")
    out = cli("--drop")
    assert out.returncode == 0 and "dropped 2 image(s)" in out.stdout and "0 in use kept" in out.stdout, out.stdout
    assert (await layers.cache(NODE)).images == []


async def test_a_stopped_service_leaves_no_fuse_mount_or_daemon(layers, service, built):
    rootfs = await layers.compose(NODE, "sb-last", ["base", "big"])
    _chroot(rootfs.path, "cat /data/small.txt")
    assert service.daemon_pid()
    assert await layers.release(NODE, "sb-last")
    assert service.stop() == 0
    assert mounts.mounts_under(service.root) == []
    assert [d for d in lazy_daemons() if str(service.root) in d] == []
    assert not (service.root / "lazyfs.pid").exists()


# -- through the platform -------------------------------------------------------------


async def test_a_sandbox_on_the_platform_reads_a_lazily_fetched_layer(platform, fleet, tmp_path):
    require(os.geteuid() == 0, "sandboxes need root")
    src = tmp_path / "task"
    (src / "workspace").mkdir(parents=True)
    (src / "workspace" / "answer").write_text("42\n")
    (src / "workspace" / "bulk").write_bytes(os.urandom(4 << 20))
    base = tmp_path / "base"
    make_busybox_base(base)
    lay = await connect(platform.url)
    try:
        await lay.build_dir("lazy-base", base)
        await lay.build_dir("lazy-task", src)
        await lay.cache_drop(platform.node_id)
        sb = await fleet.create(isolation="process", layers=["lazy-base", "lazy-task"])
        try:
            result = await sb.exec(["cat", "/workspace/answer"])
            assert (result.exit_code, result.stdout) == (0, b"42\n")
            listing = await lay.cache(platform.node_id)
            task = next(i for i in listing.images if "lazy-task" in i.names)
            assert listing.fetch == "lazy" and task.lazy and task.fetched_bytes < task.size // 2
        finally:
            await sb.destroy()
    finally:
        await lay.bus.close()

"""The layer-cache on the real kernel: real mkfs.erofs, real mounts, a real Object Store.

The module starts its own nats-server and the service as a subprocess (`python -m
services.layer_cache`), builds small layers from busybox-static, composes them into roots,
and checks the kernel's mount table at every step. At the end nothing it made is left.
Its layer-cache composes in the host's own mount table (SANDFLEET_ROOTS_NS=host), so roots
are read by their paths; the node's roots namespace is tests/test_flat_mounts.py's.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers, connect
from sandfleet.config import free_port
from sandfleet.supervisor import nats_server_binary
from services.layer_cache import build
from services.layer_cache import mounts
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_layer_sources

ROOT = Path(__file__).resolve().parent.parent
NODE = "lc-test"
BUDGET_MB = 8


def _erofs_works() -> bool:
    with open("/proc/filesystems") as f:
        found = f.read()
    return "erofs" in found and "overlay" in found and shutil.which("mkfs.erofs") is not None


@dataclass
class Service:
    url: str
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.data_dir / "layer-cache"

    def start(self) -> None:
        self.env = {
            **os.environ, "SANDFLEET_NATS_URL": self.url, "SANDFLEET_DATA_DIR": str(self.data_dir),
            "SANDFLEET_NODE_ID": NODE, "SANDFLEET_ROOTS_NS": "host", "SANDFLEET_LAYER_CACHE_MB": str(BUDGET_MB), "PYTHONPATH": str(ROOT),
            "SANDFLEET_LAYER_FETCH": "full",  # whole images; tests/test_lazy_layers.py covers lazy fetching
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


async def _until_serving(layers: Layers, service: Service) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await layers.cache(NODE)
            return
        except errors.NoResponders:
            if time.monotonic() > deadline or (service.proc and service.proc.poll() is not None):
                raise RuntimeError(f"layer-cache did not start:\n{service.log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def kernel():
    require(os.geteuid() == 0, "mounting needs root")
    require(_erofs_works(), "EROFS, overlayfs and mkfs.erofs")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")


@pytest.fixture(scope="module")
def service(kernel, tmp_path_factory):
    base = tmp_path_factory.mktemp("layers")
    port = free_port()
    nats = subprocess.Popen(
        [nats_server_binary(), "-js", "-sd", str(base / "js"), "-p", str(port), "-a", "127.0.0.1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    svc = Service(url=f"nats://127.0.0.1:{port}", data_dir=base / "data", log=base / "layer-cache.log")
    svc.start()
    yield svc
    if svc.proc is not None:
        svc.stop()
    nats.terminate()
    nats.wait(timeout=10)
    # Other sessions may be making sandboxes on this machine meanwhile: what counts is what
    # this module made, i.e. anything that names its directory.
    left_mounts = [f"{e.fstype} {e.source} on {e.mount_point}" for e in mounts.read_mountinfo()
                   if str(base) in e.mount_point or str(base) in e.source]
    left_processes = _processes_using(base)
    mounts.unmount_tree(svc.root)  # roots a failed test did not release must not outlive the module
    assert not left_mounts, f"the layer tests left mounts behind: {left_mounts}"
    assert not left_processes, f"the layer tests left processes behind: {left_processes}"


def _processes_using(path: Path) -> list[str]:
    """Processes whose command line names anything under `path` (service, builds, unpackers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.fixture(scope="module")
async def layers(service):
    client = await connect(service.url)
    await _until_serving(client, service)
    yield client
    await client.bus.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    src = make_layer_sources(tmp_path_factory.mktemp("src"), applets=("sh", "cat", "ls", "echo"))
    os.chmod(src / "task", 0o700)  # as a temporary directory would be
    return src


@pytest.fixture(scope="module")
async def built(layers, sources):
    """`base` (tagged v1), `tools` on it and `task`, built once for the module: name → the first
    build's reply."""
    replies = {"base": await layers.build_dir("base", sources / "base", tags=["v1"])}
    for name in ("tools", "task"):
        replies[name] = await layers.build_dir(name, sources / name, on="base" if name == "tools" else None)
    return replies


@pytest.fixture(scope="module")
async def roots(layers, built, service):
    """sb-a and sb-b, two roots of base + tools + task held for the module: those layers are in
    use while a test runs (never idle, never evicted)."""
    made = {s: await layers.compose(NODE, s, ["base", "tools", "task"]) for s in ("sb-a", "sb-b")}
    yield made
    if service.proc is not None:  # the last test stops the service, after releasing them
        for s in made:
            await layers.release(NODE, s)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def _erofs_mounts(root: Path) -> dict[str, list[mounts.MountEntry]]:
    found: dict[str, list[mounts.MountEntry]] = {}
    for e in mounts.read_mountinfo():
        if e.fstype == "erofs" and e.mount_point.startswith(str(root) + "/"):
            found.setdefault(e.mount_point.rsplit("/", 1)[1], []).append(e)
    return found


def _overlays(root: Path) -> list[str]:
    return [e.mount_point for e in mounts.read_mountinfo()
            if e.fstype == "overlay" and e.mount_point.startswith(str(root) + "/")]


def _chroot(rootfs: str, script: str) -> str:
    out = subprocess.run(["chroot", rootfs, "/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


# -- building -------------------------------------------------------------------------


async def test_build_a_layer_from_a_directory(layers, service, sources, built):
    reply = built["base"]
    layer = reply.layer
    assert reply.stored and reply.node == NODE and layer.name == "base" and layer.tags == ["v1"]
    cached = service.root / "images" / (layer.digest.removeprefix("sha256:") + ".erofs")
    assert _sha256(cached) == layer.digest and cached.stat().st_size == layer.size
    with open(cached, "rb") as f:
        f.seek(1024)
        assert f.read(4) == bytes.fromhex("e2e1f5e0")  # the EROFS superblock magic
    assert layer.files == 10 and layer.content_bytes >= BUSYBOX.stat().st_size

    again = await layers.build_dir("base", sources / "base", tags=["v1"])
    assert again.layer.digest == layer.digest and not again.stored  # same tree, same image, stored once
    listed = {(entry.name, entry.digest): entry for entry in await layers.list()}
    assert listed[("base", layer.digest)].tags == ["v1"] and listed[("base", layer.digest)].current
    assert (await layers.get("base:v1")).digest == layer.digest
    assert (await layers.get(layer.digest)).name == "base"

    assert (await layers.get("tools")).parent_digest == layer.digest
    assert not any((service.root / "build").iterdir())  # build dirs are gone


# -- composing ------------------------------------------------------------------------


async def test_compose_three_layers_top_layer_wins(layers, service, built):
    rootfs = await layers.compose(NODE, "sb-three", ["base", "tools", "task"])
    assert rootfs.layers == [(await layers.get(n)).digest for n in ("base", "tools", "task")]
    assert _chroot(rootfs.path, "cat /etc/hostname /etc/base-only /etc/tools /workspace/task.txt") == (
        "tools\nfrom base\na tool\nsolve it\n"
    )
    assert os.stat(rootfs.path).st_mode & 0o777 == 0o755  # `/` is the base system's, not the task dir's
    again = await layers.compose(NODE, "sb-three", ["base", "tools", "task"])
    assert again.path == rootfs.path  # a retried compose gets the same root
    with pytest.raises(errors.Conflict):
        await layers.compose(NODE, "sb-three", ["base"])
    assert await layers.release(NODE, "sb-three")


async def test_writes_stay_in_their_own_rootfs_and_never_change_a_layer(layers, service, built):
    a = await layers.compose(NODE, "sb-wa", ["base", "tools", "task"])
    b = await layers.compose(NODE, "sb-wb", ["base", "tools", "task"])
    original = _sha256(BUSYBOX)
    _chroot(a.path, "echo evil > /bin/busybox.new && echo changed > /workspace/task.txt && echo x > /new")
    with open(Path(a.path) / "bin" / "busybox", "wb") as f:  # overwrite the shell itself
        f.write(b"#!/bin/false\n")
    os.unlink(Path(a.path) / "etc" / "tools")

    assert _sha256(Path(b.path) / "bin" / "busybox") == original
    assert _chroot(b.path, "cat /workspace/task.txt /etc/tools") == "solve it\na tool\n"
    assert not (Path(b.path) / "new").exists()
    base_mount = service.root / "mnt" / a.layers[0].removeprefix("sha256:")
    assert _sha256(base_mount / "bin" / "busybox") == original
    tools_mount = service.root / "mnt" / a.layers[1].removeprefix("sha256:")
    assert (tools_mount / "etc" / "tools").read_text() == "a tool\n"
    upper = Path(a.upper)
    assert (upper / "bin" / "busybox").read_bytes() == b"#!/bin/false\n"
    assert os.stat(upper / "etc" / "tools", follow_symlinks=False).st_rdev == 0  # an overlay whiteout
    assert not (Path(b.upper) / "bin" / "busybox").exists()
    assert await layers.release(NODE, "sb-wa") and await layers.release(NODE, "sb-wb")


async def test_each_layer_is_mounted_once_however_many_roots_use_it(layers, service, roots):
    overlays = len(_overlays(service.root))  # the module's roots, and any other test's still held
    held = {i.digest.removeprefix("sha256:"): i.users for i in (await layers.cache(NODE)).images}
    extra = [f"sb-m{i}" for i in range(6)]
    for sandbox_id in extra:
        await layers.compose(NODE, sandbox_id, ["base", "tools", "task"])
    erofs = _erofs_mounts(service.root)
    digests = [(await layers.get(n)).digest.removeprefix("sha256:") for n in ("base", "tools", "task")]
    assert {d: len(erofs[d]) for d in digests} == {d: 1 for d in digests}
    for d in digests:
        entry = erofs[d][0]
        assert entry.source == str(service.root / "images" / f"{d}.erofs")  # the file itself, no loop device
        assert "directio" in entry.options
    assert len(_overlays(service.root)) == overlays + len(extra)
    listing = await layers.cache(NODE)
    users = {i.digest.removeprefix("sha256:"): i.users for i in listing.images}
    assert all(held[d] >= len(roots) and users[d] == held[d] + len(extra) for d in digests)
    for sandbox_id in extra:
        assert await layers.release(NODE, sandbox_id)
    assert len(_overlays(service.root)) == overlays
    assert {d: len(_erofs_mounts(service.root)[d]) for d in digests} == {d: 1 for d in digests}
    assert not any((service.root / "sandboxes" / s).exists() for s in extra)
    assert not await layers.release(NODE, extra[0])  # already gone


async def test_bad_compose_requests_fail_cleanly(layers, service, built):
    overlays = _overlays(service.root)
    with pytest.raises(errors.NotFound):
        await layers.compose(NODE, "sb-bad", ["base", "no-such-layer"])
    with pytest.raises(errors.InvalidRequest):
        await layers.compose(NODE, "sb-bad", ["base", "base:v1"])  # the same image twice
    with pytest.raises(errors.InvalidRequest):
        await layers.compose(NODE, "Bad_Id", ["base"])
    assert _overlays(service.root) == overlays
    assert not (service.root / "sandboxes" / "sb-bad").exists()


async def test_a_compose_that_fails_half_way_undoes_its_mounts(layers, service, roots, tmp_path):
    (tmp_path / "fresh").write_text("never mounted before")
    digest = (await layers.build_dir("fresh", tmp_path)).layer.digest
    clash = service.root / "sandboxes" / "sb-clash"
    clash.write_text("in the way")  # the root's directory cannot be made: fails after the layers are mounted
    try:
        with pytest.raises(errors.InternalError):
            await layers.compose(NODE, "sb-clash", ["base", "fresh"])
    finally:
        clash.unlink()
    assert digest.removeprefix("sha256:") not in _erofs_mounts(service.root)
    image = next(i for i in (await layers.cache(NODE)).images if i.digest == digest)
    assert image.users == 0 and not image.mounted
    base = (await layers.get("base")).digest.removeprefix("sha256:")
    assert len(_erofs_mounts(service.root)[base]) == 1  # still there for sb-a and sb-b
    rootfs = await layers.compose(NODE, "sb-clash", ["base", "fresh"])
    assert (Path(rootfs.path) / "fresh").read_text() == "never mounted before"
    assert await layers.release(NODE, "sb-clash")


# -- image archives -------------------------------------------------------------------


def _layer_tar(entries: dict[str, bytes | None]) -> bytes:
    """A layer tar: name → content (None: a directory)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def docker_save(path: Path, layer_tars: list[bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        names = []
        for i, data in enumerate(layer_tars):
            names.append(f"{i:064x}/layer.tar")
            _add(tar, names[-1], data)
        _add(tar, "manifest.json", json.dumps([{"Config": "c.json", "RepoTags": ["t:1"], "Layers": names}]).encode())
        _add(tar, "c.json", b"{}")


def oci_layout(path: Path, layer_tars: list[bytes]) -> None:
    def blob(tar: tarfile.TarFile, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        _add(tar, f"blobs/sha256/{digest}", data)
        return f"sha256:{digest}"

    with tarfile.open(path, "w") as tar:
        layer_descs = []
        for data in layer_tars:
            gz = gzip.compress(data)
            layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": blob(tar, gz),
                                "size": len(gz)})
        config = blob(tar, b"{}")
        manifest = json.dumps({"schemaVersion": 2, "config": {"digest": config}, "layers": layer_descs}).encode()
        index = {"schemaVersion": 2, "manifests": [{"digest": blob(tar, manifest), "platform": {"architecture": "amd64", "os": "linux"}}]}
        _add(tar, "index.json", json.dumps(index).encode())
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')


async def test_docker_archive_layers_are_flattened_with_whiteouts(layers, service, built, tmp_path):
    lower = _layer_tar({"etc/": None, "etc/a": b"a", "etc/b": b"b", "opt/": None, "opt/x/": None,
                        "opt/x/1": b"1", "opt/x/2": b"2", "etc/link-me": b"l"})
    upper = _layer_tar({"etc/.wh.a": b"", "opt/x/3": b"3", "opt/x/.wh..wh..opq": b"", "etc/link-me": b"new"})
    archive = tmp_path / "image.tar"
    docker_save(archive, [lower, upper])
    reply = await layers.build_tar("img", archive)
    assert "docker, 2 layer(s)" in reply.layer.built_from
    rootfs = await layers.compose(NODE, "sb-img", ["base", "img"])
    root = Path(rootfs.path)
    assert not (root / "etc" / "a").exists() and (root / "etc" / "b").read_text() == "b"
    assert sorted(os.listdir(root / "opt" / "x")) == ["3"]
    assert (root / "etc" / "link-me").read_text() == "new"
    assert (root / "etc" / "hostname").read_text() == "base\n"  # no --on: nothing of base is hidden
    assert await layers.release(NODE, "sb-img")


async def test_oci_layer_built_on_another_keeps_its_whiteouts(layers, service, built, tmp_path):
    patch = _layer_tar({"etc/": None, "etc/.wh.hostname": b"", "workspace/": None, "workspace/.wh..wh..opq": b"",
                        "workspace/patched": b"p"})
    archive = tmp_path / "oci.tar"
    oci_layout(archive, [patch])
    reply = await layers.build_tar("patch", archive, on="base")
    assert reply.layer.parent == "base" and "oci, 1 layer(s)" in reply.layer.built_from
    rootfs = await layers.compose(NODE, "sb-patch", ["base", "task", "patch"])
    root = Path(rootfs.path)
    assert not (root / "etc" / "hostname").exists()  # hidden by the whiteout
    assert (root / "etc" / "base-only").exists()
    assert os.listdir(root / "workspace") == ["patched"]  # opaque: the task's files are hidden
    assert await layers.release(NODE, "sb-patch")


async def test_a_broken_archive_is_refused_and_leaves_nothing(layers, service, tmp_path):
    archive = tmp_path / "broken.tar"
    archive.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(errors.InvalidRequest):
        await layers.build_tar("broken", archive)
    with pytest.raises(errors.NotFound):
        await layers.build_tar("orphan", archive, on="no-such-layer")
    assert not any((service.root / "build").iterdir())
    with pytest.raises(errors.NotFound):
        await layers.get("broken")


# -- the cache ------------------------------------------------------------------------


async def test_least_recently_used_idle_layers_are_evicted(layers, service, roots, tmp_path):
    """Budget 8 MiB; base (1.4 MiB), tools and task stay in use by sb-a and sb-b throughout."""
    fillers = []
    for i in range(3):
        d = tmp_path / f"filler{i}"
        d.mkdir()
        (d / "blob").write_bytes(os.urandom(3 << 20))  # incompressible: ~3 MiB images
        fillers.append((await layers.build_dir(f"filler{i}", d)).layer.digest)
        if i == 0:
            rootfs = await layers.compose(NODE, "sb-f", ["base", "filler0"])
            assert await layers.release(NODE, "sb-f")  # filler0 now idle but still mounted
            assert fillers[0].removeprefix("sha256:") in _erofs_mounts(service.root)
    listing = await layers.cache(NODE)
    cached = {i.digest for i in listing.images}
    assert fillers[0] not in cached and {fillers[1], fillers[2]} <= cached
    assert fillers[0].removeprefix("sha256:") not in _erofs_mounts(service.root)  # unmounted before deletion
    assert not (service.root / "images" / (fillers[0].removeprefix("sha256:") + ".erofs")).exists()
    in_use = {d for r in listing.rootfs for d in r.layers}
    assert in_use <= cached  # nothing in use was evicted
    assert listing.used_bytes <= listing.budget_bytes

    rootfs = await layers.compose(NODE, "sb-f", ["base", "filler0"])  # fetched back from the store
    blob = Path(rootfs.path) / "blob"
    assert blob.stat().st_size == 3 << 20
    assert _sha256(service.root / "images" / (fillers[0].removeprefix("sha256:") + ".erofs")) == fillers[0]
    assert await layers.release(NODE, "sb-f")


# -- restart --------------------------------------------------------------------------


async def test_a_restarted_service_readopts_roots_and_reclaims_leftovers(layers, service, roots, tmp_path):
    b = roots["sb-b"]
    (Path(b.path) / "workspace" / "kept").write_text("still here")
    await layers.compose(NODE, "sb-r", ["base", "tools"])  # released by this test once readopted
    before = await layers.cache(NODE)
    held = {r.sandbox_id for r in before.rootfs}
    assert held >= {*roots, "sb-r"}
    service.stop(signal.SIGKILL)

    # What a crash half way could leave: a root dir with no overlay, a foreign overlay, an
    # image mounted where images are not mounted.
    sandboxes = service.root / "sandboxes"
    (sandboxes / "sb-stale" / "upper").mkdir(parents=True)
    foreign = sandboxes / "sb-foreign"
    for part in ("lower", "upper", "work", "rootfs"):
        (foreign / part).mkdir(parents=True)
    mounts.mount_overlay([str(tmp_path)], foreign / "upper", foreign / "work", foreign / "rootfs")
    odd = service.root / "mnt" / "odd"
    odd.mkdir()
    image = service.root / "images" / (b.layers[1].removeprefix("sha256:") + ".erofs")
    mounts.mount_erofs(image, odd)

    service.start()
    await _until_serving(layers, service)
    listing = await layers.cache(NODE)
    assert {r.sandbox_id for r in listing.rootfs} == held
    assert next(r for r in listing.rootfs if r.sandbox_id == "sb-b").layers == b.layers
    assert (Path(b.path) / "workspace" / "kept").read_text() == "still here"
    assert not (sandboxes / "sb-stale").exists() and not foreign.exists() and not odd.exists()
    assert sorted(_overlays(service.root)) == sorted([str(sandboxes / s / "rootfs") for s in held])
    erofs = _erofs_mounts(service.root)
    assert all(len(erofs[d.removeprefix("sha256:")]) == 1 for d in b.layers)
    users = {i.digest: i.users for i in listing.images}
    assert {d: users[d] for d in b.layers} == {i.digest: i.users for i in before.images if i.digest in b.layers}

    # A clean stop keeps what running sandboxes use and unmounts only idle layers.
    assert service.stop() == 0
    assert len(_overlays(service.root)) == len(held)
    in_use = {d.removeprefix("sha256:") for r in listing.rootfs for d in r.layers}
    assert in_use >= {d.removeprefix("sha256:") for d in b.layers} and set(_erofs_mounts(service.root)) == in_use
    service.start()
    await _until_serving(layers, service)
    assert {r.sandbox_id for r in (await layers.cache(NODE)).rootfs} == held

    assert await layers.release(NODE, "sb-r")
    assert sorted(_overlays(service.root)) == sorted([str(sandboxes / s / "rootfs") for s in held - {"sb-r"}])


# -- the catalogue and the command line -----------------------------------------------


def _cli(service: Service, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandfleet.cli_layers", "layer", *args, "--nats", service.url],
                          env={**service.env, "SANDFLEET_NODE_ID": NODE}, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


async def test_command_line_builds_lists_shows_the_cache_and_removes(layers, service, tmp_path):
    (tmp_path / "only-here").write_text("cli")
    out = _cli(service, "build", "cli-layer", "--dir", str(tmp_path), "--tag", "t1")
    assert out.returncode == 0, out.stderr
    assert "cli-layer  sha256:" in out.stdout
    digest = "sha256:" + out.stdout.split("cli-layer  sha256:")[1][:64]
    out = _cli(service, "ls")
    assert out.returncode == 0 and "cli-layer" in out.stdout and "latest,t1" in out.stdout
    out = _cli(service, "cache", "--json")
    listing = json.loads(out.stdout)
    assert listing["node"] == NODE and [i["users"] for i in listing["images"] if i["digest"] == digest] == [0]
    out = _cli(service, "rm", "cli-layer:t1")
    assert out.returncode == 0 and "removed cli-layer:t1" in out.stdout and "deleted" not in out.stdout
    out = _cli(service, "rm", "cli-layer")
    assert out.returncode == 0 and "deleted image(s)" in out.stdout
    out = _cli(service, "rm", "cli-layer")
    assert out.returncode == 2 and "NotFound" in out.stderr


async def test_removing_a_layer_keeps_node_copies_but_stops_new_roots(layers, service, built, tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "b").write_text("b")
    digest = (await layers.build_dir("doomed", tmp_path)).layer.digest
    rootfs = await layers.compose(NODE, "sb-rm", ["base", "doomed"])
    reply = await layers.remove("doomed")
    assert reply.removed == ["doomed"] and reply.deleted_images == [digest]
    assert (Path(rootfs.path) / "etc" / "b").read_text() == "b"  # the running root is untouched
    with pytest.raises(errors.NotFound):
        await layers.compose(NODE, "sb-rm2", ["base", "doomed"])
    with pytest.raises(errors.NotFound):
        await layers.compose(NODE, "sb-rm2", [digest])  # gone from the store too
    assert await layers.release(NODE, "sb-rm")


# -- Debian ---------------------------------------------------------------------------


async def test_a_minimal_debian_root_with_packages(layers, service, built):
    require(shutil.which("debootstrap") is not None, "debootstrap")
    reply = await layers.build_debian("debian-min", ["busybox"])
    assert reply.layer.built_from.startswith("debian ") and "busybox" in reply.layer.built_from
    rootfs = await layers.compose(NODE, "sb-deb", ["debian-min", "task"])
    out = _chroot(rootfs.path, "cat /etc/debian_version; busybox echo ok; dpkg-query -W busybox")
    assert "ok" in out and "busybox" in out
    assert not any(Path(rootfs.path).glob("var/cache/apt/archives/*.deb"))
    assert not (Path(rootfs.path) / build.UNSAFE_IO_CONF).exists()  # the build's dpkg setting is not the layer's
    assert (Path(rootfs.path) / build.UNSAFE_IO_CONF).parent.is_dir()
    assert await layers.release(NODE, "sb-deb")
    assert (await layers.remove("debian-min")).deleted_images


# -- nothing left ---------------------------------------------------------------------


async def test_a_stopped_service_leaves_no_mount_behind(layers, service, roots):
    for sandbox_id in roots:
        assert await layers.release(NODE, sandbox_id)
    assert (await layers.cache(NODE)).rootfs == []
    assert _erofs_mounts(service.root)  # idle layer mounts are kept while it runs
    assert service.stop() == 0
    assert mounts.mounts_under(service.root) == []
    assert list((service.root / "sandboxes").iterdir()) == []

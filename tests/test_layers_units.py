"""Layer-cache logic without a bus or a kernel mount: references, schemas, eviction, overlay
options, mountinfo, the restart plan, whiteout names, apt sources, and the image cache on files."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import pytest

from schemas import layers as schema
from services.layer_cache import lazy, mounts, recovery, unpack
from services.layer_cache.build import apt_archive, prune_debs, tree_stats
from services.layer_cache.cache import CachedImage, ImageCache, choose_victims
from services.layer_cache.handlers import catalogue
from services.layer_cache.mounts import MountEntry, overlay_options, parse_mountinfo
from services.layer_cache.store import Ref, object_digest

D1, D2, D3 = ("sha256:" + c * 64 for c in "abc")


# -- references and schemas -----------------------------------------------------------


def test_references_map_to_kv_keys_and_back():
    assert Ref.parse("base").key == "base"
    assert Ref.parse("base:v1.2").key == "base.v1.2"
    assert Ref.from_key("base.v1.2") == Ref(name="base", tag="v1.2")
    assert str(Ref.from_key("base.v1.2")) == "base:v1.2"
    assert Ref.parse(D1) == Ref(digest=D1)


def test_object_store_digest_is_the_same_sha256():
    import base64
    import hashlib

    data = b"layer"
    ours = "sha256:" + hashlib.sha256(data).hexdigest()
    assert object_digest(ours) == "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


@pytest.mark.parametrize("name", ["sha256", "Base", "-x", "a.b", "", "a" * 64, "x/y"])
def test_build_rejects_bad_names(name):
    body = {"name": name, "source": {"type": "dir", "upload": "u"}}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(body, schema.BuildRequest)


@pytest.mark.parametrize(
    "source",
    [
        {"type": "debian", "packages": ["busybox; rm -rf /"]},
        {"type": "debian", "packages": ["-o=x"]},
        {"type": "debian", "suite": "../x"},
        {"type": "dir", "upload": "../etc/passwd"},
        {"type": "nfs", "upload": "u"},
    ],
)
def test_build_rejects_bad_sources(source):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": "x", "source": source}, schema.BuildRequest)


def test_build_source_is_a_tagged_union():
    req = msgspec.json.decode(b'{"name":"d","source":{"type":"debian","packages":["busybox"]}}', type=schema.BuildRequest)
    assert isinstance(req.source, schema.DebianSource) and req.source.variant == "minbase"
    assert msgspec.json.decode(msgspec.json.encode(req), type=schema.BuildRequest) == req


@pytest.mark.parametrize("layers", [[], ["Bad"], ["sha256:abc"], ["x"] * (schema.MAX_LAYERS + 1), ["a::b"]])
def test_compose_rejects_bad_layer_lists(layers):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"sandbox_id": "sb-1", "layers": layers}, schema.ComposeRequest)


def test_compose_takes_names_tags_and_digests():
    req = msgspec.convert({"sandbox_id": "sb-1", "layers": ["base", "tools:v2", D1]}, schema.ComposeRequest)
    assert req.layers == ["base", "tools:v2", D1]


def _layer(name, digest, at=1.0, tags=()):
    return schema.Layer(name=name, digest=digest, size=1, built_from="dir", created_at=at, tags=list(tags))


def test_catalogue_groups_references_by_build():
    refs = {
        "base": _layer("base", D2, at=2.0),
        "base.v2": _layer("base", D2, at=2.0),
        "base.v1": _layer("base", D1, at=1.0),
        "tools": _layer("tools", D3),
    }
    entries = catalogue(refs)
    assert [(e.name, e.digest, e.tags, e.current) for e in entries] == [
        ("base", D2, ["v2"], True),
        ("base", D1, ["v1"], False),
        ("tools", D3, [], True),
    ]
    assert [e.name for e in catalogue(refs, "tools")] == ["tools"]


# -- eviction -------------------------------------------------------------------------


def _img(digest, size, last_used, pins=0):
    return CachedImage(digest, Path("/x"), size, size, last_used, pins)


def test_eviction_takes_least_recently_used_first_and_stops_in_budget():
    images = [_img(D1, 10, last_used=3), _img(D2, 10, last_used=1), _img(D3, 10, last_used=2)]
    assert choose_victims(images, budget=20) == [D2]
    assert choose_victims(images, budget=10) == [D2, D3]
    assert choose_victims(images, budget=30) == []
    assert choose_victims(images, budget=30, incoming=5) == [D2]


def test_eviction_never_takes_an_image_in_use_or_kept():
    images = [_img(D1, 10, last_used=1, pins=1), _img(D2, 10, last_used=2), _img(D3, 10, last_used=3)]
    assert choose_victims(images, budget=0) == [D2, D3]
    assert choose_victims(images, budget=0, keep=frozenset({D2})) == [D3]
    assert choose_victims([_img(D1, 10, 1, pins=2)], budget=0) == []  # soft budget: in use stays


# -- overlay options and mountinfo ----------------------------------------------------


def test_overlay_options_list_the_top_layer_first():
    data = overlay_options(["/m/top", "/m/base"], "/s/upper", "/s/work")
    assert data == "lowerdir=/m/top:/m/base,upperdir=/s/upper,workdir=/s/work"


@pytest.mark.parametrize(
    "lowers,upper", [([], "/u"), (["/m/a:b"], "/u"), (["/m/a"], "/u,x"), (["rel"], "/u"), (["/" + "x" * 300] * 16, "/u")]
)
def test_overlay_options_refuse_what_overlayfs_would_misread(lowers, upper):
    with pytest.raises(ValueError):
        overlay_options(lowers, upper, "/w")


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:39 / /d/lc/mnt/{a} ro,nodev,relatime - erofs /d/lc/images/{a}.erofs ro,user_xattr,directio
41 27 0:40 / /d/lc/mnt/{b} ro,nodev,relatime - erofs /d/lc/images/{b}.erofs ro,directio
50 27 0:45 / /d/lc/sandboxes/sb-1/rootfs rw - overlay overlay rw,lowerdir=/d/lc/mnt/{b}:/d/lc/mnt/{a},upperdir=/d/lc/sandboxes/sb-1/upper,workdir=/d/lc/sandboxes/sb-1/work
51 50 0:46 / /d/lc/sandboxes/sb-1/rootfs/proc rw - proc proc rw
52 27 0:47 / /d/lc/sandboxes/sb-2/rootfs rw - overlay overlay rw,lowerdir=/elsewhere,upperdir=/d/lc/sandboxes/sb-2/upper,workdir=/d/lc/sandboxes/sb-2/work
53 27 0:48 / /d/lc/mnt/odd\\040name ro - erofs /tmp/x.erofs ro
54 27 0:49 / /d/lc/sandboxes/sb-3/rootfs rw - overlay overlay rw,lowerdir=/d/lc/mnt/{a},upperdir=/d/lc/sandboxes/sb-1/upper,workdir=/w
""".format(a="a" * 64, b="b" * 64)


def test_mountinfo_is_parsed_with_escapes_and_options():
    entries = parse_mountinfo(MOUNTINFO)
    assert len(entries) == 8
    odd = next(e for e in entries if e.mount_id == 53)
    assert odd.mount_point == "/d/lc/mnt/odd name" and odd.fstype == "erofs"
    overlay = next(e for e in entries if e.mount_id == 50)
    assert overlay.options["upperdir"] == "/d/lc/sandboxes/sb-1/upper"
    assert "directio" in next(e for e in entries if e.mount_id == 40).options


def test_mounts_under_come_deepest_first():
    entries = parse_mountinfo(MOUNTINFO)
    points = [e.mount_point for e in mounts.mounts_under(Path("/d/lc/sandboxes/sb-1"), entries)]
    assert points == ["/d/lc/sandboxes/sb-1/rootfs/proc", "/d/lc/sandboxes/sb-1/rootfs"]


def test_restart_plan_adopts_own_roots_and_undoes_the_rest():
    layout = recovery.Layout(Path("/d/lc"))
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    found = recovery.plan(
        layout, parse_mountinfo(MOUNTINFO), sandbox_dirs=["sb-1", "sb-2", "sb-3", "sb-9"],
        mnt_dirs=["a" * 64, "b" * 64, "odd name", "c" * 64],
    )
    assert found.rootfs == {"sb-1": [a, b]}  # bottom first
    assert found.layer_mounts == {a, b}
    # a foreign overlay, one writing to another sandbox's upper dir, an image mounted elsewhere
    assert sorted(found.unmount) == sorted(
        ["/d/lc/sandboxes/sb-2/rootfs", "/d/lc/sandboxes/sb-3/rootfs", "/d/lc/mnt/odd name"]
    )
    assert "/d/lc/sandboxes/sb-1/rootfs/proc" not in found.unmount  # beneath an adopted root
    assert sorted(found.remove) == sorted(
        ["/d/lc/sandboxes/sb-2", "/d/lc/sandboxes/sb-3", "/d/lc/sandboxes/sb-9", "/d/lc/mnt/odd name",
         "/d/lc/mnt/" + "c" * 64]
    )


def test_restart_plan_ignores_mounts_outside_its_tree():
    entries = [MountEntry(1, 0, "/d/lcx/mnt/" + "a" * 64, "erofs", "/x", {})]
    found = recovery.plan(recovery.Layout(Path("/d/lc")), entries, [], [])
    assert not found.unmount and not found.layer_mounts


def test_restart_plan_keeps_lazy_images_and_leaves_the_fuse_mount_to_its_daemon():
    entries = [MountEntry(1, 0, "/d/lc/lazy", "fuse.sandfleet", "sandfleet-lazy", {}),
               MountEntry(2, 0, "/d/lc/mnt/" + "a" * 64, "erofs", f"/d/lc/lazy/{'a' * 64}.erofs", {})]
    found = recovery.plan(recovery.Layout(Path("/d/lc")), entries, [], ["a" * 64])
    assert found.unmount == [] and found.layer_mounts == {"sha256:" + "a" * 64} and found.remove == []


# -- archives and sources -------------------------------------------------------------


@pytest.mark.parametrize(
    "name,expected",
    [
        ("etc/.wh.passwd", ("whiteout", "etc/passwd")),
        ("./opt/x/.wh..wh..opq", ("opaque", "opt/x")),
        (".wh.top", ("whiteout", "top")),
        ("/usr/bin/env", ("entry", "usr/bin/env")),
        ("../../etc/shadow", ("entry", "etc/shadow")),
        ("./", ("entry", "")),
    ],
)
def test_member_names_are_classified(name, expected):
    assert unpack.classify(name) == expected


def test_apt_archive_from_deb822_skips_security_and_updates():
    sources = {
        "/etc/apt/sources.list.d/debian.sources": (
            "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
            "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
            "Components: main\n"
        )
    }
    assert apt_archive(sources) == "http://mirror.example/debian"


def test_apt_archive_from_one_line_sources():
    sources = {"/etc/apt/sources.list": "# x\ndeb-src http://m/src bookworm main\ndeb [arch=amd64] http://m/debian bookworm main\n"}
    assert apt_archive(sources) == "http://m/debian"
    assert apt_archive({"/etc/apt/sources.list": "deb http://m/debian bookworm-updates main\n"}) is None


def test_tree_stats_count_files_and_the_newest_mtime(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"12345")
    os.symlink("f", tmp_path / "d" / "l")
    os.utime(tmp_path / "d" / "f", (1000.5, 1000.5))
    os.utime(tmp_path / "d", (900, 900))
    os.utime(tmp_path, (800, 800))
    stats = tree_stats(tmp_path)
    assert stats.files == 3 and stats.content_bytes == 5 + 1  # the symlink's size is its target's length
    assert stats.newest_mtime >= 1001


# -- the image cache on plain files ---------------------------------------------------


async def test_image_cache_fetches_once_for_concurrent_users_and_evicts_lru(tmp_path):
    fetched: list[str] = []
    evicted: list[str] = []

    async def fetch(digest: str, dest: Path) -> None:
        fetched.append(digest)
        await asyncio.sleep(0.01)
        dest.write_bytes(os.urandom(8192))

    cache = ImageCache(tmp_path, budget=20_000, fetch=fetch, before_evict=evicted.append)
    cache.scan()
    first = await asyncio.gather(*(cache.acquire(D1) for _ in range(5)))
    assert fetched == [D1] and first[0].pins == 5 and first[0].path.read_bytes()
    for _ in range(5):
        cache.unpin(D1)
    await cache.acquire(D2)
    cache.unpin(D2)
    await cache.acquire(D3)  # 3 x 8 KiB > 20,000: the least recently used (D1) goes
    assert evicted == [D1] and set(cache.images) == {D2, D3}
    assert not cache.path(D1).exists()


async def test_image_cache_keeps_images_in_use_over_budget(tmp_path):
    async def fetch(digest: str, dest: Path) -> None:
        dest.write_bytes(os.urandom(8192))

    cache = ImageCache(tmp_path, budget=4096, fetch=fetch, before_evict=lambda d: None)
    cache.scan()
    await cache.acquire(D1)
    await cache.acquire(D2)
    assert set(cache.images) == {D1, D2}  # both pinned: the budget gives way
    cache.unpin(D1)
    cache.evict()
    assert set(cache.images) == {D2}


async def test_image_cache_scan_drops_partial_files_and_keeps_lru_order(tmp_path):
    (tmp_path / ("a" * 64 + ".erofs")).write_bytes(b"x" * 4096)
    (tmp_path / ("b" * 64 + ".erofs")).write_bytes(b"x" * 4096)
    (tmp_path / ("c" * 64 + ".erofs.part")).write_bytes(b"x")
    os.utime(tmp_path / ("a" * 64 + ".erofs"), (100, 100))
    os.utime(tmp_path / ("b" * 64 + ".erofs"), (50, 50))

    async def fetch(digest: str, dest: Path) -> None:
        raise AssertionError("nothing to fetch")

    cache = ImageCache(tmp_path, budget=4096, fetch=fetch, before_evict=lambda d: None)
    cache.scan()
    assert not (tmp_path / ("c" * 64 + ".erofs.part")).exists()
    assert cache.evict() == [D2]  # b was used longest ago


async def test_a_failed_fetch_leaves_no_file_and_can_be_retried(tmp_path):
    calls = []

    async def fetch(digest: str, dest: Path) -> None:
        calls.append(digest)
        dest.write_bytes(b"half")
        if len(calls) == 1:
            raise OSError("store went away")
        dest.write_bytes(b"x" * 4096)

    cache = ImageCache(tmp_path, budget=1 << 20, fetch=fetch, before_evict=lambda d: None)
    with pytest.raises(OSError):
        await cache.acquire(D1)
    assert list(tmp_path.iterdir()) == [] and D1 not in cache.images
    assert (await cache.acquire(D1)).size == 4096


# -- lazy images: chunk arithmetic, their files, and the cache over them ----------------


def test_a_read_touches_exactly_the_chunks_under_it():
    size, chunk = 10 * 1024 + 100, 1024
    assert lazy.chunk_count(size, chunk) == 11 and lazy.chunk_length(10, size, chunk) == 100
    assert lazy.chunks_of(0, 1, size, chunk) == range(0, 1)
    assert lazy.chunks_of(1023, 2, size, chunk) == range(0, 2)
    assert lazy.chunks_of(4096, 4096, size, chunk) == range(4, 8)
    assert lazy.chunks_of(size - 10, 4096, size, chunk) == range(10, 11)  # cut at the end
    assert lazy.chunks_of(size, 10, size, chunk) == range(0) and lazy.chunks_of(5, 0, size, chunk) == range(0)
    assert lazy.present_bytes(bytes([1, 0, 1] + [0] * 7 + [1]), size, chunk) == 2 * 1024 + 100


def _index(digest: str, size: int = 3000, chunk: int = 1024, hashed: bool = True) -> lazy.ChunkIndex:
    count = lazy.chunk_count(size, chunk)
    return lazy.ChunkIndex(digest=digest, size=size, chunk_bytes=chunk, stream="OBJ_layers",
                           subject="$O.layers.C.x", seqs=list(range(1, count + 1)),
                           hashes=bytes(lazy.HASH_BYTES * count) if hashed else b"")


def test_lazy_files_start_sparse_count_what_is_there_and_go_index_first(tmp_path):
    files = lazy.LazyFiles.of(tmp_path, D1)
    files.create(_index(D1))
    assert files.read_index() == _index(D1) and files.data.stat().st_size == 3000
    assert files.usage()[0] == 0 and not files.usage()[2]
    with open(files.map, "r+b") as f:
        f.write(b"\1\0\1")
    present, _, complete = files.usage()
    assert present == 1024 + (3000 - 2048) and not complete
    with open(files.map, "r+b") as f:
        f.write(b"\1\1\1")
    assert files.usage()[2]
    files.index.unlink()  # a removal cut short: the rest is a leftover
    assert sorted(p.name for p in lazy.leftovers(tmp_path)) == sorted([files.data.name, files.map.name])
    files.remove()
    assert list(tmp_path.iterdir()) == []


class FakeLazy:
    """The cache's view of lazy images, on plain files (the real one starts a FUSE daemon)."""

    def __init__(self, root: Path) -> None:
        self.root, self.prepared, self.readied = root, [], 0

    def files(self, digest: str) -> lazy.LazyFiles:
        return lazy.LazyFiles.of(self.root, digest)

    def source(self, digest: str) -> Path:
        return self.root / "fuse" / (digest[7:] + ".erofs")

    async def ready(self) -> None:
        self.readied += 1

    async def prepare(self, digest: str) -> None:
        self.prepared.append(digest)
        self.files(digest).create(_index(digest, size=1 << 20))


async def test_lazy_mode_prepares_instead_of_fetching_and_a_restart_finds_the_images(tmp_path):
    async def fetch(digest: str, dest: Path) -> None:
        raise AssertionError("lazy mode fetches no whole image")

    fake = FakeLazy(tmp_path)
    cache = ImageCache(tmp_path, budget=1 << 30, fetch=fetch, before_evict=lambda d: None, lazy=fake, fetch_mode="lazy")
    image = await cache.acquire(D1)
    assert fake.prepared == [D1] and image.lazy and not image.complete and image.path == fake.source(D1)
    assert image.size == 1 << 20 and image.fetched_bytes == 0 and image.disk_bytes < 1 << 16
    with open(fake.files(D1).data, "r+b") as f:  # what the daemon does for chunk 2
        f.seek(2048)
        f.write(b"x" * 1024)
    with open(fake.files(D1).map, "r+b") as f:
        f.seek(2)
        f.write(b"\1")
    cache.refresh()
    assert image.fetched_bytes == image.written_bytes == 1024

    again = ImageCache(tmp_path, budget=1 << 30, fetch=fetch, before_evict=lambda d: None, lazy=fake, fetch_mode="full")
    again.scan()
    found = again.images[D1]
    assert found.lazy and found.fetched_bytes == 1024 and (await again.acquire(D1)) is found  # kept lazy
    assert fake.readied >= 2  # the daemon is made sure of on every use
    again.unpin(D1)
    again.drop(D1)
    assert list(p for p in tmp_path.iterdir() if p.is_file()) == []


async def test_a_lazy_index_cached_before_chunk_hashes_is_dropped_at_restart(tmp_path):
    """Its unfetched chunks could never pass a check; the next use prepares the image again."""
    async def fetch(digest: str, dest: Path) -> None:
        raise AssertionError("lazy mode fetches no whole image")

    fake = FakeLazy(tmp_path)
    fake.files(D1).create(_index(D1, size=1 << 20, hashed=False))  # as an older layer-cache left it
    fake.files(D2).create(_index(D2, size=1 << 20))
    again = ImageCache(tmp_path, budget=1 << 30, fetch=fetch, before_evict=lambda d: None, lazy=fake, fetch_mode="lazy")
    again.scan()
    assert D1 not in again.images and D2 in again.images
    assert not fake.files(D1).index.exists()


def test_an_overlays_lower_layers_read_alike_from_either_way_of_mounting_it():
    from services.layer_cache.mounts import parse_options
    listed = parse_options("rw,lowerdir=/m/c:/m/b:/m/a,upperdir=/s/upper,workdir=/s/work")
    one_by_one = parse_options("rw,lowerdir+=/m/c,lowerdir+=/m/b,lowerdir+=/m/a,upperdir=/s/upper,workdir=/s/work")
    assert listed == one_by_one and one_by_one["lowerdir"] == "/m/c:/m/b:/m/a"


# -- the fetched packages a node keeps ----------------------------------------------------

def test_the_package_cache_drops_its_oldest_packages_down_to_its_bound(tmp_path):
    for age, name in enumerate(["newest", "middle", "oldest"]):
        deb = tmp_path / f"{name}.deb"
        deb.write_bytes(b"x" * 100)
        os.utime(deb, (1000 - age, 1000 - age))
    (tmp_path / "partial.txt").write_bytes(b"y" * 1000)  # not a package: never counted nor removed
    assert prune_debs(tmp_path, keep_bytes=250) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["middle.deb", "newest.deb", "partial.txt"]
    assert prune_debs(tmp_path, keep_bytes=250) == 0
    assert prune_debs(tmp_path, keep_bytes=0) == 2 and [p.name for p in tmp_path.iterdir()] == ["partial.txt"]

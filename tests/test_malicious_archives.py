"""Hostile image archives through the real import paths (`Layers.build_tar` and
`Layers.import_image` → layer-cache → unpack).

Each archive is built here with tarfile and submitted to the session platform's layer-cache.
One that points out of the tree or holds a device node is refused with a typed error and
changes nothing: no layer recorded, no image stored, no build directory left, nothing written
outside. What images legitimately hold (absolute symlinks, setuid bits) is built, but written
through a symlink nothing lands outside the root, and setuid/setgid bits do not survive.
An image import also refuses a blob whose bytes do not match its digest, a layer whose content
does not match its diff id, and a layer that unpacks past the import's byte limit (a bomb),
with nothing stored even when the layers before the bad one were fine.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import secrets
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers
from schemas.layers import DIFF_BUCKET, OBJECT_BUCKET
from tests.kernel import require
from tests.oci_archives import Image

Member = tuple[tarfile.TarInfo, bytes | None]


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _entry(name: str, kind: bytes, **fields: object) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in fields.items():
        setattr(info, k, v)
    return info, None


def _tar(members: list[Member]) -> bytes:
    """A plain root tar: a normal /etc first, then the members under test."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in [_entry("etc", tarfile.DIRTYPE, mode=0o755), _file("etc/os-release", b"ID=test\n"), *members]:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _docker_save(layer: bytes) -> bytes:
    """A `docker save` archive of one layer: the hostile member sits inside an image layer."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("l1/layer.tar", layer),
                           ("manifest.json", json.dumps([{"Config": "c.json", "Layers": ["l1/layer.tar"]}]).encode()),
                           ("c.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _climb(outside: Path) -> str:
    return "../" * 12 + str(outside).lstrip("/")


# name → the hostile members, given the directory outside the tree they aim at
REFUSED: dict[str, Callable[[Path], list[Member]]] = {
    "dotdot-name": lambda out: [_file(f"{_climb(out)}/dotdot")],
    "dotdot-inside-name": lambda out: [_file(f"etc/../../{_climb(out)}/nested")],
    "absolute-name": lambda out: [_file(f"{out}/absolute")],
    "hardlink-climbing": lambda out: [_entry("etc/passwd-link", tarfile.LNKTYPE, linkname="../" * 12 + "etc/hostname")],
    "hardlink-absolute": lambda out: [_entry("etc/hosts-link", tarfile.LNKTYPE, linkname="/etc/hosts")],
    "symlink-climbing": lambda out: [_entry("etc/up", tarfile.SYMTYPE, linkname=_climb(out)),
                                     _file("etc/up/through-relative")],
    "block-device": lambda out: [_entry("disk", tarfile.BLKTYPE, devmajor=8, devminor=0, mode=0o666)],
    "char-device": lambda out: [_entry("mem", tarfile.CHRTYPE, devmajor=1, devminor=1, mode=0o666)],
}


@pytest.fixture(scope="module")
def kernel():
    require(os.geteuid() == 0, "the layer-cache mounts and builds as root")


@pytest.fixture
def outside(tmp_path):
    """An empty directory out of every build tree: whatever an archive aims at it must not land."""
    path = tmp_path / f"outside-{secrets.token_hex(4)}"
    path.mkdir()
    return path


async def _stored_images(fleet) -> set[str]:
    bucket = await fleet.bus.js.object_store(OBJECT_BUCKET)
    try:
        return {o.name for o in await bucket.list()}
    except Exception as exc:  # nats-py raises NotFoundError for an empty bucket
        if type(exc).__name__ == "NotFoundError":
            return set()
        raise


def _build_dirs(platform) -> list[str]:
    builds = platform.data_dir / "layer-cache" / "build"
    return sorted(os.listdir(builds)) if builds.exists() else []


@pytest.mark.parametrize("wrapped", [False, True], ids=["root-tar", "docker-layer"])
@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_an_archive_pointing_out_of_the_tree_is_refused_and_changes_nothing(
        kernel, fleet, platform, tmp_path, outside, case, wrapped):
    layers = Layers(fleet.bus)
    archive = tmp_path / "hostile.tar"
    raw = _tar(REFUSED[case](outside))
    archive.write_bytes(_docker_save(raw) if wrapped else raw)
    images, host_hosts = await _stored_images(fleet), Path("/etc/hosts").stat()
    name = f"hostile-{case}-{secrets.token_hex(3)}"

    with pytest.raises(errors.InvalidRequest) as refused:
        await layers.build_tar(name, archive)

    assert "unpacking the archive" in str(refused.value) and "Traceback" not in str(refused.value)
    with pytest.raises(errors.NotFound):
        await layers.get(name)
    assert not [layer for layer in await layers.list() if layer.name == name]
    assert await _stored_images(fleet) == images, "a refused archive stores no image"
    assert not _build_dirs(platform), "a refused build leaves its work directory behind"
    assert not list(outside.iterdir()), f"the archive wrote outside the tree: {list(outside.iterdir())}"
    assert Path("/etc/hosts").stat().st_nlink == host_hosts.st_nlink


async def test_writes_through_an_absolute_symlink_stay_inside_the_root(kernel, fleet, platform, tmp_path, outside):
    """`escape -> /etc`, then `escape/NAME`: in the builder's chroot it lands in the root's /etc,
    never the host's; a member through a symlink to a place the root lacks is refused."""
    layers = Layers(fleet.bus)
    planted = f"sandfleet-through-{secrets.token_hex(4)}"
    archive = tmp_path / "symlink.tar"
    archive.write_bytes(_tar([_entry("escape", tarfile.SYMTYPE, linkname="/etc"),
                              _file(f"escape/{planted}", b"inside"),
                              _entry("etc/abs", tarfile.SYMTYPE, linkname="/etc/os-release")]))
    name = f"symlinked-{secrets.token_hex(3)}"
    await layers.build_tar(name, archive)
    try:
        assert not os.path.lexists(f"/etc/{planted}"), "a member written through an absolute symlink reached the host"
        rootfs = await layers.compose(platform.node_id, f"sb-symlink{secrets.token_hex(3)}", [name])
        root = platform.roots_path(rootfs.path)
        try:
            assert os.readlink(root / "escape") == "/etc"  # kept as it is: it resolves in the sandbox's root
            assert (root / "etc" / planted).read_bytes() == b"inside"
            assert os.readlink(root / "etc" / "abs") == "/etc/os-release"
        finally:
            assert await layers.release(platform.node_id, rootfs.sandbox_id)
    finally:
        await layers.remove(name)

    dangling = tmp_path / "dangling.tar"
    dangling.write_bytes(_tar([_entry("away", tarfile.SYMTYPE, linkname=str(outside)), _file("away/through")]))
    with pytest.raises(errors.InvalidRequest):
        await layers.build_tar(f"dangling-{secrets.token_hex(3)}", dangling)
    assert not list(outside.iterdir()) and not _build_dirs(platform)


async def test_setuid_and_setgid_bits_do_not_survive_an_import(kernel, fleet, platform, tmp_path, outside):
    layers = Layers(fleet.bus)
    archive = tmp_path / "setuid.tar"
    archive.write_bytes(_docker_save(_tar([
        _entry("bin", tarfile.DIRTYPE, mode=0o755),
        _file("bin/su", b"#!/bin/sh\n", mode=0o4755),
        _file("bin/wall", b"#!/bin/sh\n", mode=0o2755),
        _entry("var", tarfile.DIRTYPE, mode=0o755),
        _entry("var/mail", tarfile.DIRTYPE, mode=0o2775),  # a setgid directory passes its group on only
        _entry("tmp", tarfile.DIRTYPE, mode=0o1777),
    ])))
    name = f"setuid-{secrets.token_hex(3)}"
    await layers.build_tar(name, archive)
    try:
        rootfs = await layers.compose(platform.node_id, f"sb-setuid{secrets.token_hex(3)}", [name])
        root = platform.roots_path(rootfs.path)
        try:
            assert stat.S_IMODE((root / "bin" / "su").stat().st_mode) == 0o755
            assert stat.S_IMODE((root / "bin" / "wall").stat().st_mode) == 0o755
            assert stat.S_IMODE((root / "var" / "mail").stat().st_mode) == 0o2775
            assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
        finally:
            assert await layers.release(platform.node_id, rootfs.sandbox_id)
    finally:
        await layers.remove(name)


# -- `layer import`: one EROFS layer per OCI layer, every byte checked ------------------------


async def _diff_keys(fleet) -> set[str]:
    """The layer-cache's diff-id map (what a later import would reuse)."""
    kv = await fleet.bus.js.key_value(DIFF_BUCKET)
    try:
        return set(await kv.keys())
    except Exception as exc:  # nats-py raises NoKeysError for an empty bucket
        if type(exc).__name__ == "NoKeysError":
            return set()
        raise


async def _refused_import(fleet, platform, archive: Path, error: type[errors.SandfleetError], match: str,
                          **options: object) -> str:
    """Import `archive`, expect a typed refusal, and check nothing was stored or recorded."""
    layers = Layers(fleet.bus)
    images, diffs = await _stored_images(fleet), await _diff_keys(fleet)
    name = f"hostile-img-{secrets.token_hex(3)}"
    with pytest.raises(error) as refused:
        await layers.import_image(name, archive, **options)
    assert match in str(refused.value) and "Traceback" not in str(refused.value), str(refused.value)
    with pytest.raises(errors.NotFound):
        await layers.get(name)
    assert await _stored_images(fleet) == images, "a refused image stores no layer"
    assert await _diff_keys(fleet) == diffs, "a refused image maps no diff id"
    assert not _build_dirs(platform), "a refused import leaves its work directory behind"
    return str(refused.value)


def _good_layer() -> bytes:
    return _tar([_file("etc/motd", b"fine\n")])


@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_an_image_layer_pointing_out_of_the_tree_is_refused_and_changes_nothing(
        kernel, fleet, platform, tmp_path, outside, case):
    # A good first layer, the hostile one second: the first must not be stored either.
    archive = Image([_good_layer(), _tar(REFUSED[case](outside))]).oci_archive(tmp_path / "hostile.tar")
    await _refused_import(fleet, platform, archive, errors.InvalidRequest, "unpacking the archive")
    assert not list(outside.iterdir()), f"the archive wrote outside the tree: {list(outside.iterdir())}"


async def test_a_layer_whose_bytes_do_not_match_its_digest_is_refused(kernel, fleet, platform, tmp_path):
    image = Image([_good_layer(), _tar([_file("etc/app", b"the real bytes\n")])])
    swapped = gzip.compress(_tar([_file("etc/app", b"other bytes!!!!\n")]), mtime=0)
    archive = image.oci_archive(tmp_path / "swapped.tar", tamper={1: swapped})
    await _refused_import(fleet, platform, archive, errors.InvalidRequest, "does not match its digest")


async def test_a_layer_whose_content_does_not_match_its_diff_id_is_refused(kernel, fleet, platform, tmp_path):
    """A `docker save` layer names no digest of its own: its diff id in the config is the check."""
    archive = Image([_good_layer(), _tar([_file("etc/app", b"x\n")])]).docker_save(tmp_path / "saved.tar")
    with tarfile.open(archive) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    files["l1/layer.tar"] = _tar([_file("etc/app", b"y\n")])
    with tarfile.open(archive, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    await _refused_import(fleet, platform, archive, errors.InvalidRequest, "does not match its diff id")


async def test_a_decompression_bomb_is_stopped_at_the_limit_and_stores_nothing(kernel, fleet, platform, tmp_path):
    """64 MiB of zeros in one file gzips to ~64 KiB; the import's limit is 8 MiB."""
    bomb = _tar([_file("zeros", bytes(64 << 20))])
    archive = Image([_good_layer(), bomb]).oci_archive(tmp_path / "bomb.tar")
    assert archive.stat().st_size < 1 << 20
    message = await _refused_import(fleet, platform, archive, errors.InvalidRequest, "decompression limit",
                                    max_unpacked_bytes=8 << 20)
    assert str(8 << 20) in message


async def test_a_manifest_naming_a_missing_or_mismatched_config_is_refused(kernel, fleet, platform, tmp_path):
    image = Image([_good_layer()])
    files = image.layout_files()
    config_name = next(n for n, d in files.items() if n.startswith("blobs/") and b'"diff_ids"' in d)
    files[config_name] = files[config_name].replace(b'"amd64"', b'"AMD64"')
    archive = tmp_path / "config.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    await _refused_import(fleet, platform, archive, errors.InvalidRequest, "does not match its digest")


async def test_setuid_bits_in_an_image_layer_do_not_survive(kernel, fleet, platform, tmp_path):
    layers = Layers(fleet.bus)
    archive = Image([_tar([_entry("bin", tarfile.DIRTYPE, mode=0o755),
                           _file("bin/su", b"#!/bin/sh\n", mode=0o4755)])]).oci_archive(tmp_path / "suid.tar")
    name = f"setuid-img-{secrets.token_hex(3)}"
    await layers.import_image(name, archive)
    try:
        rootfs = await layers.compose(platform.node_id, f"sb-suidimg{secrets.token_hex(3)}", [name])
        try:
            assert stat.S_IMODE((platform.roots_path(rootfs.path) / "bin" / "su").stat().st_mode) == 0o755
        finally:
            assert await layers.release(platform.node_id, rootfs.sandbox_id)
    finally:
        await layers.remove(name)

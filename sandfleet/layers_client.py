"""The layer SDK: build, list, get, remove, push and pull layers; compose and release roots on a node.

A source that lives on the caller's machine (a directory, an image archive) travels as an
upload to the Object Store bucket `layer-uploads`; whichever node's layer-cache takes the
build fetches it and deletes it (uploads nobody builds from expire after an hour).
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

import msgspec
import nats.js.errors

from sandfleet import errors, oci_archive
from sandfleet.bus import Bus
from sandfleet.config import nats_url
from schemas import layers as schema
from schemas import node as node_schema
from schemas.layers import (
    BuildReply,
    BuildRequest,
    BuildSource,
    CacheListing,
    DirSource,
    ImageConfig,
    KnownDiffsReply,
    KnownDiffsRequest,
    Layer,
    Rootfs,
    TarSource,
)

BUILD_TIMEOUT_S = 600.0
DEBIAN_TIMEOUT_S = 1800.0
PIP_TIMEOUT_S = 1800.0
TRANSFER_TIMEOUT_S = 1800.0
IMPORT_TIMEOUT_S = 1800.0
# `docker.io/library/debian:12`, `ghcr.io/o/r@sha256:...`, `debian:12`: a name with a registry,
# a tag or a digest, which is not a path on this machine
REGISTRY_REF = re.compile(r"^[a-z0-9][a-z0-9._\-]*(:[0-9]+)?(/[a-z0-9._\-]+)*(:[A-Za-z0-9_.\-]+|@sha256:[0-9a-f]{64})$")


def tar_directory(src: Path, out: Path) -> None:
    """A pax tar of `src` (as `.`), keeping owners, modes, links, devices and extended attributes."""

    def with_xattrs(info: tarfile.TarInfo) -> tarfile.TarInfo:
        path = src / info.name
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError:
            names = []
        for name in names:
            value = os.getxattr(path, name, follow_symlinks=False)
            info.pax_headers[f"SCHILY.xattr.{name}"] = value.decode("utf-8", "surrogateescape")
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(src, arcname=".", filter=with_xattrs)


class Layers:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    # -- building ---------------------------------------------------------------------

    async def build_dir(self, name: str, path: str | Path, *, on: str | None = None, tags: Iterable[str] = (),
                        compression: str = "lz4", timeout: float = BUILD_TIMEOUT_S) -> BuildReply:
        # Symlinks above it are not resolved: a path through /proc/<pid>/fd (a directory of another
        # mount namespace: a checkpoint's upper dir in the node's roots namespace) means it as given.
        src = Path(os.path.abspath(path))
        if src.is_symlink():
            src = src.resolve()  # a link to the directory: tar what it names, not the link
        if not src.is_dir():
            raise errors.InvalidRequest(f"{src} is not a directory")
        with tempfile.TemporaryDirectory(prefix="sandfleet-layer-") as tmp:
            archive = Path(tmp) / "dir.tar"
            await asyncio.to_thread(tar_directory, src, archive)
            upload = await self._upload(archive)
        return await self._build(name, DirSource(upload=upload, path=str(src)), on, tags, compression, timeout)

    async def build_tar(self, name: str, path: str | Path, *, on: str | None = None, tags: Iterable[str] = (),
                        compression: str = "lz4", timeout: float = BUILD_TIMEOUT_S) -> BuildReply:
        archive = Path(path)
        if not archive.is_file():
            raise errors.InvalidRequest(f"{archive} is not a file")
        upload = await self._upload(archive)
        return await self._build(name, TarSource(upload=upload, filename=archive.name), on, tags, compression, timeout)

    async def import_image(self, name: str, source: str | Path, *, tags: Iterable[str] = (),
                           compression: str = "lz4", max_unpacked_bytes: int = 0,
                           timeout: float = IMPORT_TIMEOUT_S) -> BuildReply:
        """An OCI image as a named stack, one layer per OCI layer (shared by diff id with every
        other image), its config applied to sandboxes over it. `source`: an OCI archive, a
        `docker save` archive, or an OCI layout directory. A registry reference is refused: no
        node here reaches a registry; `skopeo copy docker://REF oci-archive:FILE` where one does,
        then import FILE. The reply's `layer.config.not_applied` lists what the image asks and
        sandfleet does not do."""
        text = str(source)
        path = Path(source)
        if not path.exists() and ("://" in text or REGISTRY_REF.match(text)):
            raise errors.Unsupported(f"{text}: pulling from a registry is not offered (no node reaches one); "
                                     f"`skopeo copy docker://{text.removeprefix('docker://')} oci-archive:image.tar` "
                                     "on a machine that does, then import image.tar")
        if path.is_dir():
            if not (path / "oci-layout").is_file() or not (path / "index.json").is_file():
                raise errors.InvalidRequest(f"{path} is not an OCI layout directory (no oci-layout and index.json)")
        elif not path.is_file():
            raise errors.InvalidRequest(f"{path}: no such file or directory")
        with tempfile.TemporaryDirectory(prefix="sandfleet-image-") as tmp:
            archive = path
            if path.is_dir():
                archive = Path(tmp) / "layout.tar"
                await asyncio.to_thread(tar_directory, path.resolve(), archive)
            upload = await self._upload(await self._without_known_layers(archive, Path(tmp)))
        source_ = {"type": "image", "upload": upload, "filename": path.name, "max_unpacked_bytes": max_unpacked_bytes}
        return await self._build(name, source_, None, tags, compression, timeout)

    async def _without_known_layers(self, archive: Path, tmp: Path) -> Path:
        """The archive, or a copy of it without the layer blobs the store already has (by diff id):
        a second image over a shared base sends only its own layers."""
        try:
            image = await asyncio.to_thread(oci_archive.read_archive, archive)
        except (oci_archive.ImageError, tarfile.TarError, OSError):
            return archive  # the layer-cache refuses it, saying why
        diff_ids = list(dict.fromkeys(layer.diff_id for layer in image.layers))
        try:
            known = set((await self.bus.request(schema.KNOWN_DIFFS, KnownDiffsRequest(diff_ids=diff_ids),
                                                KnownDiffsReply, timeout=30)).known)
        except errors.SandfleetError:  # a layer-cache of before this request: send it all
            return archive
        present = [layer for layer in image.layers if layer.diff_id in known]
        if not present:
            return archive
        thin = tmp / "without-known-layers.tar"
        await asyncio.to_thread(oci_archive.copy_without, archive, thin, present)
        return thin

    async def stack(self, name: str, layers: list[str], config: ImageConfig | None = None, *,
                    tags: Iterable[str] = ()) -> BuildReply:
        """Name layers already in the store (bottom first; an image name stands for its stack)
        as one stack, with an image config: what a Dockerfile build records."""
        source = {"type": "stack", "layers": list(layers), "config": msgspec.to_builtins(config or ImageConfig())}
        return await self._build(name, source, None, tags, "lz4", BUILD_TIMEOUT_S)

    async def build_debian(self, name: str, packages: Iterable[str] = (), *, suite: str = "",
                           variant: str = "minbase", tags: Iterable[str] = (), compression: str = "lz4",
                           timeout: float = DEBIAN_TIMEOUT_S) -> BuildReply:
        source = {"type": "debian", "packages": list(packages), "suite": suite, "variant": variant}
        return await self._build(name, source, None, tags, compression, timeout)

    async def build_pip(self, name: str, on: str, packages: Iterable[str] = (), *, requirements: str = "",
                        tags: Iterable[str] = (), compression: str = "lz4",
                        timeout: float = PIP_TIMEOUT_S) -> BuildReply:
        """A Python environment over `on`: `pip install` of `packages` and of `requirements` (the
        text of a requirements file), run with the Python of `on`'s layers; only what it writes
        becomes the layer."""
        source = {"type": "pip", "packages": list(packages), "requirements": requirements}
        return await self._build(name, source, on, tags, compression, timeout)

    async def _build(self, name: str, source: BuildSource | dict, on: str | None, tags: Iterable[str],
                     compression: str, timeout: float) -> BuildReply:
        raw = {"name": name, "source": msgspec.to_builtins(source), "on": on, "tags": list(tags),
               "compression": compression}
        try:
            req = msgspec.convert(raw, BuildRequest)
        except msgspec.ValidationError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        return await self.bus.request(schema.BUILD, req, BuildReply, timeout=timeout)

    async def _upload(self, path: Path) -> str:
        try:
            bucket = await self.bus.js.object_store(schema.UPLOAD_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            raise errors.NoResponders("no layer-cache has run on this bus (its upload bucket is missing)") from None
        name = "up-" + secrets.token_hex(12)
        with open(path, "rb") as f:
            await bucket.put(name, f)
        return name

    # -- between stores ---------------------------------------------------------------

    async def push(self, ref: str, url: str, *, timeout: float = TRANSFER_TIMEOUT_S) -> schema.TransferReply:
        """Copy a layer (and the images it was built on, where missing) to the store at `url`."""
        return await self.bus.request(schema.PUSH, self._transfer(ref, url), schema.TransferReply, timeout=timeout)

    async def pull(self, ref: str, url: str, *, timeout: float = TRANSFER_TIMEOUT_S) -> schema.TransferReply:
        """Copy a layer (and the images it was built on, where missing) from the store at `url`."""
        return await self.bus.request(schema.PULL, self._transfer(ref, url), schema.TransferReply, timeout=timeout)

    @staticmethod
    def _transfer(ref: str, url: str) -> schema.TransferRequest:
        try:
            return msgspec.convert({"ref": ref, "url": url}, schema.TransferRequest)
        except msgspec.ValidationError as exc:
            raise errors.InvalidRequest(str(exc)) from None

    # -- the catalogue ----------------------------------------------------------------

    async def list(self, name: str | None = None) -> list[Layer]:
        reply = await self.bus.request(schema.LIST, schema.ListRequest(name=name), schema.LayerList, timeout=30)
        return reply.layers

    async def get(self, ref: str) -> Layer:
        return await self.bus.request(schema.GET, schema.GetRequest(ref=ref), Layer)

    async def remove(self, ref: str) -> schema.RemoveReply:
        return await self.bus.request(schema.REMOVE, schema.RemoveRequest(ref=ref), schema.RemoveReply, timeout=60)

    # -- a node's roots and cache -----------------------------------------------------

    async def compose(self, node: str, sandbox_id: str, layers: list[str], *, timeout: float = 120.0) -> Rootfs:
        """The sandbox's root from `layers` (bottom first), composed on `node`."""
        req = schema.ComposeRequest(sandbox_id=sandbox_id, layers=layers)
        return await self.bus.request(node_schema.subject(node, schema.ROOTFS_COMPOSE), req, Rootfs, timeout=timeout)

    async def release(self, node: str, sandbox_id: str, *, timeout: float = 60.0) -> bool:
        req = schema.ReleaseRootfsRequest(sandbox_id=sandbox_id)
        subject = node_schema.subject(node, schema.ROOTFS_RELEASE)
        return (await self.bus.request(subject, req, schema.ReleaseRootfsReply, timeout=timeout)).released

    async def cache(self, node: str) -> CacheListing:
        subject = node_schema.subject(node, schema.CACHE)
        return await self.bus.request(subject, schema.CacheRequest(), CacheListing, timeout=30)

    async def cache_drop(self, node: str) -> schema.CacheDropReply:
        """Empty `node`'s cache of every image no root uses (a cold start, e.g. for a benchmark)."""
        subject = node_schema.subject(node, schema.CACHE_DROP)
        return await self.bus.request(subject, schema.CacheDropRequest(), schema.CacheDropReply, timeout=60)


async def connect(url: str | None = None, *, name: str = "sandfleet-layers") -> Layers:
    """A `Layers` on its own bus connection; `await layers.bus.close()` when done."""
    return Layers(await Bus.connect(nats_url(url), name))


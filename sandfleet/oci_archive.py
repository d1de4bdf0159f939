"""Reading an OCI image from an archive: its layers, checked against their digests, and its config.
The layer-cache's import reads the whole of it; the SDK reads its documents (no layer bytes) to
ask which layers the store has, and sends a copy without them (`copy_without`).

An upload is a tar: an OCI image layout (`oci-layout`, `index.json`, `blobs/`: `skopeo copy ...
oci-archive:`, a layout directory the client tarred, or the newer `docker save`) or a `docker
save` archive (`manifest.json`). Everything in it is the tenant's: each blob's bytes are hashed
against the digest that names it (manifest, config, layers), a layer's uncompressed bytes
against its diff id in the config, and decompression stops at a byte budget, so a bomb costs
at most the budget of disk and is refused. Nothing here writes outside the work directory:
members are read with `extractfile`, never extracted; unpacking a layer's tar is `unpack.py`'s.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from schemas.layers import MAX_STACK, ImageConfig

READ_BYTES = 1 << 20
MAX_JSON_BYTES = 16 << 20  # an index, manifest or config bigger than this is not an image's
HONOURED = ("Env", "WorkingDir", "User", "Entrypoint", "Cmd", "Labels")
ROOT_USERS = ("", "root", "0", "0:0", "root:root", "root:0", "0:root")
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


class ImageError(Exception):
    """The archive is not an image sandfleet takes (malformed, a digest mismatch): the caller's."""


class Unsupported(ImageError):
    """A well-formed image this node cannot take (zstd layers, another architecture)."""


class TooBig(ImageError):
    """Unpacking would pass the byte budget (a decompression bomb, or just too big an image)."""


@dataclass(frozen=True)
class OciLayer:
    member: str  # the blob's member name in the archive
    digest: str  # of the blob as stored ("" where the archive names none: legacy `docker save`)
    diff_id: str  # of the uncompressed tar, from the config
    created_by: str = ""


@dataclass(frozen=True)
class OciImage:
    format: str  # "oci" or "docker"
    layers: list[OciLayer]
    config: ImageConfig


def sha256_hex(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _key(name: str) -> str:
    return posixpath.normpath("/" + name).lstrip("/")


def member_names(outer: tarfile.TarFile) -> dict[str, str]:
    """Normalised member name → the archive's own spelling."""
    return {_key(n): n for n in outer.getnames()}


def _member(outer: tarfile.TarFile, names: dict[str, str], name: str) -> tarfile.TarInfo:
    found = names.get(_key(name))
    if found is None:
        raise ImageError(f"{name} is missing from the archive")
    info = outer.getmember(found)
    if not info.isreg():
        raise ImageError(f"{name} is not a regular file in the archive")
    return info


def _read_json(outer: tarfile.TarFile, names: dict[str, str], name: str, digest: str = "") -> dict | list:
    info = _member(outer, names, name)
    if info.size > MAX_JSON_BYTES:
        raise ImageError(f"{name} is {info.size} bytes: too big for an image document")
    data = outer.extractfile(info).read()  # type: ignore[union-attr]
    if digest and sha256_hex(data) != digest:
        raise ImageError(f"{name} does not match its digest {digest}")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{name} is not JSON: {exc}") from None


def _blob_name(digest: str) -> str:
    algorithm, _, hexdigest = str(digest).partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ImageError(f"unsupported digest {digest!r}")
    return f"blobs/sha256/{hexdigest}"


def read_image(outer: tarfile.TarFile, names: dict[str, str]) -> OciImage:
    if "index.json" in names and "oci-layout" in names:
        return _oci(outer, names)
    if "manifest.json" in names:
        return _docker(outer, names)
    raise ImageError("not an image archive: no index.json + oci-layout (OCI) and no manifest.json (docker save)")


def _oci(outer: tarfile.TarFile, names: dict[str, str]) -> OciImage:
    document = _read_json(outer, names, "index.json")
    for _ in range(3):  # an index may point at an index (multi-platform images)
        manifests = document.get("manifests") if isinstance(document, dict) else None
        if not manifests or not isinstance(manifests, list):
            raise ImageError("the OCI index lists no manifest")
        chosen = next((m for m in manifests if isinstance(m, dict) and _ours((m.get("platform") or {}))), manifests[0])
        digest = chosen.get("digest", "") if isinstance(chosen, dict) else ""
        document = _read_json(outer, names, _blob_name(digest), digest)
        if isinstance(document, dict) and "layers" in document:
            break
    else:
        raise ImageError("the OCI index nests too deeply")
    config_digest = (document.get("config") or {}).get("digest", "")
    config = _read_json(outer, names, _blob_name(config_digest), config_digest)
    descriptors = document["layers"]
    if not isinstance(descriptors, list):
        raise ImageError("the manifest's layers are not a list")
    for d in descriptors:
        if "zstd" in str(d.get("mediaType", "")):
            raise Unsupported("zstd-compressed layers are not supported (this node's Python has no zstd)")
    return _image("oci", config, [(_blob_name(d.get("digest", "")), d.get("digest", "")) for d in descriptors])


def _docker(outer: tarfile.TarFile, names: dict[str, str]) -> OciImage:
    manifest = _read_json(outer, names, "manifest.json")
    if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
        raise ImageError("manifest.json lists no image")
    if len(manifest) > 1:
        raise ImageError(f"manifest.json lists {len(manifest)} images; import an archive of one")
    entry = manifest[0]
    config_name = str(entry.get("Config", ""))
    # A config named by its digest (`<hex>.json`, `blobs/sha256/<hex>`) is checked against it.
    stem = config_name.rsplit("/", 1)[-1].removesuffix(".json")
    config_digest = "sha256:" + stem if len(stem) == 64 else ""
    config = _read_json(outer, names, config_name, config_digest)
    layers = []
    for name in entry.get("Layers") or []:
        stem = str(name).rsplit("/", 1)[-1]
        # `blobs/sha256/<hex>` names its digest; a legacy `<id>/layer.tar` is checked by its diff id alone
        layers.append((str(name), "sha256:" + stem if str(name).startswith("blobs/sha256/") else ""))
    return _image("docker", config, layers)


def _ours(platform: dict) -> bool:
    return platform.get("os", "linux") == "linux" and platform.get("architecture", "amd64") == "amd64"


def _image(fmt: str, config: dict | list, layers: list[tuple[str, str]]) -> OciImage:
    if not isinstance(config, dict):
        raise ImageError("the image config is not an object")
    architecture = config.get("architecture", "amd64")
    if architecture not in ("amd64", ""):
        raise Unsupported(f"the image is for {architecture}; this node runs amd64")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(layers):
        raise ImageError(f"the config lists {len(diff_ids)} diff ids for {len(layers)} layers")
    if not layers:
        raise ImageError("the image has no layers")
    if len(layers) > MAX_STACK:
        raise Unsupported(f"the image has {len(layers)} layers; sandfleet takes {MAX_STACK} at most")
    history = [h.get("created_by", "") for h in config.get("history") or [] if isinstance(h, dict)
               and not h.get("empty_layer")]
    history = history if len(history) == len(layers) else [""] * len(layers)
    for diff_id in diff_ids:
        _blob_name(diff_id)  # a well-formed sha256
    return OciImage(fmt, [OciLayer(member, digest, diff_id, str(created)[:512])
                          for (member, digest), diff_id, created in zip(layers, diff_ids, history)],
                    image_config(config.get("config") or {}))


def image_config(config: dict) -> ImageConfig:
    """What sandfleet applies of an image's `config`, and, in `not_applied`, what it does not."""
    if not isinstance(config, dict):
        raise ImageError("the image's config is not an object")

    def strings(key: str) -> list[str]:
        value = config.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ImageError(f"the image's {key} is not a list of strings")
        return value

    labels = config.get("Labels") or {}
    if not isinstance(labels, dict):
        raise ImageError("the image's Labels are not an object")
    user = str(config.get("User") or "")
    not_applied = [f"{key}: {json.dumps(value, sort_keys=True)}"[:4096]
                   for key, value in sorted(config.items()) if key not in HONOURED and value not in (None, "", [], {})]
    return ImageConfig(env=strings("Env"), working_dir=str(config.get("WorkingDir") or ""), user=user,
                       entrypoint=strings("Entrypoint"), cmd=strings("Cmd"),
                       labels={str(k): str(v) for k, v in labels.items()}, not_applied=not_applied[:256])


# -- a layer's bytes -------------------------------------------------------------------


def check_blob(outer: tarfile.TarFile, names: dict[str, str], layer: OciLayer) -> None:
    """Hash the blob as stored against the digest that names it (no decompression)."""
    if not layer.digest:
        return
    with _open_blob(outer, names, layer.member) as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if "sha256:" + digest != layer.digest:
        raise ImageError(f"layer {layer.member} does not match its digest {layer.digest}")


def extract_layer(outer: tarfile.TarFile, names: dict[str, str], layer: OciLayer, dest: Path, budget: int) -> int:
    """Write the layer's uncompressed tar to `dest`, checking its digest and diff id; at most
    `budget` bytes are written (TooBig past it). Returns the bytes written."""
    stored, plain = hashlib.sha256(), hashlib.sha256()
    written = 0
    with _open_blob(outer, names, layer.member) as f, open(dest, "wb") as out:
        head = f.read(READ_BYTES)
        if head.startswith(ZSTD_MAGIC):
            raise Unsupported(f"layer {layer.member} is zstd-compressed (not supported)")
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 16) if head.startswith(GZIP_MAGIC) else None
        chunk = head
        while chunk:
            stored.update(chunk)
            pending = chunk
            while pending:
                if inflate is None:
                    data, pending = pending, b""
                else:
                    # max_length bounds what one call may produce: a bomb never sits in memory whole.
                    data = inflate.decompress(pending, READ_BYTES)
                    pending = inflate.unconsumed_tail
                    if inflate.eof and inflate.unused_data:  # another gzip member follows
                        pending, inflate = inflate.unused_data + pending, zlib.decompressobj(zlib.MAX_WBITS | 16)
                written += len(data)
                if written > budget:
                    raise TooBig(f"layer {layer.member} unpacks past the {budget} bytes left of the limit")
                plain.update(data)
                out.write(data)
            chunk = f.read(READ_BYTES)
        if inflate is not None:
            while not inflate.eof and (data := inflate.decompress(b"", READ_BYTES)):
                written += len(data)
                if written > budget:
                    raise TooBig(f"layer {layer.member} unpacks past the {budget} bytes left of the limit")
                plain.update(data)
                out.write(data)
    if layer.digest and "sha256:" + stored.hexdigest() != layer.digest:
        raise ImageError(f"layer {layer.member} does not match its digest {layer.digest}")
    if "sha256:" + plain.hexdigest() != layer.diff_id:
        raise ImageError(f"layer {layer.member} does not match its diff id {layer.diff_id}")
    return written


def has_blob(names: dict[str, str], layer: OciLayer) -> bool:
    return _key(layer.member) in names


def read_archive(path: Path) -> OciImage:
    """The image documents of the archive at `path` (its layers' bytes are not read)."""
    with tarfile.open(path, "r:") as outer:
        return read_image(outer, member_names(outer))


def copy_without(source: Path, dest: Path, layers: list[OciLayer]) -> None:
    """Copy the archive, leaving out these layers' blobs (what the receiving store already has)."""
    dropped = {_key(layer.member) for layer in layers}
    with tarfile.open(source, "r:") as src, tarfile.open(dest, "w:", format=tarfile.PAX_FORMAT) as out:
        for info in src:
            if _key(info.name) in dropped:
                continue
            out.addfile(info, src.extractfile(info) if info.isreg() else None)


def _open_blob(outer: tarfile.TarFile, names: dict[str, str], member: str) -> IO[bytes]:
    f = outer.extractfile(_member(outer, names, member))
    assert f is not None  # _member returned a regular file
    return f

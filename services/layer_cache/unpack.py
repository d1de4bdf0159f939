"""Unpack a build source into a directory, as its own process chrooted into that directory.

`python -m services.layer_cache.unpack --dest DIR --mode dir|image|layer [--keep-whiteouts] [--max-bytes N] TAR`

`dir`: a tar of a directory, taken literally. `image`: a `docker save` archive (manifest.json),
an OCI image layout (index.json), or a plain root tar; image layers are applied bottom
first with the OCI whiteout rules (`.wh.NAME` deletes NAME from the layers below, `.wh..wh..opq`
empties its directory of them). With `--keep-whiteouts` (a layer built on another layer)
they also become overlayfs whiteouts (a 0:0 character device, a `trusted.overlay.opaque`
directory), so they hide files of the layers under it when composed. `layer`: one OCI layer's
tar into an empty directory, to become an EROFS layer of its own: its whiteouts become overlay
whiteouts and nothing is deleted (an opaque marker hides the layers below, never its siblings).
`--max-bytes` refuses a tar whose members hold more content than that (sparse files included).

An archive is the tenant's input. A member that names a place out of the tree (an absolute or
`../` name, a hard link to one, a relative symlink that climbs above the root) or a device node
(other than a 0:0 whiteout) refuses the whole archive, as no image tool makes one. Setuid and
setgid bits are dropped: sandboxes run with no_new_privs, so they only ever worked on the host,
where a layer is mounted. The chroot is why this is a process: absolute symlinks are normal in
images, and a member written through one, or through a symlink the archive made, lands inside
the directory all the same. Prints one JSON line: {"format": ..., "layers": N}.
"""

from __future__ import annotations

import argparse
import bz2  # noqa: F401  (compression modules are imported before the chroot hides them)
import gzip  # noqa: F401
import json
import lzma  # noqa: F401
import os
import posixpath
import shutil
import stat
import sys
import tarfile
import traceback
from collections.abc import Iterator

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
XATTR_PAX = "SCHILY.xattr."


class UnpackError(Exception):
    pass


def normalise(name: str) -> str:
    """A member name as a path relative to the root ("" for the root itself)."""
    return posixpath.normpath("/" + name).lstrip("/")


def _escapes(name: str) -> bool:
    """Whether a member name or hard-link target leaves the tree: absolute, or `..` above the root."""
    return name.startswith("/") or posixpath.normpath(name).split("/")[0] == ".."


def check_member(member: tarfile.TarInfo) -> None:
    """Refuse a member that points out of the tree or is a device; see the module's docstring."""
    if _escapes(member.name):
        raise UnpackError(f"member {member.name!r} points out of the root")
    if member.islnk() and _escapes(member.linkname):
        raise UnpackError(f"hard link {member.name!r} -> {member.linkname!r} points out of the root")
    if member.issym() and not member.linkname.startswith("/"):
        parent = posixpath.dirname(posixpath.normpath(member.name))
        if _escapes(posixpath.join(parent, member.linkname)):
            raise UnpackError(f"symlink {member.name!r} -> {member.linkname!r} climbs out of the root")
    if (member.ischr() or member.isblk()) and not (member.ischr() and member.devmajor == member.devminor == 0):
        raise UnpackError(f"device node {member.name!r} in the archive")
    if member.isreg():  # a setgid directory only passes its group on; a file's bits are privileges
        member.mode &= ~(stat.S_ISUID | stat.S_ISGID)


def classify(name: str) -> tuple[str, str]:
    """("opaque", dir) | ("whiteout", path it deletes) | ("entry", path) for a member name."""
    path = normalise(name)
    parent, _, base = path.rpartition("/")
    if base == OPAQUE:
        return "opaque", parent
    if base.startswith(WHITEOUT):
        return "whiteout", posixpath.join(parent, base[len(WHITEOUT):])
    return "entry", path


# -- finding the layers of an image archive -------------------------------------------


def _json(outer: tarfile.TarFile, name: str) -> dict | list:
    f = outer.extractfile(name)
    if f is None:
        raise UnpackError(f"{name} is not a file in the archive")
    return json.load(f)


def image_layers(outer: tarfile.TarFile) -> tuple[str, list[str]]:
    """(format, member names of the layer tars bottom first); ("rootfs", []) for a plain root tar."""
    names = {normalise(n): n for n in outer.getnames()}
    if "manifest.json" in names:
        manifest = _json(outer, names["manifest.json"])
        if not isinstance(manifest, list) or not manifest:
            raise UnpackError("manifest.json lists no image")
        return "docker", [names[normalise(p)] for p in manifest[0]["Layers"]]
    if "index.json" in names and "oci-layout" in names:
        return "oci", _oci_layers(outer, names, _json(outer, names["index.json"]))
    return "rootfs", []


def _oci_layers(outer: tarfile.TarFile, names: dict[str, str], index: dict) -> list[str]:
    def blob(digest: str) -> str:
        algorithm, _, hexdigest = digest.partition(":")
        return names[f"blobs/{algorithm}/{hexdigest}"]

    for _ in range(3):  # an index may point at an index (multi-platform images)
        manifests = index.get("manifests") or []
        if not manifests:
            raise UnpackError("the OCI index lists no manifest")
        chosen = next((m for m in manifests if (m.get("platform") or {}).get("architecture") in ("amd64", None)
                       and (m.get("platform") or {}).get("os", "linux") == "linux"), manifests[0])
        document = _json(outer, blob(chosen["digest"]))
        if "layers" in document:
            for layer in document["layers"]:
                if "zstd" in layer.get("mediaType", ""):
                    raise UnpackError("zstd-compressed layers are not supported")
            return [blob(layer["digest"]) for layer in document["layers"]]
        index = document
    raise UnpackError("the OCI index nests too deeply")


# -- applying a layer (inside the chroot) ---------------------------------------------


def _remove(path: str) -> None:
    if not os.path.lexists(path):
        return
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _empty_dir(path: str) -> None:
    if not os.path.isdir(path) or os.path.islink(path):
        _remove(path)
        os.makedirs(path, exist_ok=True)
        return
    for name in os.listdir(path):
        _remove(os.path.join(path, name))


def apply_layer(layer: tarfile.TarFile, whiteouts: bool, keep_whiteouts: bool, own_layer: bool = False,
                max_bytes: int = 0) -> None:
    entries: list[tarfile.TarInfo] = []
    members = layer.getmembers()
    for member in members:  # all checked before anything is written
        check_member(member)
    if max_bytes and (content := sum(m.size for m in members if m.isreg())) > max_bytes:
        raise UnpackError(f"the layer holds {content} bytes of files, past the limit of {max_bytes}")
    for member in members:
        kind, path = classify(member.name) if whiteouts else ("entry", normalise(member.name))
        target = "/" + path
        if kind == "opaque" and own_layer:
            os.makedirs(target, exist_ok=True)
            os.setxattr(target, OPAQUE_XATTR, b"y")
        elif kind == "opaque":
            _empty_dir(target)
            if keep_whiteouts:
                os.setxattr(target, OPAQUE_XATTR, b"y")
        elif kind == "whiteout":
            _remove(target)
            if keep_whiteouts:
                os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
                os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        else:
            member.name = path or "."
            entries.append(member)
    layer.extractall("/", members=_replacing(entries), numeric_owner=True)
    for member in entries:
        if member.issym():  # tarfile leaves a symlink's mtime at "now": the image would differ every build
            os.utime("/" + member.name, (member.mtime, member.mtime), follow_symlinks=False)
        for key, value in member.pax_headers.items():
            if key.startswith(XATTR_PAX):
                os.setxattr("/" + member.name, key[len(XATTR_PAX):],
                            value.encode("utf-8", "surrogateescape"), follow_symlinks=False)


def _replacing(entries: list[tarfile.TarInfo]) -> Iterator[tarfile.TarInfo]:
    """Each member, after removing what it replaces (tarfile would write through a symlink)."""
    for member in entries:
        target = "/" + member.name
        if member.name != "." and os.path.lexists(target):
            is_dir = stat.S_ISDIR(os.lstat(target).st_mode)
            if not (is_dir and member.isdir()):
                _remove(target)
        yield member


def _no_time_after(newest: float) -> None:
    """What this unpacker made itself (the root, whiteout markers, parents the tar does not
    list) gets the layer's newest time instead of now: the same layer must give the same image."""
    for dirpath, dirnames, filenames in os.walk("/"):
        for path in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            if os.lstat(path).st_mtime > newest:
                os.utime(path, (newest, newest), follow_symlinks=False)


def unpack(tar_path: str, dest: str, mode: str, keep_whiteouts: bool, max_bytes: int = 0) -> dict:
    outer = tarfile.open(tar_path, "r:*")
    fmt, layer_names = ("dir", []) if mode == "dir" else ("layer", []) if mode == "layer" else image_layers(outer)
    os.makedirs(dest, exist_ok=True)
    os.chroot(dest)
    os.chdir("/")
    if mode == "layer":
        apply_layer(outer, whiteouts=True, keep_whiteouts=True, own_layer=True, max_bytes=max_bytes)
        _no_time_after(max((m.mtime for m in outer.getmembers()), default=0))
        return {"format": fmt, "layers": 1}
    if not layer_names:
        apply_layer(outer, whiteouts=mode == "image", keep_whiteouts=keep_whiteouts)
        return {"format": fmt, "layers": 1}
    for name in layer_names:
        f = outer.extractfile(name)
        if f is None:
            raise UnpackError(f"layer {name} is not a file in the archive")
        with tarfile.open(fileobj=f, mode="r:*") as layer:
            apply_layer(layer, whiteouts=True, keep_whiteouts=keep_whiteouts)
    return {"format": fmt, "layers": len(layer_names)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="unpack")
    p.add_argument("--dest", required=True)
    p.add_argument("--mode", choices=["dir", "image", "layer"], required=True)
    p.add_argument("--keep-whiteouts", action="store_true")
    p.add_argument("--max-bytes", type=int, default=0)
    p.add_argument("tar")
    args = p.parse_args(argv)
    try:
        summary = unpack(args.tar, args.dest, args.mode, args.keep_whiteouts, args.max_bytes)
    except (UnpackError, tarfile.TarError, KeyError, ValueError, OSError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc(limit=3, file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

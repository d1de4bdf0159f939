"""Kernel mounts of the layer cache: EROFS images mounted once per node, overlays over them.

An image is mounted straight from its file with mount(2) and `directio` (util-linux `mount`
would silently make a loop device instead), so the node holds one page cache per layer
however many sandboxes share it. `LayerMounts` knows which images are mounted; who uses them
is counted by the image cache's pins. `/proc/self/mountinfo` is the truth after a restart.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from linuxnode import mount_api
from linuxnode import syscalls as linux
from linuxnode import userns

log = logging.getLogger("sandfleet.layer_cache")

MS_RDONLY = linux.MS_RDONLY
MS_NODEV = linux.MS_NODEV
MNT_DETACH = linux.MNT_DETACH

# Layers never provide usable device nodes: a sandbox gets its own /dev.
LAYER_FLAGS = MS_RDONLY | MS_NODEV
OVERLAY_FLAGS = MS_NODEV
MAX_MOUNT_DATA = 4095  # mount(2) copies at most one page of options


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    try:
        linux.mount(source, target, fstype, flags, data)
    except OSError as exc:
        raise OSError(exc.errno, f"mount {fstype} on {target}: {os.strerror(exc.errno)}") from None


def umount(target: str) -> None:
    """Unmount; a mount still busy (a process sits in it) is detached instead of left behind."""
    try:
        linux.umount2(target, 0)
        return
    except OSError as exc:
        err = exc.errno
    if err == errno.EBUSY:
        log.warning("mount %s is busy; detaching it", target)
        try:
            linux.umount2(target, MNT_DETACH)
            return
        except OSError as exc:
            err = exc.errno
    if err == errno.EINVAL:  # not a mount point (any more)
        return
    raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mount_erofs(image: Path, target: Path, userns_fd: int = -1) -> None:
    """Mount an image; with `userns_fd`, idmapped through that namespace's map from the start, so
    a layer's root-owned files belong on the host to the root of the node's sandboxes (whose user
    namespaces map the same range): still one mount, one page cache per layer per node."""
    # `directio` keeps an image on disk in one page cache (EROFS's). A lazily fetched image is a
    # FUSE file: read it through its page cache, or every repeated read goes to the FUSE daemon.
    data = "" if _on_fuse(image) else "directio"
    try:
        if userns_fd >= 0:
            mount_api.mount("erofs", str(target), mount_api.options_of(data),
                            mount_api.MOUNT_ATTR_RDONLY | mount_api.MOUNT_ATTR_NODEV, source=str(image),
                            idmap_userns=userns_fd)
        else:
            mount(str(image), str(target), "erofs", LAYER_FLAGS, data)
    except OSError as exc:
        if exc.errno == errno.ENOTBLK:  # e.g. an image on tmpfs: EROFS cannot read it as a file
            raise OSError(exc.errno, f"EROFS cannot mount {image} from its filesystem; "
                                     "keep the data dir on a disk filesystem (ext4, xfs, btrfs)") from None
        raise


def _on_fuse(image: Path) -> bool:
    """Is the image a file in the root of a FUSE mount (the lazy-layer daemon's)?"""
    return any(e.mount_point == str(image.parent) and e.fstype.startswith("fuse") for e in read_mountinfo())


def _check_overlay_paths(lowers_top_first: list[str], upper: str, work: str) -> None:
    for path in [*lowers_top_first, upper, work]:
        if any(c in path for c in ":,\\\n") or not path.startswith("/"):
            raise ValueError(f"path unusable in overlay options: {path!r}")
    if not lowers_top_first:
        raise ValueError("an overlay needs at least one lower layer")


def overlay_options(lowers_top_first: list[str], upper: str, work: str) -> str:
    """The option string of an overlay; refuses paths overlayfs cannot parse and strings mount(2) would cut."""
    _check_overlay_paths(lowers_top_first, upper, work)
    data = f"lowerdir={':'.join(lowers_top_first)},upperdir={upper},workdir={work}"
    if len(data) > MAX_MOUNT_DATA:
        raise ValueError(f"overlay options of {len(data)} bytes exceed one page; use a shorter data dir")
    return data


def mount_overlay(lowers_top_first: list[str], upper: Path, work: Path, target: Path) -> None:
    """One mount(2) where the options fit in its page; past that (a deep image: each OCI layer
    is a lower layer, each a long path) the options go one by one through the fd mount API,
    each layer as `lowerdir+` (Linux 6.8 and later; overlayfs itself stacks up to 500)."""
    try:
        data = overlay_options(lowers_top_first, str(upper), str(work))
    except ValueError:
        _check_overlay_paths(lowers_top_first, str(upper), str(work))
    else:
        mount("overlay", str(target), "overlay", OVERLAY_FLAGS, data)
        return
    options = [("lowerdir+", lower) for lower in lowers_top_first] + [("upperdir", str(upper)), ("workdir", str(work))]
    try:
        mount_api.mount("overlay", str(target), options, mount_api.MOUNT_ATTR_NODEV, source="overlay")
    except OSError as exc:
        raise OSError(exc.errno, f"mount overlay of {len(lowers_top_first)} layers on {target}: "
                                 f"{os.strerror(exc.errno)} (at {exc.filename})") from None


# -- mountinfo ------------------------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    parent_id: int
    mount_point: str
    fstype: str
    source: str
    options: dict[str, str]  # super options; flags without a value map to ""


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_options(text: str) -> dict[str, str]:
    """Super options by key. An overlay's lower layers read as one `lowerdir` (top first, `:`
    between) whichever way it was mounted: one `lowerdir=` list, or one `lowerdir+=` each."""
    found: dict[str, str] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key == "lowerdir+":
            found["lowerdir"] = f"{found['lowerdir']}:{_unescape(value)}" if "lowerdir" in found else _unescape(value)
        else:
            found[key] = _unescape(value)
    return found


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        entries.append(
            MountEntry(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                mount_point=_unescape(fields[4]),
                fstype=tail[0],
                source=_unescape(tail[1]),
                options=parse_options(tail[2]) if len(tail) > 2 else {},
            )
        )
    return entries


def read_mountinfo() -> list[MountEntry]:
    with open("/proc/self/mountinfo") as f:
        return parse_mountinfo(f.read())


def mounts_under(root: Path, entries: list[MountEntry] | None = None) -> list[MountEntry]:
    """Mounts at or below `root`, deepest first (the order to unmount them in)."""
    prefix = str(root).rstrip("/") + "/"
    found = [e for e in (entries if entries is not None else read_mountinfo())
             if e.mount_point == str(root) or e.mount_point.startswith(prefix)]
    return sorted(found, key=lambda e: (e.mount_point.count("/"), e.mount_id), reverse=True)


def unmount_tree(root: Path) -> int:
    """Unmount everything at or below `root`; returns how many mounts went."""
    done = 0
    for entry in mounts_under(root):
        umount(entry.mount_point)
        done += 1
    return done


def remove_tree(path: Path, check: bool = True) -> None:
    """Delete a directory that must hold no mount (rmtree would walk into one and empty it).
    `check=False` when the caller has just unmounted what was there (reading mountinfo costs
    a few milliseconds on a node with thousands of roots)."""
    if check and mounts_under(path):
        raise RuntimeError(f"{path} still has mounts; not removing it")
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("could not fully remove %s", path)


# -- layer mounts ---------------------------------------------------------------------


def digest_hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


class LayerMounts:
    """Which images are mounted, at `<root>/<hex>`; at most one mount per image. With `ids` (the
    node's user-namespace range, linuxnode.userns) every image is mounted idmapped to it."""

    def __init__(self, root: Path, ids: userns.IdRange | None = None) -> None:
        self.root = root
        self.mounted: set[str] = set()
        self.ids = ids
        self._userns = userns.make(ids) if ids is not None else -1  # kept: it only carries the map

    def mountpoint(self, digest: str) -> Path:
        return self.root / digest_hex(digest)

    def ensure(self, digest: str, image: Path) -> Path:
        target = self.mountpoint(digest)
        if digest in self.mounted:
            return target
        target.mkdir(parents=True, exist_ok=True)
        try:
            mount_erofs(image, target, self._userns)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self._userns < 0:
                raise
            # A kernel whose EROFS cannot be idmapped (before Linux 6.12?): mount every layer as it
            # is from now on; roots composed after this say id_host 0 and their sandboxes run
            # as the host's uid 0, as before user namespaces (the README's fallback).
            log.error("EROFS refuses idmapped mounts here (mount_setattr: EINVAL): layers are mounted "
                      "unmapped and sandboxes on them run without a user namespace")
            os.close(self._userns)
            self._userns, self.ids = -1, None
            mount_erofs(image, target)
        self.mounted.add(digest)
        return target

    def adopt(self, digest: str) -> None:
        self.mounted.add(digest)

    def unmount(self, digest: str) -> None:
        target = self.mountpoint(digest)
        if digest in self.mounted:
            umount(str(target))
            self.mounted.discard(digest)
        try:
            target.rmdir()
        except FileNotFoundError:
            pass

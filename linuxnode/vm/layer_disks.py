"""The EROFS image files under a composed root, bottom first: what a microVM attaches as its
read-only disks. The layer-cache composes a sandbox's root as an overlay over one mount per
layer, each mounted straight from its image file (lazy images: the FUSE file), so the kernel's
mount table says which files they are, without the launcher knowing the cache's layout."""

from __future__ import annotations

import re
from pathlib import Path

_OCTAL = re.compile(r"\\([0-7]{3})")


class NoLayerImages(Exception):
    """The root is not an overlay over file-backed EROFS mounts (no image to give a VM)."""


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def _split_lowers(value: str) -> list[str]:
    """overlayfs's lowerdir list: ':' separates, a '\\:' is a literal colon."""
    parts, current, escaped = [], "", False
    for ch in value:
        if escaped:
            current, escaped = current + ch, False
        elif ch == "\\":
            escaped = True
        elif ch == ":":
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def images_under(rootfs: str, mountinfo: str | None = None) -> list[Path]:
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    mounts: dict[str, tuple[str, str, str]] = {}  # mount point → (fstype, source, super options)
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3:
            mounts[_unescape(fields[4])] = (tail[0], _unescape(tail[1]), tail[2])
    root = mounts.get(rootfs.rstrip("/"))
    if root is None or root[0] != "overlay":
        raise NoLayerImages(f"{rootfs} is not an overlay")
    options = dict(o.partition("=")[::2] for o in root[2].split(","))
    lowers = _split_lowers(_unescape(options.get("lowerdir", "")))
    images = []
    for lower in reversed(lowers):  # overlayfs lists the top first
        layer = mounts.get(lower.rstrip("/"))
        if layer is None or layer[0] != "erofs" or not layer[1].startswith("/"):
            raise NoLayerImages(f"layer {lower} of {rootfs} is not an EROFS mount of an image file")
        images.append(Path(layer[1]))
    return images

"""What a starting layer-cache does with the mounts and directories a previous instance left.

Pure: it reads the mount table and the directory listing and returns a plan. An overlay is
re-adopted when it sits where this service puts roots (`sandboxes/<id>/rootfs`), writes to
that sandbox's own upper dir, and every lower layer is one of this service's image mounts;
every other mount under the service's tree is unmounted and every unused directory removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from linuxnode import names
from services.layer_cache.mounts import MountEntry

_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Layout:
    """Where things live under the service's data dir."""

    root: Path

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def mnt(self) -> Path:
        return self.root / "mnt"

    @property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    @property
    def builds(self) -> Path:
        return self.root / "build"

    @property
    def debs(self) -> Path:
        """The packages Debian builds fetched (debootstrap's --cache-dir), kept for the next build."""
        return self.root / "debs"

    @property
    def lazy(self) -> Path:
        """The FUSE daemon's mount (`daemon.py` owns it; recovery leaves it alone)."""
        return self.root / "lazy"

    @property
    def broken(self) -> Path:
        """Sandbox ids whose roots lost their lazy layers' daemon, one a line (kept across restarts)."""
        return self.root / "broken-roots"

    def sandbox(self, sandbox_id: str) -> Path:
        return self.sandboxes / sandbox_id


@dataclass
class Plan:
    layer_mounts: set[str] = field(default_factory=set)  # digests whose image mount is kept
    rootfs: dict[str, list[str]] = field(default_factory=dict)  # sandbox id → digests, bottom first
    unmount: list[str] = field(default_factory=list)  # mount points, deepest first
    remove: list[str] = field(default_factory=list)  # directories to delete once unmounted


def plan(layout: Layout, entries: list[MountEntry], sandbox_dirs: list[str], mnt_dirs: list[str]) -> Plan:
    mnt, sandboxes = str(layout.mnt), str(layout.sandboxes)
    root = str(layout.root).rstrip("/") + "/"
    ours = [e for e in entries if e.mount_point.startswith(root) and e.mount_point != str(layout.lazy)]
    result = Plan()

    layer_at: dict[str, str] = {}  # mount point → digest
    for e in ours:
        parent, _, name = e.mount_point.rpartition("/")
        if e.fstype == "erofs" and parent == mnt and _HEX.match(name) and e.mount_point not in layer_at:
            layer_at[e.mount_point] = "sha256:" + name

    adopted_points: set[str] = set(layer_at)
    for e in ours:
        sandbox_id = _sandbox_of(e.mount_point, sandboxes)
        if e.fstype != "overlay" or sandbox_id is None or sandbox_id in result.rootfs:
            continue
        lowers = [p for p in e.options.get("lowerdir", "").split(":") if p]
        upper = e.options.get("upperdir", "")
        if lowers and all(p in layer_at for p in lowers) and upper == f"{sandboxes}/{sandbox_id}/upper":
            result.rootfs[sandbox_id] = [layer_at[p] for p in reversed(lowers)]
            adopted_points.add(e.mount_point)

    result.layer_mounts = set(layer_at.values())
    for e in sorted(ours, key=lambda e: (e.mount_point.count("/"), e.mount_id), reverse=True):
        if e.mount_point in adopted_points or _beneath_adopted_root(e.mount_point, result.rootfs, sandboxes):
            continue
        result.unmount.append(e.mount_point)
    kept_sandboxes = set(result.rootfs)
    result.remove += [f"{sandboxes}/{d}" for d in sandbox_dirs if d not in kept_sandboxes]
    mounted_hex = {d.removeprefix("sha256:") for d in result.layer_mounts}
    result.remove += [f"{mnt}/{d}" for d in mnt_dirs if d not in mounted_hex]
    return result


def _sandbox_of(mount_point: str, sandboxes: str) -> str | None:
    prefix = sandboxes + "/"
    if not mount_point.startswith(prefix):
        return None
    parts = mount_point[len(prefix):].split("/")
    if len(parts) == 2 and parts[1] == "rootfs" and names.is_sandbox_id(parts[0]):
        return parts[0]
    return None


def _beneath_adopted_root(mount_point: str, rootfs: dict[str, list[str]], sandboxes: str) -> bool:
    if not mount_point.startswith(sandboxes + "/"):
        return False
    parts = mount_point[len(sandboxes) + 1:].split("/")
    # `<id>` itself is the upper dir's tmpfs of a root with a disk limit
    return (len(parts) == 1 or (len(parts) > 2 and parts[1] == "rootfs")) and parts[0] in rootfs

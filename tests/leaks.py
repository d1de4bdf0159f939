"""What a sandbox or a test can leave on the machine, read straight from the kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split(" - ")[0].split()[4] + " " + line.split(" - ")[1].split()[0] for line in f]


def _cgroups() -> list[str]:
    """Every cgroup directory under a `sandfleet` parent, in each hierarchy (v1 and v2)."""
    found = []
    tops = ["/sys/fs/cgroup/sandfleet"]  # a v2-only host
    tops += [os.path.join("/sys/fs/cgroup", h, "sandfleet") for h in os.listdir("/sys/fs/cgroup")]
    for top in tops:
        for root, dirs, _ in os.walk(top):
            found.append(root)
    return found


def _processes(names: set[str]) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat[stat.rindex(")") + 2]
        if comm in names or state == "Z":
            found.append(f"{pid}:{comm}:{state}")
    return found


def lazy_daemons() -> list[str]:
    """The layer-cache's FUSE daemons (a Python process, so found by its command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"services.layer_cache.lazyfs" in argv:
            found.append(f"{pid}:lazyfs:{argv[-2].decode(errors='replace') if len(argv) > 1 else ''}")
    return found


def _links() -> list[str]:
    """Links the platform made (its veths and dummy links carry a `sandfleet` alias)."""
    found = []
    for name in os.listdir("/sys/class/net"):
        try:
            with open(f"/sys/class/net/{name}/ifalias") as f:
                alias = f.read().strip()
        except OSError:
            continue
        if alias.startswith("sandfleet"):
            found.append(f"{name} {alias}")
    return found


def _nft_tables() -> list[str]:
    if shutil.which("nft") is None:
        return []
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if " sandfleet" in line]


@dataclass(frozen=True)
class Snapshot:
    mounts: frozenset[str]
    cgroups: frozenset[str]
    netns: frozenset[str]
    processes: frozenset[str]
    links: frozenset[str] = frozenset()
    nft_tables: frozenset[str] = frozenset()

    @classmethod
    def take(cls) -> Snapshot:
        netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
        return cls(
            mounts=frozenset(m for m in _mounts() if " overlay" in m or " erofs" in m or " fuse" in m or "sandfleet" in m),
            cgroups=frozenset(_cgroups()),
            netns=frozenset(n for n in netns if n.startswith("sf-")),
            processes=frozenset(_processes({"catatonit", "nats-server", "crun"}) + lazy_daemons()),
            links=frozenset(_links()),
            nft_tables=frozenset(_nft_tables()),
        )

    def added_since(self, before: Snapshot) -> dict[str, list[str]]:
        left = {
            "mounts": sorted(self.mounts - before.mounts),
            "cgroups": sorted(self.cgroups - before.cgroups),
            "netns": sorted(self.netns - before.netns),
            "processes": sorted(self.processes - before.processes),
            "links": sorted(self.links - before.links),
            "nft_tables": sorted(self.nft_tables - before.nft_tables),
        }
        return {k: v for k, v in left.items() if v}


def node_left(node_id: str, data_dir: str) -> list[str]:
    """What of one node is still on the machine (other sessions share it, so only the node's
    own names count): mounts under its data dir, its cgroups (a process of a sandbox keeps its
    cgroup), its network namespaces."""
    with open("/proc/self/mountinfo") as f:
        left = [line.split()[4] for line in f if line.split()[4].startswith(data_dir)]
    left += [f"cgroup {h}/{node_id}" for h in os.listdir("/sys/fs/cgroup")
             if os.path.exists(f"/sys/fs/cgroup/{h}/sandfleet/{node_id}")]
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return left + [n for n in netns if n.startswith(f"sf-{node_id}.")]

"""What a sandbox or a test can leave on the machine, read straight from the kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from linuxnode import netns as netns_names
from linuxnode import roots_ns


def _mount_lines(text: str, prefix: str = "") -> list[str]:
    found = []
    for line in text.splitlines():
        left, right = line.split(" - ", 1)
        fstype, source = right.split()[:2]
        found.append(f"{prefix}{left.split()[4]} {fstype} {source}")
    return found


def _mounts() -> list[str]:
    """Every mount of this mount namespace, whatever its type: mount point, type, source; and
    every mount of each node's roots namespace (linuxnode.roots_ns), named after its pin, so
    a pinned namespace left behind counts as what it holds."""
    with open("/proc/self/mountinfo") as f:
        found = _mount_lines(f.read())
    for node in roots_ns.pinned_nodes():
        found += _mount_lines(roots_ns.read_mountinfo(node) or "", f"{roots_ns.pin_path(node)}: ")
    return found


def roots_mount_points(node_id: str) -> list[str]:
    """Mount points of the node's roots namespace (none if it has none pinned)."""
    return [line.split()[4] for line in (roots_ns.read_mountinfo(node_id) or "").splitlines()]


def _netns() -> list[str]:
    """Platforms' network namespace names: those on the host's /run/netns (SANDFLEET_NETNS=host,
    or an older version's) and those in each node's holder (linuxnode.netns)."""
    found = os.listdir(netns_names.RUN_DIR) if os.path.isdir(netns_names.RUN_DIR) else []
    for node in netns_names.holders():
        found += [f"sf-{node}.{sandbox}" for sandbox in netns_names.list_sandboxes(node)]
    return sorted({n for n in found if n.startswith(netns_names.PREFIX)})


def _cgroups() -> list[str]:
    """Every cgroup directory under a `sandfleet` parent, in each hierarchy (v1 and v2)."""
    found = []
    tops = ["/sys/fs/cgroup/sandfleet"]  # a v2-only host
    tops += [os.path.join("/sys/fs/cgroup", h, "sandfleet") for h in os.listdir("/sys/fs/cgroup")]
    for top in tops:
        for root, dirs, _ in os.walk(top):
            found.append(root)
    return found


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: str) -> tuple[str, str, str] | None:
    """(command name, state, parent pid) of a process, or None if it is gone."""
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if not stat:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
    return comm, state, ppid


def _owner(pid: str) -> str:
    """What says whose a process is: its cgroups (a sandbox's name its node), its command line,
    and the node id and data dir in its environment (what a platform's services inherit)."""
    groups = sorted({line.split(":", 2)[2] for line in _read(f"/proc/{pid}/cgroup").decode().splitlines() if line})
    argv = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    env = dict(kv.split(b"=", 1) for kv in _read(f"/proc/{pid}/environ").split(b"\0") if b"=" in kv)
    node, data_dir = (env.get(k, b"").decode(errors="replace") for k in (b"SANDFLEET_NODE_ID", b"SANDFLEET_DATA_DIR"))
    return f"cgroup={','.join(groups)} argv={argv[:200]} node={node} data_dir={data_dir}"


def _processes(names: set[str]) -> list[str]:
    """Processes named `names`, and zombies, each with its owner's marks and its parent's (a
    zombie has no command line of its own left): `pid:comm:state owner parent=ppid:(owner)`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is None:
            continue
        comm, state, ppid = stat
        if comm in names or state == "Z":
            found.append(f"{pid}:{comm}:{state} {_owner(pid)} parent={ppid}:({_owner(ppid)})")
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


QEMU_COMM = "qemu-system-x86"  # a microVM's QEMU (its comm, cut to 15 characters)


def microvm_left(data_dir: str, sandbox_id: str, level: str = "microvm") -> list[str]:
    """What of one microVM (or `vm`) sandbox is still on the machine: its QEMU (found by its
    pid's cgroup, which names the sandbox, or its working directory, the VM's directory) and
    the VM's directory under the launcher's state of its level (its sockets, QEMU's log, a
    `vm`'s screen note)."""
    run_dir = os.path.join(data_dir, "launcher", level, "vms", sandbox_id)
    left = [f"vm dir {run_dir}"] if os.path.exists(run_dir) else []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is None or stat[0] != QEMU_COMM:
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        if cwd == run_dir or f"/{sandbox_id}" in _read(f"/proc/{pid}/cgroup").decode(errors="replace"):
            left.append(f"qemu {pid}:{stat[1]}")
    return left


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


def _pid_comm(process: str) -> str:
    """`pid:comm` of a process entry: the same process, whatever its state or cgroup now."""
    return ":".join(process.split(" ", 1)[0].split(":")[:2])


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
        return cls(
            mounts=frozenset(_mounts()),
            cgroups=frozenset(_cgroups()),
            netns=frozenset(_netns()),
            processes=frozenset(_processes({"catatonit", "nats-server", "crun", QEMU_COMM}) + lazy_daemons()),
            links=frozenset(_links()),
            nft_tables=frozenset(_nft_tables()),
        )

    def added_since(self, before: Snapshot) -> dict[str, list[str]]:
        known = {_pid_comm(b) for b in before.processes}
        left = {
            "mounts": sorted(self.mounts - before.mounts),
            "cgroups": sorted(self.cgroups - before.cgroups),
            "netns": sorted(self.netns - before.netns),
            "processes": sorted(p for p in self.processes if _pid_comm(p) not in known),
            "links": sorted(self.links - before.links),
            "nft_tables": sorted(self.nft_tables - before.nft_tables),
        }
        return {k: v for k, v in left.items() if v}


def node_left(node_id: str, data_dir: str) -> list[str]:
    """What of one node is still on the machine (other sessions share it, so only the node's
    own names count): mounts under its data dir, its cgroups (a process of a sandbox keeps its
    cgroup), its network namespace names and their holder's pin."""
    with open("/proc/self/mountinfo") as f:
        left = [line.split()[4] for line in f if line.split()[4].startswith(data_dir)]
    left += [f"roots namespace: {p}" for p in roots_mount_points(node_id) if p.startswith(data_dir)]
    left += [f"cgroup {h}/{node_id}" for h in os.listdir("/sys/fs/cgroup")
             if os.path.exists(f"/sys/fs/cgroup/{h}/sandfleet/{node_id}")]
    if node_id in netns_names.holders():
        left.append(f"netns holder pinned: {netns_names.holder_pin(node_id)}")
    return left + [f"sf-{node_id}.{sandbox}" for sandbox in netns_names.list_sandboxes(node_id)]

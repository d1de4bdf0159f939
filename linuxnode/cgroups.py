"""The cgroups of each sandbox: limits, membership, kill and removal, on either layout.

Hybrid hosts (cgroup v1 controllers plus a controller-less v2 hierarchy, as on this
machine) give every sandbox one v1 directory per controller it limits (memory, cpu, pids)
and one v2 directory, which is where BPF programs attach and where freeze, kill and PSI
live. Unified (v2-only) hosts give it one v2 directory that does everything. Directories
are <hierarchy>/sandfleet/<node id>/<sandbox id>, so a restarted agent finds its sandboxes
by listing them.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from dataclasses import dataclass, field

from linuxnode import memcg_release
from linuxnode.memcg_release import write_value as _write

ROOT = "/sys/fs/cgroup"
PARENT = "sandfleet"
V1_CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
MEMORY_PEAK_V1, MEMORY_PEAK_V2 = "memory.max_usage_in_bytes", "memory.peak"
SWEEP_EVERY_S = 10.0  # sweeps of set-aside memory cgroups come from removals, at most this often
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class CgroupError(RuntimeError):
    """A cgroup operation failed in a way the caller cannot fix by retrying."""


@dataclass
class CgroupLayout:
    """Where the hierarchies are mounted; `v1` maps controller -> mount point (hybrid only)."""

    mode: str  # "hybrid" or "unified"
    v2: str
    v1: dict[str, str] = field(default_factory=dict)
    _prepared: set[str] = field(default_factory=set, repr=False)
    _swept_at: dict[str, float] = field(default_factory=dict, repr=False)  # node id -> monotonic time

    @classmethod
    def detect(cls) -> CgroupLayout:
        with open("/proc/self/mountinfo") as f:
            return cls.from_mountinfo(f.read())

    @classmethod
    def from_mountinfo(cls, text: str) -> CgroupLayout:
        v2: str | None = None
        v1: dict[str, str] = {}
        for line in text.splitlines():
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            mount_point, fstype, options = fields[4], tail[0], tail[2].split(",")
            if fstype == "cgroup2" and (v2 is None or mount_point == ROOT):
                v2 = mount_point
            elif fstype == "cgroup":
                for ctrl in V1_CONTROLLERS:
                    if ctrl in options:
                        v1.setdefault(ctrl, mount_point)
        if v2 is None:
            raise CgroupError("no cgroup v2 hierarchy is mounted (v2 is needed for BPF, freeze and kill)")
        if v2 == ROOT or not v1:
            return cls(mode="unified", v2=v2)
        missing = [c for c in V1_CONTROLLERS if c not in v1]
        if missing:
            raise CgroupError(f"hybrid cgroup layout without the v1 controllers {missing}")
        return cls(mode="hybrid", v2=v2, v1=v1)

    def node_dirs(self, node_id: str) -> list[str]:
        """The per-node parent directory in every hierarchy, v2 last."""
        if not _NAME.match(node_id):
            raise ValueError(f"invalid node id {node_id!r}")
        roots = sorted(set(self.v1.values())) + [self.v2]
        return [f"{root}/{PARENT}/{node_id}" for root in roots]

    def prepare_node(self, node_id: str) -> None:
        """Create the per-node parents and, on v2-only hosts, delegate the controllers to them."""
        if node_id in self._prepared:
            return
        for d in self.node_dirs(node_id):
            os.makedirs(d, exist_ok=True)
        if self.mode == "unified":
            with open(f"{self.v2}/cgroup.controllers") as f:
                available = set(f.read().split())
            missing = [c for c in V1_CONTROLLERS if c not in available]
            if missing:
                raise CgroupError(f"cgroup v2 controllers {missing} are not available at {self.v2}")
            enable = " ".join("+" + c for c in V1_CONTROLLERS)
            for d in (self.v2, f"{self.v2}/{PARENT}", f"{self.v2}/{PARENT}/{node_id}"):
                _write(f"{d}/cgroup.subtree_control", enable)
        self._prepared.add(node_id)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _read_pids(procs_file: str) -> list[int]:
    try:
        with open(procs_file) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


class SandboxCgroups:
    """The cgroup directories of one sandbox on one node."""

    def __init__(self, layout: CgroupLayout, node_id: str, sandbox_id: str) -> None:
        if not _NAME.match(sandbox_id):
            raise ValueError(f"invalid sandbox id {sandbox_id!r}")
        self.layout, self.node_id, self.sandbox_id = layout, node_id, sandbox_id
        self.dirs = [f"{d}/{sandbox_id}" for d in layout.node_dirs(node_id)]  # v2 last
        self._v1 = {ctrl: f"{root}/{PARENT}/{node_id}/{sandbox_id}" for ctrl, root in layout.v1.items()}

    @property
    def v2_dir(self) -> str:
        return self.dirs[-1]

    @property
    def procs_files(self) -> list[str]:
        return [f"{d}/cgroup.procs" for d in self.dirs]

    def _file(self, controller: str, v1_name: str, v2_name: str) -> str:
        """A controller's file: in its v1 directory on a hybrid host, in the v2 one on a unified host."""
        if self.layout.mode == "unified":
            return f"{self.v2_dir}/{v2_name}"
        return f"{self._v1[controller]}/{v1_name}"

    @property
    def memory_charged_file(self) -> str:
        """Bytes the sandbox's memory is charged."""
        return self._file("memory", "memory.usage_in_bytes", "memory.current")

    @property
    def memory_peak_file(self) -> str:
        """The most bytes the sandbox's memory was ever charged."""
        return self._file("memory", MEMORY_PEAK_V1, MEMORY_PEAK_V2)

    @property
    def memory_limit_file(self) -> str:
        return self._file("memory", "memory.limit_in_bytes", "memory.max")

    @property
    def memory_events_file(self) -> str:
        """Counts `oom_kill` on both layouts (v1 memory.oom_control, v2 memory.events)."""
        return self._file("memory", "memory.oom_control", "memory.events")

    @property
    def memory_event_control_file(self) -> str | None:
        """v1's cgroup.event_control, where an eventfd is registered for OOM; None on v2, whose
        memory.events raises POLLPRI by itself."""
        return None if self.layout.mode == "unified" else f"{self._v1['memory']}/cgroup.event_control"

    @property
    def pids_events_file(self) -> str:
        return self._file("pids", "pids.events", "pids.events")

    @property
    def pids_limit_file(self) -> str:
        return self._file("pids", "pids.max", "pids.max")

    def create(self, cpu: float, memory_mb: int, pids: int) -> None:
        """Make the directories and write the limits; calling it again rewrites the limits."""
        if cpu <= 0 or memory_mb <= 0 or pids <= 0:
            raise ValueError("cpu, memory_mb and pids must be positive")
        self.layout.prepare_node(self.node_id)
        for d in self.dirs:
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                pass
        memory = memory_mb << 20
        quota = max(1000, int(cpu * CPU_PERIOD_US))
        if self.layout.mode == "unified":
            _write(f"{self.v2_dir}/memory.max", str(memory))
            _write(f"{self.v2_dir}/cpu.max", f"{quota} {CPU_PERIOD_US}")
            _write(f"{self.v2_dir}/pids.max", str(pids))
            # v2 has no per-cgroup swappiness: cap swap at the memory limit, so a memory bomb
            # still meets the OOM killer soon while the reclaimer can page an idle sandbox out.
            if os.path.exists(f"{self.v2_dir}/memory.swap.max"):
                _write(f"{self.v2_dir}/memory.swap.max", str(memory))
            return
        _write(f"{self._v1['memory']}/memory.limit_in_bytes", str(memory))
        # Reaching its limit must OOM the sandbox, not push it into the node's zram swap; the
        # reclaimer's MADV_PAGEOUT of idle sandboxes ignores swappiness and still pages out.
        _write(f"{self._v1['memory']}/memory.swappiness", "0")
        # Each write of these walks every cpu cgroup of the host (the kernel checks the whole tree's
        # bandwidth: __cfs_schedulable): ~2.5 ms each at 4,000 sandboxes. A new group has the
        # default period already, so only a rewrite with another one pays for two.
        period = f"{self._v1['cpu']}/cpu.cfs_period_us"
        if _read(period) != str(CPU_PERIOD_US):
            _write(period, str(CPU_PERIOD_US))
        _write(f"{self._v1['cpu']}/cpu.cfs_quota_us", str(quota))
        _write(f"{self._v1['pids']}/pids.max", str(pids))

    def pids(self) -> list[int]:
        """Every process in any of the sandbox's cgroups."""
        found: set[int] = set()
        for f in self.procs_files:
            found.update(_read_pids(f))
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the sandbox's cgroups. Idempotent."""
        try:
            _write(f"{self.v2_dir}/cgroup.kill", "1")
            killed = set(_read_pids(f"{self.v2_dir}/cgroup.procs"))
        except FileNotFoundError:  # no v2 directory (a half-made sandbox) or a kernel before 5.14
            killed = set()
        # Members cgroup.kill did not reach are signalled one by one (a pid read from a
        # cgroup can be reused once its process is reaped, hence cgroup.kill first).
        for pid in set(self.pids()) - killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @property
    def memory_dir(self) -> str:
        """The directory whose memory controller charges the sandbox's pages."""
        return self.v2_dir if self.layout.mode == "unified" else self._v1["memory"]

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill everything, wait until the cgroups are empty, release the memory still charged to
        them and delete them. Idempotent."""
        if not any(os.path.isdir(d) for d in self.dirs):
            return
        self.kill()
        deadline, pause = time.monotonic() + timeout_s, 0.0005
        left = list(self.dirs)
        released = False
        while left:
            for d in list(left):
                if d == self.memory_dir and not released and not _read_pids(f"{d}/cgroup.procs"):
                    released = True
                    memcg_release.release_charges(d, self.layout.mode == "unified", deadline)
                    if self.layout.mode != "unified" and memcg_release.set_aside(d, self.sandbox_id):
                        left.remove(d)
                        continue
                try:
                    os.rmdir(d)
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
            if not left:
                sweep_released(self.layout, self.node_id)
                return
            if time.monotonic() > deadline:
                raise CgroupError(f"cgroups of {self.sandbox_id} still busy after {timeout_s} s: {left}")
            self.kill()
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def sweep_released(layout: CgroupLayout, node_id: str, older_than_s: float = memcg_release.WRITEBACK_WAIT_S,
                   every_s: float = SWEEP_EVERY_S) -> int:
    """Remove the node's memory cgroups set aside longer than `older_than_s` ago, unless the last
    sweep was less than `every_s` ago; how many it removed."""
    now = time.monotonic()
    if not layout.v1 or now - layout._swept_at.get(node_id, -every_s) < every_s:
        return 0
    layout._swept_at[node_id] = now
    return memcg_release.sweep(f"{layout.v1['memory']}/{PARENT}/{node_id}", older_than_s)


def list_sandboxes(layout: CgroupLayout, node_id: str) -> list[str]:
    """Ids of the sandboxes that have a cgroup directory of this node in any hierarchy."""
    found: set[str] = set()
    for d in layout.node_dirs(node_id):
        try:
            with os.scandir(d) as entries:
                found.update(e.name for e in entries if e.is_dir(follow_symlinks=False) and _NAME.match(e.name))
        except FileNotFoundError:
            pass
    return sorted(found)


def remove_node_root(layout: CgroupLayout, node_id: str) -> None:
    """Delete the node's memory cgroups set aside and its empty parents (and the sandfleet parent
    once no node uses it)."""
    sweep_released(layout, node_id, older_than_s=0.0, every_s=0.0)
    for d in layout.node_dirs(node_id):
        for empty in (d, os.path.dirname(d)):
            try:
                os.rmdir(empty)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
                break
    layout._prepared.discard(node_id)


# -- freezing and the CPU weight, from the directories a sandbox's confinement names ----------------

IDLE_SHARES, ACTIVE_SHARES = 2, 1024  # v1 cpu.shares: the kernel's minimum and its default
IDLE_WEIGHT, ACTIVE_WEIGHT = 1, 100  # v2 cpu.weight: likewise


def set_frozen(v2_dir: str, frozen: bool, timeout_s: float = 2.0) -> None:
    """Freeze or thaw every task of a v2 cgroup (SIGKILL still reaches frozen tasks).
    cgroup.freeze is asynchronous: wait until cgroup.events says it is done. A cgroup that is
    gone raises FileNotFoundError; one that does not settle in time raises CgroupError."""
    want = "1" if frozen else "0"
    _write(f"{v2_dir}/cgroup.freeze", want)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"{v2_dir}/cgroup.events") as f:
            if f"frozen {want}" in f.read():
                return
        time.sleep(0.002)
    raise CgroupError(f"{v2_dir} did not {'freeze' if frozen else 'thaw'} within {timeout_s:g} s")


@dataclass(frozen=True)
class CpuWeightFile:
    """Where a cgroup's relative CPU weight is written, and its idle and active values."""

    path: str
    idle: int
    active: int

    def write(self, idle: bool) -> int:
        value = self.idle if idle else self.active
        _write(self.path, str(value))
        return value


def cpu_weight_file(v2_dir: str, procs_files: list[str]) -> CpuWeightFile | None:
    """v2 cpu.weight where v2 has the cpu controller, else the v1 cpu.shares beside one of the
    sandbox's cgroup.procs files; None if neither exists."""
    v2 = os.path.join(v2_dir, "cpu.weight")
    if os.path.exists(v2):
        return CpuWeightFile(v2, IDLE_WEIGHT, ACTIVE_WEIGHT)
    for procs in procs_files:
        shares = os.path.join(os.path.dirname(procs), "cpu.shares")
        if os.path.exists(shares):
            return CpuWeightFile(shares, IDLE_SHARES, ACTIVE_SHARES)
    return None


# -- what a sandbox uses, read from the directories its confinement names ---------------------------

@dataclass(frozen=True)
class CgroupUsage:
    """A sandbox's use as its cgroups count it; -1 where this kernel keeps no such file."""

    cpu_usec: int  # user + system CPU time of every task it ran (v2 cpu.stat, a core file on both layouts)
    memory_bytes: int
    memory_peak_bytes: int
    memory_limit_bytes: int
    processes: int  # processes (not threads) in its v2 cgroup and any below it


def read_usage(v2_dir: str, procs_files: list[str]) -> CgroupUsage:
    """Read from the v2 directory and the directories of its cgroup.procs files (on a hybrid host
    the v1 memory directory is one of them; on a unified host everything is in the v2 one).
    FileNotFoundError if the v2 directory is gone (the sandbox ended)."""
    cpu = _stat_field(f"{v2_dir}/cpu.stat", "usage_usec")  # raises if the cgroup is gone
    memory_dir = next((d for d in [v2_dir, *(os.path.dirname(p) for p in procs_files)]
                       if os.path.exists(f"{d}/memory.current") or os.path.exists(f"{d}/memory.usage_in_bytes")), None)
    if memory_dir is None:
        current = peak = limit = -1
    elif os.path.exists(f"{memory_dir}/memory.current"):
        current = _int_file(f"{memory_dir}/memory.current")
        peak = _int_file(f"{memory_dir}/{MEMORY_PEAK_V2}")  # kernels before 5.19 lack it
        limit = _int_file(f"{memory_dir}/memory.max")
    else:
        current = _int_file(f"{memory_dir}/memory.usage_in_bytes")
        peak = _int_file(f"{memory_dir}/{MEMORY_PEAK_V1}")
        limit = _int_file(f"{memory_dir}/memory.limit_in_bytes")
    processes = 0
    for d, _, _ in os.walk(v2_dir):
        processes += len(_read_pids(f"{d}/cgroup.procs"))
    return CgroupUsage(cpu_usec=cpu, memory_bytes=current, memory_peak_bytes=peak, memory_limit_bytes=limit,
                       processes=processes)


def _int_file(path: str) -> int:
    """An integer cgroup file; `max` (no limit) and a missing file read as -1."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return -1
    return -1 if text == "max" else int(text)


def _stat_field(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return -1

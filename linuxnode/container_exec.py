"""The pieces of running a container that are not crun's: the mount namespace crun runs in
(made once, private, with each container's root attached just for its `crun run`), joining
the sandbox's cgroups before crun runs, and reaping the helpers `crun run --detach` leaves.
Commands in a container are not run by crun (see container.py).

The join is a /bin/sh prelude (`joined()`): it writes "0", itself, into each cgroup.procs
file and execs the real argv, so crun and everything it starts are inside the cgroups from
their first instruction; a failed join exits 125 with a message of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time

from linuxnode import mount_api, procfs, roots_ns
from linuxnode import syscalls as linux

_JOIN = ('while [ "$1" != -- ]; do echo 0 >"$1" || { echo "sandfleet: cannot join cgroup $1" >&2; exit 125; }; '
         'shift; done; shift; exec "$@"')


def joined(argv: list[str], cgroup_procs: list[str]) -> list[str]:
    """argv run by a shell that first joins every cgroup.procs file given."""
    return ["/bin/sh", "-c", _JOIN, "sh", *cgroup_procs, "--", *argv]


# -- reaping what crun leaves ------------------------------------------------------------------

def last_pid() -> int | None:
    """The pid the kernel handed out last in our pid namespace (read after `crun run` exits:
    every process it forked has a pid up to this one), or None where it cannot be read."""
    try:
        with open("/proc/sys/kernel/ns_last_pid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22


_PID_MAX = _pid_max()


def forked_between(pid: int, first: int, last: int | None, pid_max: int = _PID_MAX) -> bool:
    """Whether `pid` was handed out after `first` and up to `last`: pids are given in a circle
    (after pid_max, from the bottom again), so it is the distance forward from `first` that
    counts, not which number is larger. Without `last`, anything up to 2**20 ahead."""
    span = (last - first) % pid_max if last is not None else 1 << 20
    return 0 < (pid - first) % pid_max <= span


SPAN_PROBED = 2048  # pids handed out while crun ran, up to which each is looked at rather than our children listed


def detached_helpers(crun_pid: int, last: int | None = None) -> list[int]:
    """The helpers `crun run --detach` leaves, to be reaped once they end (see DetachedHelpers):
    crun forks a session leader that forks a helper and exits, the helper outlives crun (by a
    few ms) and becomes ours (we are a subreaper), and would stay a zombie for good. It is a
    `crun` child forked while crun ran (its pid between crun's and `last`, the last pid given
    when crun had exited) that leads neither its session (the container's init does) nor
    shares ours (our own `crun` commands do, or lead their own session).

    Every live container's init is our child too, so this never walks all of them: it looks
    at each pid handed out while crun ran (a few dozen, however many sandboxes live), and lists
    our children only when that span is wide or unknown, then reading only those in it. (With
    pids wrapping, pid_max is 32,768 on many hosts, "younger than crun" read about half the live
    inits per `crun run`: 70% of the launcher's CPU at 3,000 sandboxes; listing the children
    alone took ~8 ms there.)"""
    return [pid for pid, _ in _helpers_between(crun_pid, last)]


def _helpers_between(first: int, last: int | None) -> list[tuple[int, str]]:
    """Our `crun` children outside our session and not leading their own, forked after `first`
    and up to `last`, with their states."""
    span = (last - first) % _PID_MAX if last is not None else None
    if span is not None and span <= SPAN_PROBED:
        return _helpers_among(_pids_after(first, span))
    return _helpers_among([child for child in _children() if forked_between(child, first, last)])


def _pids_after(first: int, count: int) -> list[int]:
    """The `count` pids handed out after `first`, in the circle of pids."""
    return [(first + i) % _PID_MAX for i in range(1, count + 1)]


def _reap_zombies(candidates: list[int]) -> list[int]:
    """Reap the helpers among `candidates` that have ended; returns their pids."""
    reaped = []
    for pid, state in _helpers_among(candidates):
        if state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
    return reaped


def _helpers_among(candidates: list[int]) -> list[tuple[int, str]]:
    ours, me = os.getsid(0), os.getpid()
    found = []
    for pid in candidates:
        stat = procfs.read_stat(pid)
        if stat is not None and stat.ppid == me and stat.comm == "crun" and stat.session not in (pid, ours):
            found.append((pid, stat.state))
    return found


SWEEP_S = 10.0  # how often, at most, a launch also looks for helpers that escaped `detached_helpers`
MISSED_KEEP_S = 2.5 * SWEEP_S  # how long the pids of a run whose helper was not found are looked at again
INIT_REAP_S = 60.0  # how long a killed init that is not ours yet is waited for


class DetachedHelpers:
    """Reaps crun's detached helpers when they end, from the event loop (a pidfd each), so no
    crun worker thread waits for them. waitid on the pidfd reaps that very process, even if
    two `crun run`s named the same helper (each looks at every younger child)."""

    def __init__(self) -> None:
        self.pending: dict[int, int] = {}  # pid -> pidfd
        self.swept_at = time.monotonic()
        self.inits: dict[int, tuple[int, float]] = {}  # killed inits not reaped yet: pid -> (start time, give up at)
        # Runs whose helper was not ours yet when crun exited: (crun's pid, the last pid then, when).
        self.missed: list[tuple[int, int | None, float]] = []
        self._retry: asyncio.TimerHandle | None = None

    def reap_later(self, loop: asyncio.AbstractEventLoop, pid: int, start_time: int) -> None:
        """A killed container init that could not be reaped at once (still dying, or still a
        child of crun's helper): retried every second until it is ours to reap, by pid and
        start time so a reused pid is never taken; a sweep for helpers runs with it."""
        self.inits[pid] = (start_time, time.monotonic() + INIT_REAP_S)
        if self._retry is None:
            self._retry = loop.call_later(1.0, self._reap_inits, loop)

    def _reap_inits(self, loop: asyncio.AbstractEventLoop) -> None:
        self._retry = None
        now = time.monotonic()
        for pid, (start_time, give_up) in list(self.inits.items()):
            reaped = False
            if start_time_of(pid) == start_time:
                with contextlib.suppress(ChildProcessError):
                    reaped = os.waitpid(pid, os.WNOHANG)[0] == pid
            if reaped or start_time_of(pid) != start_time or now > give_up:
                del self.inits[pid]
        self.sweep_when_due()  # it reads every child (each live init): not every second
        if self.inits:
            self._retry = loop.call_later(1.0, self._reap_inits, loop)

    def watch(self, loop: asyncio.AbstractEventLoop, pids: list[int], span: tuple[int, int | None] | None = None) -> None:
        """Reap `pids` (the helpers of one run, `span` its crun's pid and the last pid after) when they
        end; with none found, the run's span is looked at again by the next sweeps."""
        if not pids and span is not None:
            self.missed.append((*span, time.monotonic()))
        self.sweep_when_due()
        for pid in pids:
            if pid in self.pending:
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            self.pending[pid] = fd
            loop.add_reader(fd, self._ended, loop, pid)

    def _ended(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        fd = self.pending.pop(pid)
        loop.remove_reader(fd)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        os.close(fd)

    def sweep_when_due(self) -> None:
        if time.monotonic() - self.swept_at >= SWEEP_S:
            self.sweep_missed()

    def sweep_missed(self) -> list[int]:
        """Reap the helpers of the runs whose helper was not found at once (see sweep), looking
        only at the pids handed out while each ran: every live init is our child too, and
        reading all of them every SWEEP_S cost ~0.4 s a pass at 3,000 sandboxes. A run whose
        last pid is unknown makes it a full sweep."""
        self.swept_at = now = time.monotonic()
        if any(last is None for _, last, _ in self.missed):
            self.missed.clear()
            return self.sweep()
        # Runs overlap (two crun workers, and many runs have no helper at all): each pid once.
        pids = sorted({pid for first, last, _ in self.missed
                       for pid in _pids_after(first, min((last - first) % _PID_MAX, SPAN_PROBED))})
        self.missed = [m for m in self.missed if now - m[2] < MISSED_KEEP_S]
        return _reap_zombies(pids)

    def sweep(self) -> list[int]:
        """Reap helpers `detached_helpers` missed, among all our children: one still a child of
        crun's session leader when crun had exited is ours only later (about 1 in 400 under load). Only a zombie
        `crun` child outside our session and not leading its own is taken: never one of our own
        `crun` commands, whose exit status their caller still waits for."""
        self.swept_at = time.monotonic()
        return _reap_zombies(_children())

    def close(self) -> None:
        """Stop watching (the loop may be gone); a helper left is reaped by whoever adopts it."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for fd in self.pending.values():
            with contextlib.suppress(OSError, RuntimeError):
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self.pending.clear()


def _children() -> list[int]:
    found: list[int] = []
    me = os.getpid()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{me}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{me}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


def start_time_of(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None if it is gone; a zombie has one."""
    stat = procfs.read_stat(pid)
    return None if stat is None else stat.start_time


# -- crun's own mount namespace (see container.py) -------------------------------------------------------------------------

_CLONE_FS = 0x200


def make_crun_namespace(hybrid_v2: str | None, prune: tuple[str, ...], roots: str) -> int:
    """A private copy of the host's mount namespace (without cgroup v2 on hybrid hosts, and
    without the mounts beneath the `prune` directories), with a tmpfs of its own on `roots`
    (where containers' roots are attached for `crun run`), made by a short-lived thread;
    returns an fd that keeps it."""
    def make() -> int:
        linux.unshare(linux.CLONE_NEWNS)  # this thread only: it also unshares its filesystem info
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)  # nothing propagates either way
        if hybrid_v2:
            linux.umount2(hybrid_v2, linux.MNT_DETACH)
        for point in _mounts_beneath(prune):
            with contextlib.suppress(OSError):  # already gone with a parent
                linux.umount2(point, linux.MNT_DETACH)
        roots_ns.prune_copied_sandbox_mounts()  # other nodes' roots and layers: a copy keeps them alive
        # crun resolves a root and its mount sources as the container's root once it has a
        # user namespace: an unprivileged host id, which may not pass the node's data dir
        # (under /root or pytest's 0700 directories). Here, every parent may be passed.
        linux.mount("crun-roots", roots, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=64k,mode=0711")
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    return linux.on_own_thread(make, "crun-namespace")


def _mounts_beneath(roots: tuple[str, ...]) -> list[str]:
    """Mount points strictly beneath any of `roots` in this thread's namespace, deepest first."""
    unescape = lambda p: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p)  # noqa: E731
    with open("/proc/thread-self/mountinfo") as f:
        points = {unescape(line.split()[4]) for line in f}
    inside = [p for p in points if any(p.startswith(root.rstrip("/") + "/") for root in roots)]
    return sorted(inside, key=lambda p: p.count("/"), reverse=True)


_SYSFS_ATTRS = (mount_api.MOUNT_ATTR_RDONLY | mount_api.MOUNT_ATTR_NOSUID | mount_api.MOUNT_ATTR_NODEV
                | mount_api.MOUNT_ATTR_NOEXEC)


def blank_sysfs() -> tuple[int, int]:
    """A read-only sysfs (a detached mount) of a network namespace of its own with nothing in it
    but a loopback, and an fd of that namespace: the caller's to keep open while any clone is in
    use (a sysfs holds its namespace only weakly: without it, its net/ part empties). Containers get clones of it
    (mount_sysfs_in): a new sysfs per container is a new superblock, and the kernel looks a new
    one up among every sysfs superblock of the host (one per live container: ~0.5 ms each at
    4,000, growing with each), where a clone is one more mount of the same."""
    def run() -> tuple[int, int]:
        linux.unshare(linux.CLONE_NEWNET)  # this thread only, which ends here
        net = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return mount_api.new_mount("sysfs", [], _SYSFS_ATTRS, source="sysfs"), net
        except BaseException:
            os.close(net)
            raise

    return linux.on_own_thread(run, "blank-sysfs")


def mount_sysfs_in(pid: int, masked: tuple[str, ...], shared: int = -1) -> None:
    """A read-only sysfs on `pid`'s /sys, `masked` (paths under /sys) hidden under empty tmpfs: a
    clone of `shared` (blank_sysfs: its network part shows only a loopback of its own, never the
    host's interfaces nor the sandbox's), or without it a new sysfs of `pid`'s network namespace.
    Made in the host's mount namespace and moved in: the kernel lets
    no new sysfs be mounted in a mount namespace of a user namespace that has none visible
    (mount_too_revealing), and the container's is one. On a thread of its own that ends after
    (one that changed namespace is no use to anyone else); raises what the thread raised."""
    def run() -> None:
        mnt = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if shared >= 0:
                sysfs = mount_api.clone_tree(shared)
            else:
                linux.setns(net, linux.CLONE_NEWNET)  # sysfs shows the mounter's network namespace
                sysfs = mount_api.new_mount("sysfs", [], _SYSFS_ATTRS, source="sysfs")
            try:
                linux.unshare(_CLONE_FS)
                linux.setns(mnt, linux.CLONE_NEWNS)
                mount_api.attach(sysfs, "/sys")
            finally:
                os.close(sysfs)
        finally:
            os.close(mnt)
            os.close(net)
        for rel in masked:
            if os.path.isdir(f"/sys/{rel}"):
                linux.mount("masked", f"/sys/{rel}", "tmpfs", linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV
                            | linux.MS_NOEXEC, "size=4k,mode=0555")

    return linux.on_own_thread(run, "container-sysfs")


def enter_namespace(mnt_fd: int) -> None:
    """Pool thread initializer: move this thread into crun's namespace for good."""
    linux.unshare(_CLONE_FS)  # a thread sharing its filesystem info cannot change mount namespace
    linux.setns(mnt_fd, linux.CLONE_NEWNS)

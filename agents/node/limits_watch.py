"""The node agent's watch on what a sandbox's own kernel refuses it, turned into violation
events: syscalls the seccomp filter refuses, opens of sensitive paths (both from the
syscall tracepoint programs, linuxnode/bpf/syscall_watch.py), the pids limit holding a
fork bomb and the memory limit OOM-killing inside the sandbox's cgroup.

Limits are read from the cgroup's own counters, so an event is only published when the
kernel says the limit acted. The memory OOM is signalled: an eventfd on the v1
`memory.oom_control` (hybrid hosts) or a modification of v2 `memory.events` (unified
hosts; kernfs marks it EPOLLPRI), all in one epoll set read by the event loop. The pids
counters raise no notification on v1, so the trigger there (and on v2 alike) is the syscall
program's record of a fork refused with EAGAIN, checked against `pids.events`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field

from linuxnode.bpf.build import BpfUnavailable
from linuxnode.bpf.syscall_watch import SyscallEvent, SyscallEventKind, SyscallWatch
from agents.node.violations import ViolationPublisher
from linuxnode import cgroups, seccomp

log = logging.getLogger("sandfleet.agent")
_IOCTL_NAMES = {cmd: name for name, cmd in seccomp.IOCTLS_REFUSED.items()}
_CLONE_FLAG_NAMES = {bit: name for name, bit in seccomp.CLONE_NS_FLAGS.items()}
_OOM_SETTLE_S = 1.0  # the v1 OOM notification comes before the kill is counted


def _counter(path: str, key: str) -> int | None:
    """One `key value` line of a cgroup counters file, or None once the cgroup is gone."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (FileNotFoundError, OSError):
        return None
    return 0


def describe(event: SyscallEvent) -> tuple[str, str] | None:
    """(violation kind, what was attempted) of a syscall record, or None when it is not one."""
    if event.kind is SyscallEventKind.SENSITIVE:
        return "file.sensitive", f"{event.syscall} {event.path}"
    if event.kind is not SyscallEventKind.REFUSED:
        return None
    if event.syscall == "ioctl":
        cmd = event.arg1 & 0xFFFFFFFF
        if cmd not in _IOCTL_NAMES:
            return None  # EPERM from a driver or filesystem, not from our filter
        return "syscall.ioctl", f"ioctl(fd={event.arg0}, {_IOCTL_NAMES[cmd]}={cmd:#x}) refused (EPERM)"
    if event.syscall == "clone":
        names = [n for bit, n in _CLONE_FLAG_NAMES.items() if event.arg0 & bit]
        if not names:
            return None
        return "syscall.clone", f"clone({'|'.join(names)}) refused (EPERM)"
    return f"syscall.{event.syscall}", f"{event.syscall}() refused (EPERM)"


@dataclass
class _Limits:
    """The counter files and last-seen counts of one sandbox."""

    sandbox_id: str
    pids_events: str
    pids_max: str
    memory_events: str  # memory.oom_control (v1) or memory.events (v2): both count `oom_kill`
    memory_limit: str
    fds: list[int] = field(default_factory=list)  # what the epoll set holds for it
    pids_refused: int = 0
    oom_kills: int = 0


@dataclass
class ViolationWatch:
    node_id: str
    layout: cgroups.CgroupLayout
    publisher: ViolationPublisher
    syscalls: SyscallWatch | None = None
    why_not: str = ""
    _epoll: select.epoll = field(default_factory=select.epoll)
    _limits: dict[str, _Limits] = field(default_factory=dict)
    _by_fd: dict[int, str] = field(default_factory=dict)
    _cgroup_ids: dict[str, int] = field(default_factory=dict)  # sandbox id -> v2 cgroup id
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _pending: set[str] = field(default_factory=set)  # sandboxes with a memory notification to check

    @classmethod
    async def load(cls, node_id: str, layout: cgroups.CgroupLayout, publisher: ViolationPublisher) -> ViolationWatch:
        try:
            return cls(node_id, layout, publisher, syscalls=await asyncio.to_thread(SyscallWatch))
        except BpfUnavailable as exc:
            log.warning("syscall violation reports are off on this node: %s", exc)
            return cls(node_id, layout, publisher, why_not=str(exc))

    @property
    def status(self) -> str:
        return "on" if self.syscalls is not None else f"off: {self.why_not}"

    # -- sandboxes ---------------------------------------------------------------------------

    def add(self, sandbox_id: str) -> None:
        """Watch a confined sandbox (its cgroups exist, no process of it has run yet)."""
        group = cgroups.SandboxCgroups(self.layout, self.node_id, sandbox_id)
        if self.syscalls is not None:
            self._cgroup_ids[sandbox_id] = self.syscalls.watch(group.v2_dir)
        lim = _Limits(sandbox_id, group.pids_events_file, group.pids_limit_file, group.memory_events_file,
                      group.memory_limit_file)
        event_control = group.memory_event_control_file
        if event_control is None:  # v2: memory.events raises POLLPRI itself
            watch = os.open(lim.memory_events, os.O_RDONLY | os.O_CLOEXEC)
            lim.fds, mask = [watch], select.EPOLLPRI | select.EPOLLET
        else:
            efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            control = os.open(lim.memory_events, os.O_RDONLY | os.O_CLOEXEC)
            lim.fds, mask = [efd, control], select.EPOLLIN
            try:
                with open(event_control, "w") as f:
                    f.write(f"{efd} {control}")
            except OSError:
                self._close(lim)
                raise
        lim.pids_refused = _counter(lim.pids_events, "max") or 0
        lim.oom_kills = _counter(lim.memory_events, "oom_kill") or 0
        with self._lock:
            old = self._limits.pop(sandbox_id, None)
            if old is not None:
                self._forget(old)
            self._limits[sandbox_id] = lim
            self._by_fd[lim.fds[0]] = sandbox_id
            self._epoll.register(lim.fds[0], mask)

    def remove(self, sandbox_id: str) -> None:
        """Stop watching (before the cgroups go). Idempotent."""
        cg = self._cgroup_ids.pop(sandbox_id, None)
        if self.syscalls is not None and cg is not None:
            self.syscalls.unwatch(cg)
        with self._lock:
            lim = self._limits.pop(sandbox_id, None)
            if lim is not None:
                self._forget(lim)

    def _forget(self, lim: _Limits) -> None:
        self._by_fd.pop(lim.fds[0], None)
        try:
            self._epoll.unregister(lim.fds[0])
        except (OSError, ValueError):
            pass
        self._close(lim)

    @staticmethod
    def _close(lim: _Limits) -> None:
        for fd in lim.fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def take_over(self, live_sandbox_ids: list[str]) -> None:
        """Watch the sandboxes that outlived a previous agent (its tracepoints died with it)."""
        for sandbox_id in live_sandbox_ids:
            try:
                self.add(sandbox_id)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise

    def watched(self) -> set[str]:
        with self._lock:
            return set(self._limits)

    # -- reporting ---------------------------------------------------------------------------

    def start(self) -> None:
        """Read the limit notifications and the syscall records (the publisher must be bound)."""
        self._tasks.append(asyncio.create_task(self._limit_events()))
        if self.syscalls is not None:
            self._tasks.append(asyncio.create_task(self._syscall_events()))

    async def _syscall_events(self) -> None:
        assert self.syscalls is not None
        async for event in self.syscalls.events():
            path = self.syscalls.watched().get(event.cgroup_id)
            if path is None:
                continue  # a cgroup just released
            sandbox_id = os.path.basename(path)
            if event.kind is SyscallEventKind.FORK_REFUSED:
                await self._check_pids(sandbox_id, event)
                continue
            found = describe(event)
            if found is not None:
                kind, attempted = found
                await self.publisher.publish(sandbox_id, kind, attempted, pid=event.pid, command=event.comm,
                                             suppressed=event.suppressed,
                                             msg_id=f"{sandbox_id}:{event.monotonic_ns}:{event.tid}")

    async def _check_pids(self, sandbox_id: str, event: SyscallEvent) -> None:
        lim = self._limits.get(sandbox_id)
        if lim is None:
            return
        refused = _counter(lim.pids_events, "max")
        if refused is None or refused <= lim.pids_refused:
            return  # EAGAIN for another reason (RLIMIT_NPROC, memory)
        delta, lim.pids_refused = refused - lim.pids_refused, refused
        limit = _read(lim.pids_max)
        await self.publisher.publish(
            sandbox_id, "limit.pids",
            f"{event.syscall}() refused: pids limit {limit} reached ({delta} fork(s) refused so far)",
            pid=event.pid, command=event.comm, msg_id=f"{sandbox_id}:pids:{refused}")

    async def _limit_events(self) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def readable() -> None:
            for fd, _ in self._epoll.poll(0):
                with self._lock:
                    sandbox_id = self._by_fd.get(fd)
                if sandbox_id is None:
                    continue
                try:
                    if self.layout.mode == "hybrid":
                        os.eventfd_read(fd)
                    else:
                        os.pread(fd, 4096, 0)  # rearms kernfs's EPOLLPRI for this open file
                except OSError:
                    pass
                self._pending.add(sandbox_id)
            wake.set()

        epoll_fd = self._epoll.fileno()
        loop.add_reader(epoll_fd, readable)
        try:
            while True:
                await wake.wait()
                wake.clear()
                pending, self._pending = self._pending, set()
                for sandbox_id in pending:
                    await self._check_memory(sandbox_id)
        finally:
            loop.remove_reader(epoll_fd)  # close() waits for this before it closes the epoll set

    async def _check_memory(self, sandbox_id: str) -> None:
        deadline = time.monotonic() + _OOM_SETTLE_S
        while True:
            lim = self._limits.get(sandbox_id)
            if lim is None:
                return
            kills = _counter(lim.memory_events, "oom_kill")  # re-read: a v2 event is rearmed by reading
            if kills is None:
                return  # the cgroup went away (removal also signals the eventfd)
            if kills > lim.oom_kills:
                break
            if time.monotonic() > deadline:
                return  # reclaim satisfied it, or the kill is not ours to report
            await asyncio.sleep(0.02)
        delta, lim.oom_kills = kills - lim.oom_kills, kills
        limit = _read(lim.memory_limit)
        limit_txt = f"{int(limit) >> 20} MiB" if limit.isdigit() else limit
        await self.publisher.publish(
            sandbox_id, "limit.memory",
            f"memory limit {limit_txt} reached: the OOM killer killed {delta} process(es) in the sandbox",
            msg_id=f"{sandbox_id}:oom:{kills}")

    async def close(self) -> None:
        """Stop the readers, then free what they read: a reader still registered on the event
        loop when the epoll set or the ring buffer closes would poll a closed (or reused) fd."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with self._lock:
            for lim in self._limits.values():
                self._close(lim)
            self._limits.clear()
            self._by_fd.clear()
        self._epoll.close()
        if self.syscalls is not None:
            self.syscalls.close()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


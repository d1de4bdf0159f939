"""The node's syscall watch: syscalls.bpf.c compiled once, reporting what sandbox processes
were refused at the syscall boundary.

One SyscallWatch per agent process compiles the tracepoint programs (they see every
process on the node and attach once, at load) and keeps the set of sandbox v2 cgroup ids
they report for in a map, so adding a sandbox is a map update. The policy is in maps too:
the syscall numbers the seccomp filter refuses (from linuxnode/seccomp.py, so the
two never disagree) and the sensitive paths below. Records arrive on a ring buffer and are
decoded into `SyscallEvent`s. Tracepoint attachments end with this process; a restarted
agent rebuilds the cgroup map from the sandboxes that still live.

Sensitive paths are matched on the path string the caller passed, so a relative path or
one spelled with `..` or `//` is not reported (Landlock and the masks refuse the open all
the same); these records say what was *tried* in the obvious way an agent tries it.
"""

from __future__ import annotations

import asyncio
import ctypes as ct
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from enum import Enum
from pathlib import Path

import msgspec

from linuxnode.bpf import build
from linuxnode.bpf.build import BpfUnavailable
from linuxnode.bpf.denials import RECORD_HEADER
from linuxnode import procfs, seccomp

log = logging.getLogger("sandfleet.agent.bpf")
SOURCE = Path(__file__).with_name("syscalls.bpf.c")
EVENT_SIZE = 336  # SF_SYSCALL_EVENT_SIZE
PATH_MAX = 256  # SF_PATH_MAX
_WATCH_REFUSED, _WATCH_FORK = 1, 2
_FORK_FAMILY = ("clone", "clone3", "fork", "vfork")

# An entry ending in "\0" is one exact path; any other is a prefix.
SENSITIVE_PATHS = (
    # physical-memory and page-frame maps: /proc/kpagecgroup crashed a host in the published incident log
    # and the other host-wide /proc files every runtime masks: keys, timers, scheduler internals
    *(f"/proc/{name}\0" for name in procfs.MASKED_FILES),
    "/dev/mem\0", "/dev/kmem\0", "/dev/port\0",
    # kernel addresses and logs of the whole host
    "/proc/kallsyms\0", "/proc/kmsg\0",
    # host-wide knobs that run code or disturb the node when written
    "/proc/sysrq-trigger\0", "/proc/sys/kernel/core_pattern\0", "/proc/sys/kernel/modprobe\0",
    "/proc/sys/vm/drop_caches\0",
    # kernel internals exported through sysfs (not /sys/kernel/mm: runtimes read THP settings there)
    "/sys/kernel/debug", "/sys/kernel/tracing", "/sys/kernel/security", "/sys/kernel/config",
    "/sys/firmware", "/sys/fs/bpf",
)


class SyscallEventKind(str, Enum):
    REFUSED = "refused"  # a syscall the seccomp filter refuses returned EPERM
    SENSITIVE = "sensitive"  # an open of a sensitive path
    FORK_REFUSED = "fork_refused"  # a fork-family call got EAGAIN (the pids limit); at most 1/s per sandbox


_KINDS = {1: SyscallEventKind.REFUSED, 2: SyscallEventKind.SENSITIVE, 3: SyscallEventKind.FORK_REFUSED}


class SyscallEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One record of the syscall programs, as the kernel saw it."""

    kind: SyscallEventKind
    cgroup_id: int
    pid: int
    tid: int
    comm: str
    syscall: str  # its name ("ptrace", "openat", ...), or "nr<N>" for one we do not name
    ret: int  # the return value at exit (0 for SENSITIVE, recorded at entry)
    arg0: int
    arg1: int
    path: str | None  # SENSITIVE only
    suppressed: int  # records of this sandbox the per-second budget held back since its last one
    monotonic_ns: int  # CLOCK_MONOTONIC (comparable with time.monotonic_ns())


class _Record(ct.Structure):  # struct sf_syscall_event
    _fields_ = RECORD_HEADER + [
        ("ret", ct.c_int64),
        ("arg0", ct.c_uint64),
        ("arg1", ct.c_uint64),
        ("nr", ct.c_uint32),
        ("kind", ct.c_uint8),
        ("pad", ct.c_uint8 * 3),
        ("suppressed", ct.c_uint32),
        ("pad2", ct.c_uint32),
        ("path", ct.c_char * PATH_MAX),
    ]


assert ct.sizeof(_Record) == EVENT_SIZE


class _PathKey(ct.Structure):  # struct sf_path_key
    _fields_ = [("prefixlen", ct.c_uint32), ("path", ct.c_char * PATH_MAX)]


class _Flags(ct.Structure):  # struct sf_sandbox
    _fields_ = [("flags", ct.c_uint32)]


def _syscall_numbers() -> tuple[dict[int, str], dict[int, int]]:
    """(number -> name, number -> SF_WATCH_* bits) for the native architecture."""
    import pyseccomp as sc

    names = dict(seccomp.refused_syscalls())
    bits = {nr: _WATCH_REFUSED for nr in names}
    for name in _FORK_FAMILY:
        nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if nr >= 0:
            names[nr] = name
            bits[nr] = bits.get(nr, 0) | _WATCH_FORK
    for name in ("open", "openat", "openat2"):
        nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if nr >= 0:
            names[nr] = name
    return names, bits


def decode(data: int | None, size: int, names: dict[int, str]) -> SyscallEvent:
    """Copy one ring buffer record (valid only during the callback) into a SyscallEvent."""
    if not data or size < EVENT_SIZE:
        raise ValueError(f"short syscall record: {size} bytes")
    rec = _Record.from_address(data)
    kind = _KINDS.get(rec.kind)
    if kind is None:
        raise ValueError(f"unknown syscall record kind {rec.kind}")
    return SyscallEvent(
        kind=kind, cgroup_id=rec.cgroup_id, pid=rec.pid, tid=rec.tid, comm=rec.comm.decode(errors="replace"),
        syscall=names.get(rec.nr, f"nr{rec.nr}"), ret=rec.ret, arg0=rec.arg0, arg1=rec.arg1,
        path=rec.path.decode(errors="replace") if kind is SyscallEventKind.SENSITIVE else None,
        suppressed=rec.suppressed, monotonic_ns=rec.ts_ns,
    )


def _path_key(entry: str) -> _PathKey:
    raw = entry.encode()
    if len(raw) > PATH_MAX:
        raise ValueError(f"sensitive path longer than {PATH_MAX} bytes: {entry!r}")
    return _PathKey(prefixlen=8 * len(raw), path=raw)  # the trailing "\0", if any, is kept: raw is not NUL-ended


class SyscallWatch:
    """Reports refused syscalls, sensitive opens and refused forks of watched cgroups. Thread-safe."""

    def __init__(self, sensitive_paths: tuple[str, ...] = SENSITIVE_PATHS) -> None:
        if not build.tracefs_ready():
            raise BpfUnavailable(f"no syscall tracepoints: tracefs is not mounted at {build.TRACEFS}")
        try:
            self._names, bits = _syscall_numbers()
        except ImportError as exc:
            raise BpfUnavailable("libseccomp's Python bindings (pyseccomp) are missing") from exc
        self._bpf = build.compile_program(SOURCE)  # attaches the tracepoints as it loads them
        watched = self._bpf[b"watched"]
        for nr, b in bits.items():
            watched[ct.c_int(nr)] = ct.c_uint8(b)
        sensitive = self._bpf[b"sensitive"]
        for entry in sensitive_paths:
            sensitive[_path_key(entry)] = ct.c_uint8(1)
        self._sandboxes = self._bpf[b"sandboxes"]
        self._fork_refused_at = self._bpf[b"fork_refused_at"]
        self._budget = self._bpf[b"budget"]
        self._lock = threading.Lock()
        self._watched: dict[int, str] = {}
        self._sink: Callable[[SyscallEvent], object] = lambda e: None
        self._ring = self._bpf[b"events"]
        self._ring.open_ring_buffer(self._on_record)

    def watch(self, cgroup_dir: str) -> int:
        """Report for the processes of a sandbox's v2 cgroup; returns its cgroup id."""
        cg = os.stat(cgroup_dir).st_ino  # what bpf_get_current_cgroup_id() returns for its members
        with self._lock:
            self._sandboxes[ct.c_uint64(cg)] = _Flags(0)
            self._watched[cg] = cgroup_dir
        return cg

    def unwatch(self, cgroup: int) -> None:
        """Stop reporting for a cgroup id. Idempotent."""
        with self._lock:
            self._watched.pop(cgroup, None)
            for table in (self._sandboxes, self._fork_refused_at, self._budget):
                try:
                    del table[ct.c_uint64(cgroup)]
                except KeyError:
                    pass

    def watched(self) -> dict[int, str]:
        """cgroup id -> v2 cgroup directory of every watched sandbox."""
        with self._lock:
            return dict(self._watched)

    def _on_record(self, _ctx: object, data: int, size: int) -> int:
        try:  # an exception must not unwind through libbcc's C callback
            self._sink(decode(data, size, self._names))
        except Exception:
            log.exception("syscall record dropped")
        return 0

    def poll(self, callback: Callable[[SyscallEvent], object], timeout_ms: int = 100) -> None:
        """Wait up to timeout_ms for records and hand each to callback (one reader at a time)."""
        self._sink = callback
        self._bpf.ring_buffer_poll(timeout_ms)

    async def events(self) -> AsyncIterator[SyscallEvent]:
        """Every record from now on, read when the ring buffer's fd turns readable."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[SyscallEvent] = asyncio.Queue()

        def readable() -> None:
            self._sink = queue.put_nowait
            self._bpf.ring_buffer_consume()

        loop.add_reader(self._ring.map_fd, readable)
        try:
            readable()
            while True:
                yield await queue.get()
        finally:
            loop.remove_reader(self._ring.map_fd)

    def lost(self) -> int:
        """Records dropped because the ring buffer was full (the reader fell behind)."""
        return sum(int(v) for v in self._bpf[b"lost"][ct.c_int(0)])

    def close(self) -> None:
        """Detach the tracepoints and free the maps."""
        self._bpf.cleanup()

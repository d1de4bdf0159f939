"""What the reclaimer reads and does to one sandbox's memory, on this kernel: its CPU time,
charged memory and resident memory (from its cgroups and /proc), the pages KSM has merged
for it (`/proc/<pid>/ksm_stat`), and the page-out (`process_madvise(MADV_PAGEOUT)` over every
mapping of every process in its cgroups, through pidfds so a reused pid is never touched).

Page-out skips pages another process also maps (a KSM page, a shared library), so merged
pages stay in RAM once and everything private goes to swap (or, for clean file pages, is
simply dropped). Without swap only file pages can go.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform

from linuxnode.cgroups import CgroupLayout, SandboxCgroups
from services.reclaimer.policy import Sample

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_PAGEOUT = 21
_NR_PROCESS_MADVISE = {"x86_64": 440, "aarch64": 440}[platform.machine()]
_IOV_BATCH = 512  # well under IOV_MAX (1024)
# Special mappings madvise refuses (EINVAL) or that hold nothing to page out.
_SKIP = ("[vsyscall]", "[vvar]", "[vvar_vclock]", "[vdso]")

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def cpu_usec(cgroups: SandboxCgroups) -> int:
    """Cumulative CPU time of the sandbox (v2 `cpu.stat` has usage_usec without any controller)."""
    for line in _read(f"{cgroups.v2_dir}/cpu.stat").splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value)
    return 0


def charged_bytes(cgroups: SandboxCgroups) -> int:
    """What the sandbox's memory cgroup is charged."""
    return int(_read(cgroups.memory_charged_file))


def resident_bytes(pid: int) -> int:
    """Resident memory of one process (VmRSS; 0 once it is gone or for a kernel thread), from
    /proc/<pid>/statm: the kernel formats it several times faster than `status`, and a pass
    over thousands of sandboxes reads it for every process."""
    try:
        return int(_read(f"/proc/{pid}/statm").split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def merged_bytes(pid: int) -> int:
    """The process's pages now backed by a KSM page (`ksm_merging_pages`), in bytes."""
    try:
        return parse_ksm_stat(_read(f"/proc/{pid}/ksm_stat")).get("ksm_merging_pages", 0) * PAGE
    except OSError:
        return 0


def parse_ksm_stat(text: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.replace(":", " ").partition(" ")
        with contextlib.suppress(ValueError):
            found[key] = int(value.strip())
    return found


def sample(layout: CgroupLayout, node_id: str, sandbox_id: str) -> Sample | None:
    """The sandbox now, or None if its cgroups went away while we looked."""
    cgroups = SandboxCgroups(layout, node_id, sandbox_id)
    try:
        pids = cgroups.pids()
        return Sample(
            sandbox_id=sandbox_id,
            cpu_usec=cpu_usec(cgroups),
            memory_bytes=charged_bytes(cgroups),
            resident_bytes=sum(resident_bytes(pid) for pid in pids),
            merged_bytes=sum(merged_bytes(pid) for pid in pids),
        )
    except (OSError, ValueError):
        return None


def sandbox_merged_bytes(layout: CgroupLayout, node_id: str, sandbox_id: str) -> int:
    return sum(merged_bytes(pid) for pid in SandboxCgroups(layout, node_id, sandbox_id).pids())


def mapping_ranges(maps: str) -> list[tuple[int, int]]:
    """(start, length) of every mapping in a /proc/<pid>/maps text that a page-out may touch."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if not fields or (len(fields) == 6 and fields[5].strip() in _SKIP):
            continue
        start, _, end = fields[0].partition("-")
        lo, hi = int(start, 16), int(end, 16)
        if hi > lo:
            ranges.append((lo, hi - lo))
    return ranges


def _madvise(pidfd: int, ranges: list[tuple[int, int]]) -> None:
    iov = (_Iovec * len(ranges))(*(_Iovec(start, length) for start, length in ranges))
    r = _syscall(ctypes.c_long(_NR_PROCESS_MADVISE), ctypes.c_int(pidfd), iov, ctypes.c_size_t(len(ranges)),
                 ctypes.c_int(MADV_PAGEOUT), ctypes.c_uint(0))
    if r < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def page_out_process(pid: int) -> None:
    """MADV_PAGEOUT over every mapping of `pid`. A process that exits meanwhile is no error."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        try:
            ranges = mapping_ranges(_read(f"/proc/{pid}/maps"))
        except OSError:
            return
        for i in range(0, len(ranges), _IOV_BATCH):
            batch = ranges[i : i + _IOV_BATCH]
            try:
                _madvise(pidfd, batch)
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    return
                # One mapping it refuses (locked, PFN-mapped, gone since we read maps) fails the
                # whole call from there on: go one by one so the rest are still paged out.
                for one in batch:
                    with contextlib.suppress(OSError):
                        _madvise(pidfd, [one])
    finally:
        os.close(pidfd)


def page_out(layout: CgroupLayout, node_id: str, sandbox_id: str) -> tuple[int, int]:
    """Page out every process of the sandbox; (bytes its resident memory fell by, resident after)."""
    pids = SandboxCgroups(layout, node_id, sandbox_id).pids()
    before = {pid: resident_bytes(pid) for pid in pids}
    for pid in pids:
        page_out_process(pid)
    after = {pid: resident_bytes(pid) for pid in pids if os.path.exists(f"/proc/{pid}")}  # an exit is no page-out
    return sum(max(0, before[p] - rss) for p, rss in after.items()), sum(after.values())

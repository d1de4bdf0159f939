"""Letting the kernel free a sandbox's memory cgroup when it is removed.

A memory cgroup removed while pages are still charged to it (page cache the sandbox read or wrote:
layer files, its upper dir, the file system's blocks its setup dirtied) is only taken offline: it
stays in the kernel, "dying", with its per-cgroup structures (1.36 MiB of slab each on this
machine) until those pages are reclaimed, which without memory pressure is never; a node that
churns sandboxes piles thousands up. So its charges are reclaimed first (the pages are cache that
a later reader faults in again), and on v1 a cgroup still holding dirty pages, which no reclaim
can take until the flusher has written them back, is set aside and removed later. Kernel objects
still charged (slab, ~10-60 KiB) are not reclaimable, but the kernel hands them to the parent at
removal, so they pin nothing.
"""

from __future__ import annotations

import os
import time

RECLAIM_STEP = 16 << 20  # v2: bytes asked of one memory.reclaim write, so the deadline is checked between
# dirty_expire_centisecs (30 s by default) + the flusher's period (5 s) + slack.
WRITEBACK_WAIT_S = 40.0


def write_value(path: str, value: str) -> None:
    """One write of a control file (cgroups' too), unbuffered: the kernel answers it with its errno."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _stat(memory_dir: str) -> dict[str, int]:
    with open(f"{memory_dir}/memory.stat") as f:
        return {name: int(value) for name, value in (line.split(maxsplit=1) for line in f)}


def release_charges(memory_dir: str, unified: bool, deadline: float) -> None:
    """Reclaim the pages charged to an empty memory cgroup, giving up at `deadline` (monotonic).

    Best effort: a destroy never fails or waits long because of it. v1 lowers the limit to 0
    rather than writing memory.force_empty: both reclaim, but force_empty retries 16 failed passes
    over the kernel objects it cannot reclaim (~4.6 ms a sandbox here), the limit write stops at
    the first (EBUSY, ~0.7 ms). v2 asks memory.reclaim for the page-cache and anon bytes only
    (asking for more also ends in retries, then EAGAIN), RECLAIM_STEP at a time."""
    if not unified:
        try:
            write_value(f"{memory_dir}/memory.limit_in_bytes", "0")
        except OSError:  # EBUSY: what is left is not reclaimable; or the cgroup is gone
            pass
        return
    try:
        while time.monotonic() < deadline:
            stat = _stat(memory_dir)
            lru = stat.get("file", 0) + stat.get("anon", 0)
            if lru <= 0:
                return
            write_value(f"{memory_dir}/memory.reclaim", str(min(lru, RECLAIM_STEP)))
    except OSError:  # EAGAIN/EBUSY: reclaim took what it could; ENOENT: a kernel before 5.19
        pass


def set_aside(memory_dir: str, sandbox_id: str) -> bool:
    """Rename an empty, reclaimed v1 memory cgroup that still holds dirty or writeback pages to
    ".<sandbox id>.<unix time>" beside it (v1 renames within a parent; the leading dot is no
    sandbox id, and the directory is the record, so a restarted agent still sweeps it).
    False if it holds none, or cannot be renamed: then the caller removes it now."""
    try:
        stat = _stat(memory_dir)
        if stat.get("dirty", 0) + stat.get("writeback", 0) <= 0:
            return False
        os.rename(memory_dir, f"{os.path.dirname(memory_dir)}/.{sandbox_id}.{int(time.time())}")
    except OSError:
        return False
    return True


def sweep(parent: str, older_than_s: float = WRITEBACK_WAIT_S) -> int:
    """Reclaim and remove the cgroups set aside under `parent` at least `older_than_s` ago; how
    many it removed."""
    try:
        with os.scandir(parent) as entries:
            names = [e.name for e in entries if e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names:
        try:
            set_aside_at = int(name.rsplit(".", 1)[1])
        except (IndexError, ValueError):
            set_aside_at = 0
        if time.time() - set_aside_at < older_than_s:
            continue
        release_charges(f"{parent}/{name}", False, time.monotonic() + 1.0)
        try:
            os.rmdir(f"{parent}/{name}")
            removed += 1
        except FileNotFoundError:
            pass
    return removed

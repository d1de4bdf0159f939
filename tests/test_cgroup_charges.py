"""Removing a sandbox's cgroups leaves no dying memory cgroup behind, on the real kernel.

A memory cgroup removed while page cache is still charged to it stays in the kernel (dying) until
those pages are reclaimed, holding its per-cgroup structures. Each sandbox here writes a file (clean
page cache that outlives it, as layer pages do) and is removed through `SandboxCgroups.remove`,
the path the node agent takes; the test then asks the kernel what stayed.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from linuxnode import cgroups

NODE = f"krt{os.getpid()}mc"
SANDBOXES, FILE_MB = 16, 4
SETTLE_S = 10.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups")


def _memory_cgroups_in_kernel() -> int:
    """/proc/cgroups' count for the memory controller, which counts dying cgroups too (v1)."""
    with open("/proc/cgroups") as f:
        for line in f:
            fields = line.split()
            if fields[0] == "memory":
                return int(fields[2])
    raise AssertionError("no memory controller in /proc/cgroups")


def _live_memory_cgroups(root: str) -> int:
    return sum(1 for _ in os.walk(root))


def _dying_memory_cgroups(layout: cgroups.CgroupLayout) -> int:
    """v2: the node parent's own count. v1 has none per parent: the host's count less its live
    directories (others on this machine may make and remove cgroups meanwhile, hence the margin
    below)."""
    if layout.mode == "unified":
        parent = layout.node_dirs(NODE)[-1]
        with open(f"{parent}/cgroup.stat") as f:
            return int(dict(line.split() for line in f)["nr_dying_descendants"])
    return _memory_cgroups_in_kernel() - _live_memory_cgroups(layout.v1["memory"])


def _charged_below_node(layout: cgroups.CgroupLayout) -> int:
    """Bytes charged to the node's parent and every cgroup below it, dying ones included."""
    parent = f"{layout.v1.get('memory', layout.v2)}/{cgroups.PARENT}/{NODE}"
    name = "memory.current" if layout.mode == "unified" else "memory.usage_in_bytes"
    with open(f"{parent}/{name}") as f:
        return int(f.read())


def _write_a_file_inside(group: cgroups.SandboxCgroups, path: str) -> None:
    """Run a process in every cgroup of the sandbox that writes FILE_MB of clean page cache."""
    def enter() -> None:
        for procs in group.procs_files:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={FILE_MB}", "conv=fsync",
                    "status=none"], preexec_fn=enter, check=True)


@pytest.fixture
def layout():
    layout = cgroups.CgroupLayout.detect()
    if layout.mode == "unified" and not os.path.exists(f"{layout.v2}/memory.reclaim"):
        pytest.skip("this kernel has no memory.reclaim")
    yield layout
    for sandbox_id in cgroups.list_sandboxes(layout, NODE):
        cgroups.SandboxCgroups(layout, NODE, sandbox_id).remove()
    cgroups.remove_node_root(layout, NODE)


def test_removed_sandboxes_leave_no_dying_memory_cgroup_and_no_charge(layout, tmp_path):
    # The files live on past the sandboxes, in the directory of the test (a disk, not tmpfs:
    # tmpfs pages cannot be reclaimed without swap, and a sandbox's layers are on disk).
    layout.prepare_node(NODE)
    baseline = _charged_below_node(layout)
    groups = [cgroups.SandboxCgroups(layout, NODE, f"charges{i}") for i in range(SANDBOXES)]
    for i, group in enumerate(groups):
        group.create(cpu=0.5, memory_mb=64, pids=16)
        _write_a_file_inside(group, str(tmp_path / f"file{i}"))
    # The file system's own dirty blocks (journal, metadata), charged to the writer too, are
    # reclaimable only once written back; layer pages, what a sandbox mostly holds, are clean.
    os.sync()
    charged = _charged_below_node(layout) - baseline
    assert charged >= SANDBOXES * FILE_MB << 20  # the writes are charged to the sandboxes

    dying_before = _dying_memory_cgroups(layout)
    for group in groups:
        group.remove()
    # The kernel frees a removed cgroup asynchronously (after its per-CPU charge caches drain,
    # an RCU grace period and a work item): wait for that, not for pages nobody will reclaim.
    deadline = time.monotonic() + SETTLE_S
    while True:
        dying_after, left_charged = _dying_memory_cgroups(layout), _charged_below_node(layout) - baseline
        if (dying_after - dying_before < SANDBOXES // 2 and left_charged < FILE_MB << 20) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for i in range(SANDBOXES):  # frees the pages, so a failed run leaves no dying cgroup either
        os.unlink(tmp_path / f"file{i}")

    assert not any(os.path.exists(d) for g in groups for d in g.dirs)
    assert dying_after - dying_before < SANDBOXES // 2, (dying_before, dying_after)
    # What a dying child still holds stays charged to its ancestors: none may be left here.
    assert left_charged < FILE_MB << 20

"""Removing a sandbox's cgroups leaves no dying memory cgroup behind, on the real kernel.

A memory cgroup removed while page cache is still charged to it stays in the kernel (dying) until
those pages are reclaimed, holding its per-cgroup structures. Each sandbox here writes a file (clean
page cache that outlives it, as layer pages do) and is removed through `SandboxCgroups.remove`,
the path the node agent takes; the test then asks the kernel what stayed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from linuxnode import cgroups
from tests.kernel import require

NODE = f"krt{os.getpid()}mc"
SANDBOXES, FILE_MB = 16, 4
SETTLE_S = 10.0
# Others on this machine make and remove memory cgroups meanwhile, hence margins on the host's count.
MAX_DYING, MAX_CHARGED = SANDBOXES // 2 - 1, FILE_MB << 20
DIRTY_SANDBOXES = 32
# Without the set-aside ~20 % of them stay dying, charged 1.7-2.1 MiB in all (measured); with it
# 80-150 KiB, the kernel objects of all 32 handed to the parent. The charge is this node's alone.
MAX_DYING_DIRTY, MAX_CHARGED_DIRTY = DIRTY_SANDBOXES // 4, DIRTY_SANDBOXES * 24 << 10



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


def _run_inside(group: cgroups.SandboxCgroups, argv: list[str]) -> None:
    def enter() -> None:
        for procs in group.procs_files:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    subprocess.run(argv, preexec_fn=enter, check=True)


def _write_a_file_inside(group: cgroups.SandboxCgroups, path: str) -> None:
    """Run a process in every cgroup of the sandbox that writes FILE_MB of clean page cache."""
    _run_inside(group, ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={FILE_MB}", "conv=fsync", "status=none"])


def _make_a_tree_inside(group: cgroups.SandboxCgroups, path: str) -> None:
    """Run a process in every cgroup of the sandbox that makes directories and small files, as a
    container's setup does in its upper dir: the file system's own blocks it dirties (directory
    and inode blocks, held by the journal) stay dirty, and charged to it, after reclaim."""
    script = f'mkdir "{path}" && cd "{path}" && for i in $(seq 100); do mkdir d$i; echo x > f$i; done'
    _run_inside(group, ["sh", "-c", script])


def _filled(layout: cgroups.CgroupLayout, prefix: str, n: int, fill, where) -> list[cgroups.SandboxCgroups]:
    """`n` sandboxes' cgroups of the node, each with `fill(group, where / f"{prefix}{i}")` run inside."""
    groups = [cgroups.SandboxCgroups(layout, NODE, f"{prefix}{i}") for i in range(n)]
    for i, group in enumerate(groups):
        group.create(cpu=0.5, memory_mb=64, pids=16)
        fill(group, str(where / f"{prefix}{i}"))
    return groups


def _settled(layout: cgroups.CgroupLayout, dying_before: int, baseline: int, max_dying: int,
             max_charged: int) -> tuple[int, int]:
    """(dying memory cgroups, bytes charged below the node) once the kernel has freed what it will.
    It frees a removed cgroup asynchronously (after its per-CPU charge caches drain, an RCU grace
    period and a work item): wait for that, not for pages nobody will reclaim."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        dying, charged = _dying_memory_cgroups(layout), _charged_below_node(layout) - baseline
        if (dying - dying_before <= max_dying and charged < max_charged) or time.monotonic() > deadline:
            return dying, charged
        time.sleep(0.1)


@pytest.fixture
def layout():
    require(os.geteuid() == 0, "cgroups need root")
    layout = cgroups.CgroupLayout.detect()
    require(layout.mode != "unified" or os.path.exists(f"{layout.v2}/memory.reclaim"),
            "v2 memory.reclaim (Linux 5.19)")
    yield layout
    for sandbox_id in cgroups.list_sandboxes(layout, NODE):
        cgroups.SandboxCgroups(layout, NODE, sandbox_id).remove()
    cgroups.remove_node_root(layout, NODE)


def test_removed_sandboxes_leave_no_dying_memory_cgroup_and_no_charge(layout, tmp_path):
    # The files live on past the sandboxes, in the directory of the test (a disk, not tmpfs:
    # tmpfs pages cannot be reclaimed without swap, and a sandbox's layers are on disk).
    layout.prepare_node(NODE)
    baseline = _charged_below_node(layout)
    groups = _filled(layout, "file", SANDBOXES, _write_a_file_inside, tmp_path)
    # The file system's own dirty blocks (journal, metadata), charged to the writer too, are
    # reclaimable only once written back; layer pages, what a sandbox mostly holds, are clean.
    os.sync()
    charged = _charged_below_node(layout) - baseline
    assert charged >= SANDBOXES * FILE_MB << 20  # the writes are charged to the sandboxes

    dying_before = _dying_memory_cgroups(layout)
    for group in groups:
        group.remove()
    dying_after, left_charged = _settled(layout, dying_before, baseline, MAX_DYING, MAX_CHARGED)
    for i in range(SANDBOXES):  # frees the pages, so a failed run leaves no dying cgroup either
        os.unlink(tmp_path / f"file{i}")

    assert not any(os.path.exists(d) for g in groups for d in g.dirs)
    assert dying_after - dying_before <= MAX_DYING, (dying_before, dying_after)
    # What a dying child still holds stays charged to its ancestors: none may be left here.
    assert left_charged < MAX_CHARGED


def test_a_cgroup_removed_with_dirty_pages_is_freed_once_they_are_written_back(layout, tmp_path):
    """Dirty pages cannot be reclaimed at removal; a v1 node sets their cgroup aside (under a name
    that is no sandbox's) and its sweep removes it once the flusher (here: sync) has cleaned them."""
    if layout.mode == "unified":
        pytest.skip("v2 cgroups cannot be renamed: there they are removed at once")
    layout.prepare_node(NODE)
    baseline = _charged_below_node(layout)
    groups = _filled(layout, "tree", DIRTY_SANDBOXES, _make_a_tree_inside, tmp_path)

    dying_before = _dying_memory_cgroups(layout)
    for group in groups:
        group.remove()
    assert cgroups.list_sandboxes(layout, NODE) == []  # what is set aside is no sandbox of the node
    assert not any(os.path.exists(d) for g in groups for d in g.dirs)
    os.sync()
    cgroups.sweep_released(layout, NODE, older_than_s=0.0, every_s=0.0)
    left = os.listdir(f"{layout.v1['memory']}/{cgroups.PARENT}/{NODE}")
    dying_after, left_charged = _settled(layout, dying_before, baseline, MAX_DYING_DIRTY, MAX_CHARGED_DIRTY)
    for i in range(DIRTY_SANDBOXES):
        shutil.rmtree(tmp_path / f"tree{i}")

    assert [d for d in left if os.path.isdir(f"{layout.v1['memory']}/{cgroups.PARENT}/{NODE}/{d}")] == []
    assert left_charged < MAX_CHARGED_DIRTY, left_charged
    assert dying_after - dying_before <= MAX_DYING_DIRTY, (dying_before, dying_after)

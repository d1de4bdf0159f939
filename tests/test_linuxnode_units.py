"""The node library's parsers and names, as pure logic (no kernel state changed)."""

from __future__ import annotations

import os

import msgspec

from linuxnode import cgroups, names, procfs
from linuxnode.container_exec import forked_between
from schemas import sandbox

HYBRID = cgroups.CgroupLayout(mode="hybrid", v2="/sys/fs/cgroup/unified",
                              v1={"memory": "/sys/fs/cgroup/memory", "cpu": "/sys/fs/cgroup/cpu,cpuacct",
                                  "pids": "/sys/fs/cgroup/pids"})
UNIFIED = cgroups.CgroupLayout(mode="unified", v2="/sys/fs/cgroup")


def test_stat_line_is_parsed_when_the_command_name_holds_spaces_and_parentheses():
    line = b"4242 (a b) (c)) S 17 4242 4240 0 -1 4194560 " + b" ".join(b"%d" % i for i in range(12, 24)) + b" 998877 0\n"
    stat = procfs.parse_stat(line)
    assert stat == procfs.ProcStat(comm="a b) (c)", state="S", ppid=17, session=4240, utime=16, stime=17, children_time=18 + 19,
                                   start_time=998877)


def test_stat_of_this_process_names_its_parent_and_a_start_time():
    stat = procfs.read_stat(os.getpid())
    assert stat is not None and stat.ppid == os.getppid() and stat.start_time > 0 and stat.state in "RS"


def test_stat_of_a_missing_process_is_none_and_a_truncated_line_is_refused():
    assert procfs.read_stat(2**22 + 1) is None  # above pid_max's ceiling
    assert procfs.parse_stat(b"12 (x) S 1 2") is None


def test_psi_reads_some_avg10_and_is_zero_where_there_is_no_file(tmp_path):
    f = tmp_path / "memory.pressure"
    f.write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=5\nfull avg10=2.00 avg60=0 avg300=0 total=1\n")
    assert procfs.psi_some_avg10(str(f)) == 12.5
    assert procfs.psi_some_avg10(str(tmp_path / "absent")) == 0.0


def test_node_library_id_patterns_are_the_wire_types():
    def meta(kind):
        return next(a for a in kind.__metadata__ if isinstance(a, msgspec.Meta))
    assert meta(sandbox.SandboxId).pattern == names.SANDBOX_ID_PATTERN
    assert meta(sandbox.NodeId).pattern == names.NODE_ID_PATTERN
    assert meta(sandbox.SandboxId).max_length == meta(sandbox.NodeId).max_length == names.MAX_ID


def test_ids_that_would_leave_a_directory_are_refused():
    for bad in ("../x", "a/b", "", "-a", "A" * 65, "sb_1", "sb.1"):
        assert not names.is_sandbox_id(bad), bad
    assert names.is_sandbox_id("sb-0123456789ab")
    assert names.is_node_id("Node_1-a") and not names.is_node_id("node.1")


def test_controller_files_are_v1_on_a_hybrid_host_and_v2_on_a_unified_one():
    hybrid = cgroups.SandboxCgroups(HYBRID, "n1", "sb-1")
    assert hybrid.memory_charged_file == "/sys/fs/cgroup/memory/sandfleet/n1/sb-1/memory.usage_in_bytes"
    assert hybrid.memory_events_file == "/sys/fs/cgroup/memory/sandfleet/n1/sb-1/memory.oom_control"
    assert hybrid.memory_event_control_file == "/sys/fs/cgroup/memory/sandfleet/n1/sb-1/cgroup.event_control"
    assert hybrid.pids_limit_file == "/sys/fs/cgroup/pids/sandfleet/n1/sb-1/pids.max"
    unified = cgroups.SandboxCgroups(UNIFIED, "n1", "sb-1")
    assert unified.memory_charged_file == "/sys/fs/cgroup/sandfleet/n1/sb-1/memory.current"
    assert unified.memory_limit_file == "/sys/fs/cgroup/sandfleet/n1/sb-1/memory.max"
    assert unified.memory_event_control_file is None
    assert unified.pids_events_file == "/sys/fs/cgroup/sandfleet/n1/sb-1/pids.events"


def test_every_root_masks_the_same_host_proc_files():
    from agents.node import apparmor
    from linuxnode import container

    assert {"kcore", "kpagecgroup", "keys", "timer_list"} <= set(procfs.MASKED_FILES)
    assert set(procfs.MASKED_FILES) <= set(apparmor._DENIED_PROC)
    spec = container.ContainerSpec(sandbox_id="sb-1", rootfs="/nonexistent", cgroup_procs=[], netns="/run/netns/x",
                                   tmp_size_mb=16)
    linux = container.bundle_config(spec)["linux"]
    assert {f"/proc/{p}" for p in (*procfs.MASKED_FILES, *procfs.MASKED_DIRS)} <= set(linux["maskedPaths"])
    assert {f"/proc/{p}" for p in procfs.READONLY} == set(linux["readonlyPaths"])


def test_a_crun_helper_is_looked_for_only_among_pids_handed_out_while_crun_ran():
    """Pids go round in a circle: a helper forked after the wrap (100, crun was 32,000) is found,
    and the live inits of earlier sandboxes (every pid outside crun's span) are never read, whether
    their numbers are larger than crun's (31,000 after crun 30,000) or not."""
    assert forked_between(30_050, 30_000, 30_100, pid_max=32_768)
    assert forked_between(100, 32_000, 200, pid_max=32_768)  # forked after the wrap
    assert not forked_between(31_000, 30_000, 30_100, pid_max=32_768)  # an older init, larger number
    assert not forked_between(29_000, 30_000, 30_100, pid_max=32_768)
    assert not forked_between(30_000, 30_000, 30_100, pid_max=32_768)  # crun itself
    assert forked_between(30_100, 30_000, 30_100, pid_max=32_768)  # the last pid given
    assert forked_between(40_000, 30_000, None, pid_max=1 << 22)  # no last pid known: a wide span ahead

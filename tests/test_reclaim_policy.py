"""The reclaimer's decisions (services/reclaimer/policy.py) and its pure parsers, without a bus or kernel."""

from __future__ import annotations

from services.reclaimer.ksm import SharedKsm
from services.reclaimer.memory import mapping_ranges, parse_ksm_stat
from services.reclaimer.policy import Action, Phase, Policy, PolicyConfig, Sample

CFG = PolicyConfig(idle_cpu=0.02, idle_after_s=10, merge_window_s=5, merge_settle_s=3, merge_max_s=20,
                   repage_after_s=30, repage_min_bytes=1 << 20,
                   pressure_avg10=20, pressure_sustain_s=10, freeze_per_window=1)
MiB = 1 << 20


def run(policy: Policy, until: float, cpu: dict[str, float], *, start: float = 0, step: float = 1,
        pressure: float = 0, memory: dict[str, int] | None = None) -> list[tuple[float, Action]]:
    """Feed samples every `step` s; `cpu` is each sandbox's CPU use as a fraction of one CPU."""
    seen: list[tuple[float, Action]] = []
    t = start
    while t <= until:
        samples = [Sample(sid, int(frac * t * 1e6), (memory or {}).get(sid, 10 * MiB), 8 * MiB)
                   for sid, frac in cpu.items()]
        seen += [(t, a) for a in policy.observe(t, samples, pressure).actions]
        t += step
    return seen


def test_a_quiet_sandbox_is_merged_then_paged_out_after_the_idle_and_merge_windows():
    policy = Policy(CFG)
    actions = run(policy, 20, {"a": 0.0})
    assert [(t, a.kind) for t, a in actions] == [(15, "merge"), (15, "page_out")]
    assert policy.tracks["a"].phase is Phase.PAGED_OUT


def test_page_out_waits_while_ksm_is_still_merging_the_sandbox_but_no_longer_than_the_maximum():
    def feed(policy: Policy, merged_at) -> list[tuple[float, str]]:  # type: ignore[no-untyped-def]
        seen = []
        for t in range(0, 40):
            s = Sample("a", 0, 10 * MiB, 8 * MiB, merged_bytes=merged_at(t))
            seen += [(t, a.kind) for a in policy.observe(t, [s], 0).actions]
        return seen

    # Idle at 10; merging grows until 18, settled 3 s later: merged and paged out at 21, not at 15.
    assert feed(Policy(CFG), lambda t: min(t, 18) * MiB) == [(21, "merge"), (21, "page_out")]
    # Still growing at the maximum (20 s after idle at 10): it goes anyway at 30.
    assert feed(Policy(CFG), lambda t: t * MiB) == [(30, "merge"), (30, "page_out")]


def test_page_out_waits_for_two_full_ksm_scans_after_the_sandbox_went_idle():
    policy, seen = Policy(CFG), []
    for t in range(0, 40):  # ksmd finishes a full scan of the machine every 10 s
        s = Sample("a", 0, 10 * MiB, 8 * MiB)
        seen += [(t, a.kind) for a in policy.observe(t, [s], 0, ksm_scans=t // 10).actions]
    assert seen == [(30, "merge"), (30, "page_out")]  # idle at 10 (scan 1): scans 2 and 3 done at 30


def test_a_busy_sandbox_is_never_touched_and_ksm_is_not_wanted_for_it():
    policy = Policy(CFG)
    assert run(policy, 60, {"busy": 0.5}) == []
    assert policy.observe(61, [Sample("busy", int(0.5 * 61e6), MiB)], 0).ksm_wanted is False


def test_ksm_is_wanted_as_soon_as_one_sandbox_is_idle():
    policy = Policy(CFG)
    run(policy, 9, {"a": 0.0, "b": 0.5})
    assert policy.observe(10, [Sample("a", 0, MiB), Sample("b", int(5e6), MiB)], 0).ksm_wanted is True


def test_cpu_use_makes_an_idle_sandbox_active_again_and_restarts_its_idle_window():
    policy = Policy(CFG)
    run(policy, 12, {"a": 0.0})  # idle at 10, merge window running
    assert policy.tracks["a"].phase is Phase.IDLE
    policy.observe(13, [Sample("a", int(0.5e6), MiB)], 0)  # half a CPU-second in one second
    assert policy.tracks["a"].phase is Phase.ACTIVE
    later = []
    for t in range(14, 41):  # no more CPU: cumulative usage stays at half a second
        later += [(t, a.kind) for a in policy.observe(t, [Sample("a", int(0.5e6), MiB, 8 * MiB)], 0).actions]
    assert later == [(28, "merge"), (28, "page_out")]  # quiet since 13: idle at 23, merge window to 28


def test_a_paged_out_sandbox_is_paged_out_again_only_when_its_memory_grew_back():
    policy = Policy(CFG)
    run(policy, 15, {"a": 0.0})
    policy.paged_out("a", 2 * MiB)
    # Resident stays at 8 MiB in every sample (6 MiB over the 2 MiB after the page-out).
    again = run(policy, 50, {"a": 0.0}, start=16)
    assert [(t, a.kind) for t, a in again] == [(45, "page_out")]
    policy.paged_out("a", 8 * MiB)
    assert run(policy, 90, {"a": 0.0}, start=51) == []  # no growth since: nothing to do


def test_sustained_pressure_freezes_the_idlest_sandbox_one_per_window():
    policy = Policy(CFG)
    run(policy, 2, {"old": 0.0})
    run(policy, 30, {"old": 0.0, "new": 0.0, "busy": 0.9}, start=3,
        memory={"old": 10 * MiB, "new": 50 * MiB, "busy": 90 * MiB})
    assert policy.tracks["new"].phase is Phase.PAGED_OUT
    frozen = run(policy, 51, {"old": 0.0, "new": 0.0, "busy": 0.9}, start=31, pressure=40)
    # Pressure from 31: the first freeze at 41 takes the one idle longest, the next window's the other;
    # the busy one (the largest) is never a candidate.
    assert [(t, a.kind, a.sandbox_id) for t, a in frozen] == [(41, "freeze", "old"), (51, "freeze", "new")]


def test_a_pressure_spike_shorter_than_the_window_freezes_nothing():
    policy = Policy(CFG)
    run(policy, 20, {"a": 0.0})
    assert run(policy, 28, {"a": 0.0}, start=21, pressure=90) == []
    assert run(policy, 40, {"a": 0.0}, start=29, pressure=1) == []


def test_a_failed_freeze_leaves_the_sandbox_a_candidate():
    policy = Policy(CFG)
    run(policy, 20, {"a": 0.0})
    frozen = run(policy, 31, {"a": 0.0}, start=21, pressure=50)
    assert [a.kind for _, a in frozen] == ["freeze"]
    policy.freeze_failed("a")
    assert policy.tracks["a"].phase is Phase.PAGED_OUT
    assert [a.kind for _, a in run(policy, 41, {"a": 0.0}, start=32, pressure=50)] == ["freeze"]


def test_a_sandbox_that_ended_is_forgotten():
    policy = Policy(CFG)
    run(policy, 12, {"a": 0.0, "b": 0.0})
    policy.observe(13, [Sample("b", 0, MiB)], 0)
    assert set(policy.tracks) == {"b"}


def test_mapping_ranges_skip_the_special_mappings_madvise_refuses():
    maps = (
        "55d0c0000000-55d0c0021000 r--p 00000000 fd:01 123 /usr/bin/python3.11\n"
        "7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n"
        "7ffd1000000-7ffd1021000 rw-p 00000000 00:00 0                          [stack]\n"
        "7ffd1100000-7ffd1104000 r--p 00000000 00:00 0                          [vvar]\n"
        "7ffd1104000-7ffd1106000 r-xp 00000000 00:00 0                          [vdso]\n"
        "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]\n"
    )
    assert mapping_ranges(maps) == [(0x55D0C0000000, 0x21000), (0x7F0000000000, 0x100000), (0x7FFD1000000, 0x21000)]


def test_ksm_stat_is_parsed_into_counts():
    text = "ksm_rmap_items 10\nksm_zero_pages 0\nksm_merging_pages 7\nksm_process_profit -3\nksm_merge_any: yes\n"
    assert parse_ksm_stat(text) == {"ksm_rmap_items": 10, "ksm_zero_pages": 0, "ksm_merging_pages": 7,
                                    "ksm_process_profit": -3}


def _fake_ksm_sysfs(root) -> dict[str, str]:
    found = {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20", "advisor_mode": "[none] scan-time",
             "advisor_target_scan_time": "200", "advisor_max_cpu": "70", "pages_sharing": "0"}
    for k, v in found.items():
        (root / k).write_text(v)
    return found


def test_ksmd_runs_while_any_live_reclaimer_wants_it_and_the_last_one_out_restores_the_settings(tmp_path):
    sysfs, registry = tmp_path / "ksm", tmp_path / "registry"
    sysfs.mkdir()
    _fake_ksm_sysfs(sysfs)
    live = {1, 2}
    a, b = (SharedKsm(n, sysfs=sysfs, registry=registry, pid=pid, alive=live.__contains__, target_scan_s=5)
            for n, pid in (("a", 1), ("b", 2)))
    a.join()
    b.join()
    a.want(True)
    assert (sysfs / "run").read_text() == "1"
    assert (sysfs / "advisor_mode").read_text() == "scan-time"  # the kernel's advisor sizes the scans
    assert (sysfs / "advisor_target_scan_time").read_text() == "5"
    a.want(False)
    assert (sysfs / "run").read_text() == "0"
    a.want(True)
    b.leave()  # a still wants it
    assert (sysfs / "run").read_text() == "1"
    a.leave()
    assert {k: (sysfs / k).read_text() for k in ("run", "advisor_mode", "advisor_target_scan_time")} == {
        "run": "0", "advisor_mode": "none", "advisor_target_scan_time": "200"}
    assert not (registry / "saved.json").exists()


def test_a_crashed_reclaimer_no_longer_keeps_ksmd_running(tmp_path):
    sysfs, registry = tmp_path / "ksm", tmp_path / "registry"
    sysfs.mkdir()
    _fake_ksm_sysfs(sysfs)
    live = {1, 2}
    a = SharedKsm("a", sysfs=sysfs, registry=registry, pid=1, alive=live.__contains__)
    b = SharedKsm("b", sysfs=sysfs, registry=registry, pid=2, alive=live.__contains__)
    a.join()
    a.want(True)
    live.discard(1)  # a dies without leaving
    b.join()
    assert (sysfs / "run").read_text() == "0"
    b.leave()
    assert (sysfs / "advisor_mode").read_text() == "none"  # the settings found before a ever ran


def test_sampling_keeps_to_its_cpu_budget_by_stretching_the_period():
    from services.reclaimer.node import NodeReclaimer
    node = NodeReclaimer(bus=None, node_id="n", layout=None, policy=Policy(CFG), ksm=None, zram=None,  # type: ignore[arg-type]
                         interval_s=2.0, cpu_budget=0.05)
    node.pass_cpu_s = 0.01  # a few sandboxes: the configured period
    assert node.next_interval() == 2.0
    node.pass_cpu_s = 0.5  # thousands: 0.5 s of CPU per pass at 5% of a core is one pass per 10 s
    assert node.next_interval() == 10.0
    node.pass_cpu_s = 10.0  # a pass that costly stretches the period only up to its cap
    assert node.next_interval() == 30.0
    node.cpu_budget = 0  # no budget: always the configured period
    assert node.next_interval() == 2.0


def test_resident_bytes_of_a_live_process_and_of_a_gone_one():
    import os
    from services.reclaimer.memory import resident_bytes
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(resident_bytes(os.getpid()) - vmrss) < 16 * MiB  # statm and status agree, give or take growth
    assert resident_bytes(2**22 + 1) == 0

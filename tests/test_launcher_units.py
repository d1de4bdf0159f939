"""The launcher's decisions and small pieces without a bus or a kernel: recovery after a restart,
destroy, fencing, label selection, its settings, intake counters, log keys, the driver registry's
fallback, and the node library's CPU-weight file choice (on plain files)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from linuxnode import cgroups
from sandfleet import telemetry
from schemas.errors import ErrorCode
from schemas.node import LaunchItem
from schemas.sandbox import Reason, SandboxRecord, SandboxSpec, State
from services.launcher import decisions, records
from services.launcher.drivers import Drivers
from services.launcher.drivers.base import Anchor, LaunchRefused
from sandfleet.runner import CanonicalFormatter
from services.launcher.keys import about
from services.launcher.settings import LauncherSettings
from services.launcher.state import Intake

NODE = "n1"


def record(state: State, *, node: str = NODE, reason: Reason = Reason.NONE, isolation: str = "process",
           host_view: bool = False, sandbox_id: str = "sb-1", pid: int = 0) -> SandboxRecord:
    spec = SandboxSpec(isolation=isolation, host_view=host_view)  # type: ignore[arg-type]
    return SandboxRecord(id=sandbox_id, node=node, spec=spec, state=state, reason=reason, created_at=1.0,
                         updated_at=1.0, init_pid=pid, init_start_time=7 if pid else 0)


LEVELS = ["process", "container"]
ROOTS = {"sb-1": object()}


# -- recovery ---------------------------------------------------------------------------


def test_a_running_sandbox_whose_init_lives_is_readopted_running():
    assert decisions.after_restart(record(State.RUNNING), True, LEVELS, ROOTS) == decisions.Readopt()


def test_a_paused_sandbox_is_readopted_paused_and_a_quarantined_one_quarantined():
    paused = decisions.after_restart(record(State.PAUSED, reason=Reason.REQUESTED), True, LEVELS, ROOTS)
    assert paused == decisions.Readopt(paused=True, quarantined=False)
    quarantined = decisions.after_restart(record(State.PAUSED, reason=Reason.VIOLATION), True, LEVELS, ROOTS)
    assert quarantined == decisions.Readopt(paused=False, quarantined=True)


def test_a_sandbox_whose_init_died_is_lost_on_restart():
    plan = decisions.after_restart(record(State.RUNNING), False, LEVELS, ROOTS)
    assert plan == decisions.Ending(State.FAILED, Reason.LOST_ON_RESTART, "was running")


@pytest.mark.parametrize("alive", [True, False])
@pytest.mark.parametrize("state", [State.SCHEDULED, State.STARTING])
def test_a_launch_a_crash_cut_short_is_built_again_whatever_init_it_left(state, alive):
    """Issue 16 §2: the node finishes what placement handed it; an init the cut launch left is
    not on record, so it is never adopted (recovery kills it with its confinement)."""
    assert decisions.after_restart(record(state), alive, LEVELS, ROOTS) == decisions.Relaunch()
    assert decisions.after_restart(record(state), alive, LEVELS, {}) == decisions.Relaunch()  # its root comes anew


@pytest.mark.parametrize("state", [State.SCHEDULED, State.STARTING])
def test_a_launch_of_a_level_the_node_no_longer_runs_is_lost(state):
    plan = decisions.after_restart(record(state, isolation="container"), False, ["process"], ROOTS)
    assert plan == decisions.Ending(State.FAILED, Reason.LOST_ON_RESTART, f"was {state.value}")


def test_a_destroy_a_crash_interrupted_finishes_stopped_with_its_reason():
    plan = decisions.after_restart(record(State.STOPPING, reason=Reason.EXPIRED), True, LEVELS, ROOTS)
    assert plan == decisions.Ending(State.STOPPED, Reason.EXPIRED)


def test_a_sandbox_of_a_level_the_node_no_longer_runs_is_lost():
    plan = decisions.after_restart(record(State.RUNNING, isolation="container"), True, ["process"], ROOTS)
    assert isinstance(plan, decisions.Ending) and plan.reason is Reason.LOST_ON_RESTART


def test_a_sandbox_whose_root_the_layer_cache_lost_is_ended_and_says_why():
    plan = decisions.after_restart(record(State.RUNNING), True, LEVELS, {})
    assert isinstance(plan, decisions.Ending) and plan.reason is Reason.LOST_ON_RESTART
    assert "no longer holds its root" in plan.why


def test_roots_are_trusted_when_the_layer_cache_did_not_answer_and_the_host_view_needs_none():
    assert decisions.after_restart(record(State.RUNNING), True, LEVELS, None) == decisions.Readopt()
    assert decisions.after_restart(record(State.RUNNING, host_view=True), True, LEVELS, {}) == decisions.Readopt()


def test_roots_no_live_sandbox_owns_are_orphans():
    assert decisions.orphan_roots({"a": 1, "b": 2, "c": 3}, ["b"]) == ["a", "c"]
    assert decisions.orphan_roots(None, ["b"]) == []


def test_the_recorded_anchor_is_what_running_wrote():
    assert records.anchor_of(record(State.RUNNING, pid=42)) == Anchor(42, 7)
    assert records.anchor_of(record(State.RUNNING)) is None


# -- destroy ----------------------------------------------------------------------------


@pytest.mark.parametrize("reason", [Reason.REQUESTED, Reason.VIOLATION])
def test_a_caller_destroys_as_requested_or_for_a_violation(reason):
    assert decisions.destroy_reason_refusal(reason) is None


def test_a_caller_may_not_destroy_with_a_platform_reason():
    refused = decisions.destroy_reason_refusal(Reason.EXPIRED)
    assert refused is not None and refused.code is ErrorCode.INVALID_REQUEST
    assert refused.message == "a destroy's reason is requested or violation, not expired"


def test_destroying_what_is_not_live_here():
    ended = decisions.destroy_refusal("sb-1", record(State.STOPPED), NODE)
    assert ended is not None and ended.code is ErrorCode.NOT_FOUND and ended.message == "sandbox sb-1 is stopped"
    elsewhere = decisions.destroy_refusal("sb-1", record(State.RUNNING, node="n2"), NODE)
    assert elsewhere is not None and elsewhere.code is ErrorCode.NOT_FOUND
    starting = decisions.destroy_refusal("sb-1", record(State.STARTING), NODE)
    assert starting is not None and starting.code is ErrorCode.CONFLICT
    assert starting.message == "sandbox sb-1 is still starting"
    # A crash left it stopping or running with no live entry: destroy finishes it from the record.
    assert decisions.destroy_refusal("sb-1", record(State.STOPPING), NODE) is None
    assert decisions.destroy_refusal("sb-1", record(State.RUNNING), NODE) is None


def test_a_retried_kill_of_a_sandbox_already_killed_for_a_violation_is_answered_not_refused():
    killed = record(State.FAILED, reason=Reason.VIOLATION)
    assert decisions.already_destroyed(killed, Reason.VIOLATION, NODE)
    assert not decisions.already_destroyed(killed, Reason.REQUESTED, NODE)  # a user's destroy: not found
    assert not decisions.already_destroyed(record(State.FAILED, reason=Reason.PROCESS_EXITED), Reason.VIOLATION, NODE)
    assert not decisions.already_destroyed(record(State.RUNNING), Reason.VIOLATION, NODE)  # live: destroyed for real
    assert not decisions.already_destroyed(record(State.FAILED, reason=Reason.VIOLATION, node="n2"), Reason.VIOLATION,
                                           NODE)


def test_a_destroyed_sandbox_ends_failed_only_when_it_crashed_or_cheated():
    assert decisions.destroyed_state(Reason.REQUESTED) is State.STOPPED
    assert decisions.destroyed_state(Reason.EXPIRED) is State.STOPPED
    assert decisions.destroyed_state(Reason.PROCESS_EXITED) is State.FAILED
    assert decisions.destroyed_state(Reason.VIOLATION) is State.FAILED


# -- fencing and selection --------------------------------------------------------------


def test_fencing_drops_what_ended_elsewhere_vanished_or_moved_and_keeps_the_rest():
    found = {
        "keep": (record(State.RUNNING, sandbox_id="keep"), 3),
        "ended": (record(State.FAILED, sandbox_id="ended", reason=Reason.NODE_LOST), 4),
        "moved": (record(State.RUNNING, sandbox_id="moved", node="n2"), 5),
    }
    dropped = dict(decisions.to_drop(["keep", "ended", "moved", "gone"], found, NODE))
    assert set(dropped) == {"ended", "moved", "gone"}
    assert dropped["gone"] == "its record is gone"
    assert dropped["moved"] == "its record names node n2"
    assert dropped["ended"].startswith("its record was ended elsewhere (failed, node_lost")


def test_selection_needs_every_wanted_label():
    labels = {"a": {"job": "x", "role": "w"}, "b": {"job": "x"}, "c": {"job": "y"}}
    assert decisions.selected(labels, {"job": "x"}) == ["a", "b"]
    assert decisions.selected(labels, {"job": "x", "role": "w"}) == ["a"]
    assert decisions.selected(labels, {}) == ["a", "b", "c"]


# -- settings, intake, log keys -----------------------------------------------------------


def test_settings_keep_their_variables_and_defaults(monkeypatch):
    for name in ("SANDFLEET_FENCE_S", "SANDFLEET_LAUNCH_CONCURRENCY", "SANDFLEET_STARTING_GRACE_S"):
        monkeypatch.delenv(name, raising=False)
    assert LauncherSettings.from_env() == LauncherSettings(launch_concurrency=16, starting_grace_s=0.5, fence_s=15.0)
    monkeypatch.setenv("SANDFLEET_FENCE_S", "2.5")
    monkeypatch.setenv("SANDFLEET_LAUNCH_CONCURRENCY", "4")
    monkeypatch.setenv("SANDFLEET_STARTING_GRACE_S", "0.1")
    assert LauncherSettings.from_env() == LauncherSettings(launch_concurrency=4, starting_grace_s=0.1, fence_s=2.5)


def test_intake_counts_what_it_took_and_forgets_what_it_answered():
    intake = Intake()
    items = [LaunchItem(id="sb-a", spec=SandboxSpec(cpu=0.5, memory_mb=64)),
             LaunchItem(id="sb-b", spec=SandboxSpec(cpu=1.0, memory_mb=128))]
    intake.took(items)
    assert (intake.accepted, intake.accepted_cpu, intake.accepted_memory_mb) == (2, 1.5, 192)
    assert set(intake.starting) == {"sb-a", "sb-b"}
    intake.answered(items)
    assert intake.starting == {} and intake.accepted == 2  # the counters only grow: placement diffs them


def test_launcher_log_lines_carry_the_canonical_keys():
    logger = logging.getLogger("sandfleet.launcher.unit-test")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            seen.append(self.format(rec))

    handler = Keep()
    handler.setFormatter(CanonicalFormatter("launcher", node_id=NODE))  # as runner.run(node_scoped=True) sets it
    logger.addHandler(handler)
    try:
        logger.warning("launch of %s failed: %s", "sb-1", "boom", extra=about("sb-1"))
    finally:
        logger.removeHandler(handler)
    [line] = seen
    assert line.endswith(f"launch of sb-1 failed: boom {telemetry.SANDBOX_ID}=sb-1 {telemetry.NODE_ID}={NODE}")


# -- the driver registry ------------------------------------------------------------------


class _Stopper:
    """Records what it was asked: only the registry's choice of driver is under test."""

    def __init__(self) -> None:
        self.stopped: list[tuple[str, Anchor | None]] = []

    async def stop(self, sandbox_id: str, anchor: Anchor | None) -> None:
        self.stopped.append((sandbox_id, anchor))

    def alive(self, anchor: Anchor) -> bool:
        return True


async def test_a_level_the_node_lost_is_stopped_through_its_host_process():
    process = _Stopper()
    drivers = Drivers({"process": process})  # type: ignore[dict-item]
    assert drivers.levels == ["process"] and "container" not in drivers
    with pytest.raises(LaunchRefused, match="cannot run isolation 'container'"):
        drivers.driver("container")
    await drivers.stop("container", "sb-1", Anchor(42, 7))
    assert process.stopped == [("sb-1", Anchor(42, 7))]
    assert drivers.alive("container", Anchor(42, 7))


# -- the node library's CPU weight file ------------------------------------------------------


def test_the_cpu_weight_is_v2_cpu_weight_where_it_exists_else_v1_cpu_shares(tmp_path: Path):
    v2, v1cpu, v1mem = tmp_path / "v2", tmp_path / "cpu", tmp_path / "memory"
    for d in (v2, v1cpu, v1mem):
        d.mkdir()
    procs = [str(v1mem / "cgroup.procs"), str(v1cpu / "cgroup.procs"), str(v2 / "cgroup.procs")]
    assert cgroups.cpu_weight_file(str(v2), procs) is None
    (v1cpu / "cpu.shares").touch()  # cgroupfs takes a write whole; a plain file is empty first
    shares = cgroups.cpu_weight_file(str(v2), procs)
    assert shares == cgroups.CpuWeightFile(str(v1cpu / "cpu.shares"), 2, 1024)
    assert shares.write(idle=True) == 2 and (v1cpu / "cpu.shares").read_text() == "2"
    (v2 / "cpu.weight").touch()
    weight = cgroups.cpu_weight_file(str(v2), procs)
    assert weight == cgroups.CpuWeightFile(str(v2 / "cpu.weight"), 1, 100)
    assert weight.write(idle=False) == 100


# -- the handlers' translation of the drivers' errors ------------------------------------------


def test_freeze_errors_become_the_callers_conflict_or_ours():
    from sandfleet.errors import ServiceError
    from services.launcher.drivers.base import DriverFailure
    from services.launcher.handlers import _freezing

    with pytest.raises(ServiceError) as gone:
        with _freezing("freeze sandbox sb-1"):
            raise FileNotFoundError(2, "No such file or directory")
    assert gone.value.code is ErrorCode.CONFLICT
    assert gone.value.message == "cannot freeze sandbox sb-1: ENOENT No such file or directory"
    with pytest.raises(ServiceError) as stuck:
        with _freezing("freeze sandbox sb-1"):
            raise DriverFailure("/sys/fs/cgroup/x did not freeze within 2 s")
    assert stuck.value.code is ErrorCode.INTERNAL and stuck.value.message.endswith("did not freeze within 2 s")


def test_driver_errors_become_the_bus_errors_by_what_they_are_about():
    from services.launcher.driver_errors import service_error
    from services.launcher.drivers.base import DriverFailure, ExecFailed, SandboxGone, Unsupported

    assert service_error(SandboxGone("x"), "/a").message == "the sandbox's init is gone"
    assert service_error(FileNotFoundError(2, "No such file"), "/a").code is ErrorCode.NOT_FOUND
    assert service_error(ValueError("too big"), "/a").message == "/a: too big"
    assert service_error(PermissionError(30, "Read-only file system"), "/usr/x").message == (
        "/usr/x: EROFS Read-only file system")
    assert service_error(OSError(28, "No space left on device"), "/w/f").code is ErrorCode.CAPACITY
    assert service_error(Unsupported("no ports here"), "port 80").code is ErrorCode.UNSUPPORTED
    assert service_error(ExecFailed("ENOEXEC"), "/w").code is ErrorCode.CONFLICT
    assert service_error(DriverFailure("did not freeze"), "freeze").code is ErrorCode.INTERNAL
    assert service_error(TimeoutError(), "port 80 of sb-1", path=False).code is ErrorCode.TIMEOUT
    # About the sandbox's own state, not a path the caller named: a vanished file is a conflict.
    gone = service_error(FileNotFoundError(2, "No such file or directory"), "cannot freeze sb-1", path=False)
    assert gone.code is ErrorCode.CONFLICT and gone.message == "cannot freeze sb-1: ENOENT No such file or directory"

def test_an_images_user_reads_as_docker_reads_it():
    from sandfleet.errors import ServiceError
    from services.launcher.image_config import ids_of
    passwd = b"root:x:0:0::/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n# comment\nbroken\n"
    group = b"root:x:0:\nstaff:x:50:app\n"
    assert ids_of("app", passwd, group) == (1000, 1001)
    assert ids_of("app:staff", passwd, group) == (1000, 50)
    assert ids_of("app:7", passwd, group) == (1000, 7)
    assert ids_of("1000", passwd, group) == (1000, 1001)  # a number in passwd takes its group
    assert ids_of("4242", passwd, group) == (4242, 0)  # one that is not: gid 0, as docker does
    for bad, why in (("ghost", "no user"), ("app:ghosts", "no group"), ("70000", "outside"), ("app:99999", "outside")):
        with pytest.raises(ServiceError, match=why):
            ids_of(bad, passwd, group)
    assert ids_of("app", b"\xff\xfe:::\n" + passwd, group) == (1000, 1001)  # garbage lines are skipped

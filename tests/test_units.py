"""Pure logic, no bus and no kernel: state machine, placement policy, schema limits, error mapping."""

from __future__ import annotations

import msgspec
import pytest

from sandfleet import errors
from schemas import events
from schemas.errors import ErrorBody, ErrorCode
from schemas.node import NodeInfo
from schemas.sandbox import TRANSITIONS, CreateRequest, State, can_transition
from services.placement.policy import NoCapacity, NodeView, NoEligibleNode


def test_ended_states_allow_no_transition():
    assert not TRANSITIONS[State.STOPPED] and not TRANSITIONS[State.FAILED]


def test_every_state_can_reach_an_end():
    for state in State:
        seen, frontier = set(), {state}
        while frontier:
            seen |= frontier
            frontier = {n for s in frontier for n in TRANSITIONS[s]} - seen
        assert seen & {State.STOPPED, State.FAILED}, state


def test_running_cannot_go_back_to_starting():
    assert not can_transition(State.RUNNING, State.STARTING)
    assert can_transition(State.RUNNING, State.STOPPING)


def test_return_from_pause_is_a_resumed_event():
    assert events.event_type(State.PAUSED, State.RUNNING) is events.Resumed
    assert events.event_type(State.STARTING, State.RUNNING) is events.Started


@pytest.mark.parametrize(
    "body",
    [
        b'{"isolation":"gpu"}',
        b'{"cpu":-1}',
        b'{"memory_mb":0}',
        b'{"memory_mb":99999999}',
        b'{"timeout_s":"10"}',
        b'{"labels":{"":"x"}}',
        b'{"surprise":1}',
    ],
)
def test_create_request_rejects_bad_values(body):
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=CreateRequest)


def test_create_request_defaults_from_empty_object():
    req = msgspec.json.decode(b"{}", type=CreateRequest)
    assert req.isolation == "process" and req.memory_mb == 512


def _node(node_id, capacity=10, running=0, isolation=("process",), at=100.0):
    return NodeInfo(id=node_id, isolation=list(isolation), capacity=capacity, running=running, cpus=2, memory_mb=1024, at=at)


def test_placement_spreads_a_batch_by_free_slots():
    view = NodeView()
    view.heartbeat(_node("a", capacity=30))
    view.heartbeat(_node("b", capacity=10))
    plan = view.place("process", 20, now=101.0)
    assert plan == {"a": 15, "b": 5}


def test_placement_counts_what_it_sent_since_the_last_heartbeat():
    view = NodeView()
    view.heartbeat(_node("a", capacity=3))
    view.place("process", 3, now=101.0)
    with pytest.raises(NoCapacity):
        view.place("process", 1, now=101.0)
    view.heartbeat(_node("a", capacity=3, running=1, at=102.0))
    assert view.place("process", 2, now=102.0) == {"a": 2}


def test_placement_says_when_no_node_offers_the_isolation_level():
    view = NodeView()
    view.heartbeat(_node("a"))
    with pytest.raises(NoEligibleNode, match="microvm"):
        view.place("microvm", 1, now=101.0)


def test_placement_ignores_stale_nodes():
    view = NodeView()
    view.heartbeat(_node("a", at=0.0))
    with pytest.raises(NoCapacity):
        view.place("process", 1, now=100.0)


def test_error_bodies_map_to_the_documented_exceptions():
    for code, kind in [
        (ErrorCode.INVALID_REQUEST, errors.InvalidRequest),
        (ErrorCode.NOT_FOUND, errors.NotFound),
        (ErrorCode.CAPACITY, errors.Capacity),
        (ErrorCode.UNSUPPORTED, errors.Unsupported),
        (ErrorCode.FORBIDDEN, errors.Forbidden),
    ]:
        exc = errors.from_body(ErrorBody(code=code, message="m"))
        assert isinstance(exc, kind) and isinstance(exc, errors.SandfleetError)


def test_committed_json_schemas_match_the_structs():
    from pathlib import Path

    from schemas.export import render

    folder = Path(__file__).resolve().parent.parent / "schemas" / "json"
    for name, text in render().items():
        assert (folder / name).read_text() == text, f"{name} is stale: run `make schemas`"


def test_a_stopping_service_is_not_killed_while_it_still_makes_progress():
    """`_terminate` waits `timeout` after the last change in progress (a launcher destroying
    thousands of sandboxes at `down`), and only then kills. Run in a child interpreter: it
    reaps any child of its caller."""
    import subprocess
    import sys
    script = """
import signal, subprocess, sys, time
from sandfleet.supervisor import _terminate
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE)
child.stdout.readline()  # its SIGTERM handler is in place
start = time.monotonic()
alive_while_progressing = []
def progress():
    elapsed = time.monotonic() - start
    if elapsed < 3.0:
        alive_while_progressing.append(subprocess.run(["kill", "-0", str(child.pid)]).returncode == 0)
        return 1000 - int(elapsed * 10)  # still falling: keep waiting
    return 0  # stuck
_terminate([child.pid], 1.0, progress=progress)
gone = subprocess.run(["kill", "-0", str(child.pid)], capture_output=True).returncode != 0
print(len(alive_while_progressing), all(alive_while_progressing), gone)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    checks, alive, gone = int(out[0]), out[1] == "True", out[2] == "True"
    assert checks >= 2 and alive  # a 1 s timeout did not cut a 3 s stop that kept progressing
    assert gone  # once progress stopped, it was killed


def test_the_node_id_comes_from_the_flag_then_the_environment_then_the_host_name(monkeypatch, tmp_path):
    from sandfleet import config
    from sandfleet.supervisor import plan_nodes

    monkeypatch.setenv("SANDFLEET_NODE_ID", "from-env")
    assert config.node_id("from-flag") == "from-flag" and config.node_id() == "from-env"
    # `up --nodes 2` with the id only in the environment names its nodes after it, as `up --detach` waits for them
    assert [n.id for n in plan_nodes(tmp_path, 2, None)] == ["from-env-1", "from-env-2"]
    monkeypatch.delenv("SANDFLEET_NODE_ID")
    assert config.node_id() == config.default_node_id()

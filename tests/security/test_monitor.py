"""The security monitor on the real platform: a task's policy decides what happens to its
sandboxes once they make violations (real refused connect() calls), every action is an event
on the bus, and a monitor killed with SIGKILL loses no violation and acts once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import nats
import pytest

from sandfleet import errors
from sandfleet.credentials import connect_options
from linuxnode import cgroups, netns
from schemas import security
from schemas.sandbox import Reason, State
from schemas.security import SecurityAction
from tests.conftest import ROOT

CHEAT = ("import socket\nfor _ in range({n}):\n"
         "    try: socket.socket().connect(('10.1.2.3', 80))\n    except PermissionError: pass")
# Counts to the file every 20 ms until it is frozen; started in the background by `sh -c ... &`.
TICKER = "i=0; while true; do i=$((i+1)); echo $i > /workspace/ticks; sleep 0.02; done"


async def _cheat(sb, n: int, *, last: bool = False) -> None:
    """n refused connect() calls; `last`: the policy may end the sandbox before the command returns."""
    try:
        r = await sb.exec(["python3", "-c", CHEAT.format(n=n)], timeout_s=20)
    except errors.ServiceFailure:
        if last:
            return
        raise
    assert r.exit_code == 0 or last, r.stderr


async def _counted(fleet, sandbox_id: str, total: int, timeout: float = 10.0):
    """The monitor's record of the sandbox once it has counted `total` violations."""
    deadline = time.monotonic() + timeout
    while True:
        record = await fleet.security_record(sandbox_id)
        if record.total >= total or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.1)


async def _history(fleet, sandbox_id: str) -> list:
    """Every stored violation and action of the sandbox, until the stream is quiet for a second."""
    found = []
    stream = fleet.violations(sandbox_id, replay=True, actions=True).__aiter__()
    try:
        while True:
            found.append(await asyncio.wait_for(stream.__anext__(), 1.0))
    except asyncio.TimeoutError:
        pass
    finally:
        await stream.aclose()
    return found


class ActionWatch:
    """Starts following a sandbox's violations and actions now; `action()` waits for the first action."""

    def __init__(self, fleet, sandbox_id: str) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ready = asyncio.Event()
        self.task = asyncio.create_task(self._follow(fleet, sandbox_id))

    async def _follow(self, fleet, sandbox_id: str) -> None:
        stream = fleet.violations(sandbox_id, actions=True)
        self.ready.set()
        async for event in stream:
            await self.queue.put(event)

    async def __aenter__(self) -> ActionWatch:
        await self.ready.wait()
        await asyncio.sleep(0.3)  # let the consumer attach
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()

    async def action(self, timeout: float) -> SecurityAction:
        deadline = time.monotonic() + timeout
        while True:
            event = await asyncio.wait_for(self.queue.get(), max(0.01, deadline - time.monotonic()))
            if isinstance(event, SecurityAction):
                return event


async def _ended(fleet, sandbox_id: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        record = await fleet.get(sandbox_id)
        if record.state in (State.STOPPED, State.FAILED) or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.1)


async def _destroy_quietly(sb) -> None:
    try:
        await sb.destroy()
    except errors.ServiceFailure:
        pass  # the policy got there first


async def _ticks(sb, timeout: float = 10.0) -> int:
    """The ticker's count, once it has written one (a loaded machine may start it late)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = await sb.read_file("/workspace/ticks")
            if text.strip():
                return int(text)
        except errors.NotFound:
            pass
        assert time.monotonic() < deadline, "the ticker never wrote"
        await asyncio.sleep(0.05)


def _kernel_holds(node_id: str, sandbox_id: str) -> list[str]:
    held = [f"cgroup {d}" for d in cgroups.SandboxCgroups(cgroups.CgroupLayout.detect(), node_id, sandbox_id).dirs
            if os.path.isdir(d)]
    return held + [f"netns {n}" for n in netns.list_sandboxes(node_id) if n == sandbox_id]


async def test_record_policy_records_violations_and_the_sandbox_keeps_running(fleet, platform):
    sb = await fleet.create(memory_mb=64, labels={"task": "mon-record"}, host_view=True)
    try:
        await _cheat(sb, 3)
        record = await _counted(fleet, sb.id, 3)
        assert (record.total, record.counts, record.task) == (3, {"network": 3}, "mon-record")
        assert record.action_state == "none"
        assert (await fleet.get(sb.id)).state is State.RUNNING
        assert (await sb.exec(["echo", "still here"])).stdout == b"still here\n"
        kinds = [type(e).__name__ for e in await _history(fleet, sb.id)]
        assert kinds == ["Violation"] * 3  # recorded, never acted on
    finally:
        await sb.destroy()


async def test_kill_policy_destroys_the_sandbox_on_the_third_network_violation(fleet, platform):
    await fleet.set_policy(task="mon-kill", action="kill", thresholds={"network": 3})
    sb = await fleet.create(memory_mb=64, labels={"task": "mon-kill"}, host_view=True)
    try:
        async with ActionWatch(fleet, sb.id) as watch:
            await _cheat(sb, 2)
            assert (await _counted(fleet, sb.id, 2)).total == 2
            assert (await fleet.get(sb.id)).state is State.RUNNING  # below the threshold
            await _cheat(sb, 1, last=True)
            action = await watch.action(timeout=10)
        assert (action.sandbox_id, action.action, action.task, action.outcome) == (sb.id, "kill", "mon-kill", "done")
        assert (action.trigger, action.count, action.threshold) == ("network", 3, 3)
        assert [v.kind for v in action.violations] == ["network.connect"] * 3
        record = await _ended(fleet, sb.id)
        assert (record.state, record.reason) == (State.FAILED, Reason.VIOLATION)
        assert "kill after 3 network violation(s)" in record.detail
        assert _kernel_holds(platform.node_id, sb.id) == []
        shown = platform.cli("events", "--violations", "--task", "mon-kill").stdout.decode().splitlines()
        assert any(json.loads(line)["type"] == "security.action" and sb.id in line for line in shown)
    finally:
        await _destroy_quietly(sb)


async def test_quarantine_freezes_the_sandbox_keeps_its_files_and_destroy_still_works(fleet, platform):
    await fleet.set_policy(task="mon-quarantine", action="quarantine", thresholds={"network": 1})
    sb = await fleet.create(memory_mb=64, labels={"task": "mon-quarantine"}, host_view=True)
    try:
        await sb.write_file("/workspace/evidence.txt", b"the agent wrote this")
        r = await sb.exec(["sh", "-c", f"({TICKER}) >/dev/null 2>&1 &"])
        assert r.exit_code == 0, r.stderr
        first = await _ticks(sb)
        await asyncio.sleep(0.3)
        assert await _ticks(sb) > first  # it makes progress while not frozen
        async with ActionWatch(fleet, sb.id) as watch:
            # The cheat stays running after its refused connect(): the freeze catches it mid-command.
            cheat = asyncio.create_task(sb.exec(["python3", "-c", CHEAT.format(n=1) + "\nimport time; time.sleep(60)"],
                                                timeout_s=120))
            action = await watch.action(timeout=10)
        assert (action.action, action.outcome) == ("quarantine", "done")
        with pytest.raises(errors.Conflict):  # answered at once, not after the command's timeout
            await asyncio.wait_for(cheat, 10)
        record = await fleet.get(sb.id)
        assert (record.state, record.reason) == (State.PAUSED, Reason.VIOLATION)
        v2 = cgroups.SandboxCgroups(cgroups.CgroupLayout.detect(), platform.node_id, sb.id).v2_dir
        with open(f"{v2}/cgroup.events") as f:
            assert "frozen 1" in f.read()
        frozen_at = await sb.read_file("/workspace/ticks")
        await asyncio.sleep(0.5)
        assert await sb.read_file("/workspace/ticks") == frozen_at  # no progress while quarantined
        assert await sb.read_file("/workspace/evidence.txt") == b"the agent wrote this"  # forensics
        with pytest.raises(errors.Conflict):
            await sb.exec(["true"])
        with pytest.raises(errors.Conflict):
            await sb.write_file("/workspace/evidence.txt", b"tampered")
        ended = await sb.destroy()
        assert ended.state is State.STOPPED
        assert _kernel_holds(platform.node_id, sb.id) == []
    finally:
        await _destroy_quietly(sb)


async def test_bad_policy_input_gets_a_typed_error(fleet, platform):
    for bad in (dict(action="nuke"), dict(thresholds={"network": -1}), dict(thresholds={"Net work": 2})):
        with pytest.raises(errors.InvalidRequest):
            await fleet.set_policy(task="mon-bad", **bad)
    with pytest.raises(errors.InvalidRequest):
        await fleet.set_policy(task="no spaces allowed")
    nc = await nats.connect(platform.url, **connect_options(platform.url))  # the operator's
    try:
        resp = await nc.request(security.POLICY_SET, b"{not json", timeout=5)
        assert resp.headers["Nats-Service-Error-Code"] == "400"
        assert json.loads(resp.data) | {"message": ""} == {"type": "error", "code": "invalid_request", "message": ""}
    finally:
        await nc.close()
    out = platform.cli("policy", "set", "--task", "mon-bad", "--action", "nuke", check=False)
    assert out.returncode == 2 and b"InvalidRequest" in out.stderr
    assert (await fleet.get_policy("mon-bad")).action == "record"  # nothing bad was stored
    out = platform.cli("policy", "set", "--task", "mon-cli", "--action", "quarantine", "--threshold", "network=4")
    assert json.loads(out.stdout)["thresholds"] == {"network": 4}
    shown = json.loads(platform.cli("policy", "get", "--task", "mon-cli").stdout)
    assert (shown["action"], shown["thresholds"]) == ("quarantine", {"network": 4})


async def test_a_monitor_killed_with_sigkill_loses_no_violation_and_acts_once(fleet, platform):
    await fleet.set_policy(task="mon-restart", action="kill", thresholds={"network": 3})
    sb = await fleet.create(memory_mb=64, labels={"task": "mon-restart"}, host_view=True)
    try:
        await _cheat(sb, 2)
        assert (await _counted(fleet, sb.id, 2)).total == 2
        old = platform.service_pid("security-monitor")
        os.kill(old, signal.SIGKILL)
        async with ActionWatch(fleet, sb.id) as watch:
            await _cheat(sb, 1)  # made while no monitor runs: it waits in the stream
            assert (await fleet.get(sb.id)).state is State.RUNNING
            await platform.restarted(fleet, "security-monitor", old)
            action = await watch.action(timeout=30)
        assert (action.action, action.count, action.outcome) == ("kill", 3, "done")
        assert (await _ended(fleet, sb.id)).reason is Reason.VIOLATION
        record = await _counted(fleet, sb.id, 3)
        assert (record.total, record.action_state) == (3, "done")  # each violation counted once
        actions = [e for e in await _history(fleet, sb.id) if isinstance(e, SecurityAction)]
        assert len(actions) == 1
        ended = [e for e in await fleet.history(sb.id) if e.name in ("stopping", "failed", "stopped")]
        assert [e.name for e in ended] == ["stopping", "failed"]  # destroyed once
    finally:
        await _destroy_quietly(sb)


async def test_two_monitor_replicas_share_the_work_and_act_on_each_sandbox_once(fleet, platform, tmp_path):
    await fleet.set_policy(task="mon-replicas", action="kill", thresholds={"network": 5})
    env = {**platform.env, "SANDFLEET_NATS_URL": platform.url, "SANDFLEET_DATA_DIR": str(platform.data_dir)}
    log = tmp_path / "replica.log"
    with open(log, "wb") as out:
        replica = subprocess.Popen([sys.executable, "-m", "services.security_monitor"], env=env, cwd=ROOT,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    boxes = []
    try:
        deadline = time.monotonic() + 30
        while b"security monitor serving" not in log.read_bytes():
            assert replica.poll() is None and time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.1)
        boxes = [await fleet.create(memory_mb=64, labels={"task": "mon-replicas"}, host_view=True) for _ in range(4)]
        watches = [ActionWatch(fleet, sb.id) for sb in boxes]
        for watch in watches:
            await watch.__aenter__()
        await asyncio.gather(*(_cheat(sb, 5, last=True) for sb in boxes))
        actions = await asyncio.gather(*(watch.action(timeout=15) for watch in watches))
        for watch in watches:
            await watch.__aexit__()
        assert sorted(a.sandbox_id for a in actions) == sorted(sb.id for sb in boxes)
        assert {(a.action, a.count, a.outcome) for a in actions} == {("kill", 5, "done")}
        for sb in boxes:
            assert (await _ended(fleet, sb.id)).reason is Reason.VIOLATION
            assert (await _counted(fleet, sb.id, 5)).total == 5
            assert len([e for e in await _history(fleet, sb.id) if isinstance(e, SecurityAction)]) == 1
            assert [e.name for e in await fleet.history(sb.id) if e.name == "stopping"] == ["stopping"]
        assert replica.poll() is None, log.read_text()  # the replica kept serving throughout
    finally:
        replica.send_signal(signal.SIGTERM)
        replica.wait(timeout=30)
        for sb in boxes:
            await _destroy_quietly(sb)


async def test_a_quarantined_sandbox_stays_quarantined_across_a_launcher_restart(fleet, platform):
    await fleet.set_policy(task="mon-q-restart", action="quarantine", thresholds={"network": 1})
    sb = await fleet.create(memory_mb=64, labels={"task": "mon-q-restart"}, host_view=True)
    try:
        await sb.write_file("/workspace/evidence.txt", b"kept")
        async with ActionWatch(fleet, sb.id) as watch:
            await _cheat(sb, 1, last=True)
            assert (await watch.action(timeout=10)).action == "quarantine"
        old = platform.service_pid("launcher")
        os.kill(old, signal.SIGKILL)
        await platform.restarted(fleet, "launcher", old)
        assert (await fleet.get(sb.id)).state is State.PAUSED
        with pytest.raises(errors.Conflict):
            await sb.exec(["true"])
        assert await sb.read_file("/workspace/evidence.txt") == b"kept"
        assert (await sb.destroy()).state is State.STOPPED
        assert _kernel_holds(platform.node_id, sb.id) == []
    finally:
        await _destroy_quietly(sb)

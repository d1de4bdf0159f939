"""`kill -9` of each service in the middle of its own work, and what must survive it.

The kill is triggered by an event of the work itself (a batch's first `started` event, a
sandbox's first `stopping`, a checkpoint's build directory appearing, a violation), never by a
sleep alone. After the supervisor has restarted the service: nothing accepted is lost (each
sandbox of the batch ends running, or ended with a reason; none is left scheduled, starting or
stopping), a sandbox whose init already ran is re-adopted, the service serves again, and after
the module's `down` nothing of the platform is left on the machine.

All of it runs on one platform of the module's own (a crash mid-work is no neighbour for the
session's other tests); the supervisor's own crash comes last and ends it. Counts of each
outcome are printed (`-s`) for the record: they vary with the moment the kill lands.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import sandfleet
from linuxnode import cgroups
from sandfleet import errors
from sandfleet.layers_client import Layers
from schemas import events, violations
from schemas import node as node_schema
from schemas.node import ConfinedList, Empty
from schemas.sandbox import (
    ENDED,
    CreateManyReply,
    CreateManyRequest,
    CREATE_MANY,
    Reason,
    SandboxSpec,
    State,
)
from schemas.security import SecurityAction
from tests.conftest import NODE_ID, own_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

SETTLE_S = 120.0  # a batch must be settled this long after the restarted service answers
# This machine is shared (parallel test sessions): its pressure says nothing about this node.
QUIET = {"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101"}
SMALL = dict(memory_mb=16, cpu=0.01, host_view=True)
CHEAT = ("import socket\n"
         "try: socket.socket().connect(('10.1.2.3', 80))\n"
         "except PermissionError: pass")


@pytest.fixture(scope="module")
def plat(leak_check, tmp_path_factory):
    with own_platform(tmp_path_factory.mktemp("midwork"), f"{NODE_ID}-mw", env=QUIET) as p:
        yield p


@pytest.fixture
async def fleet(plat):
    async with sandfleet.connect(plat.url) as f:
        yield f


# -- helpers ----------------------------------------------------------------------------


@dataclass
class FirstEvent:
    """Lifecycle events `<state>` seen from now on: `first` is set by the first of them."""

    state: str
    ids: set[str] = field(default_factory=set)
    first: asyncio.Event = field(default_factory=asyncio.Event)
    sub: object = None

    async def start(self, fleet) -> FirstEvent:
        async def seen(msg) -> None:
            self.ids.add(events.sandbox_id_of(msg.subject))
            self.first.set()

        self.sub = await fleet.bus.nc.subscribe(events.sandbox_subject("*", self.state), cb=seen)
        await fleet.bus.nc.flush()
        return self

    async def wait(self, timeout: float = 120.0) -> set[str]:
        await asyncio.wait_for(self.first.wait(), timeout)
        return set(self.ids)

    async def stop(self) -> None:
        await self.sub.unsubscribe()


async def _gang(fleet, count: int, **spec) -> list[str]:
    """A gang batch (placement answers once all are recorded; the node launches on)."""
    reply = await fleet.bus.request(CREATE_MANY, CreateManyRequest(count=count, spec=SandboxSpec(**spec), wait=False),
                                    CreateManyReply, timeout=60)
    return [i for p in reply.placements for i in p.ids]


@dataclass(frozen=True)
class End:
    state: State
    reason: Reason
    detail: str


async def _outcome(fleet, ids: list[str], timeout: float = SETTLE_S) -> dict[str, End]:
    """Each sandbox's state once none is between states any more (a forgotten record is a
    stopped sandbox: its last event says so)."""
    deadline = time.monotonic() + timeout
    while True:
        records = {r.id: r for r in await fleet.list(include_ended=True)}
        found = {i: End(r.state, r.reason, r.detail) for i, r in records.items() if i in ids}
        busy = {i: e.state for i, e in found.items() if e.state is not State.RUNNING and e.state not in ENDED}
        if not busy:
            break
        assert time.monotonic() < deadline, f"still between states {SETTLE_S:g}s on: {Counter(busy.values())}"
        await asyncio.sleep(0.5)
    for i in set(ids) - set(found):
        last = (await fleet.history(i))[-1]
        found[i] = End(last.state, last.reason, last.detail)
    return found


def _accounted(outcome: dict[str, End]) -> Counter:
    """Every sandbox running or ended, each failure with a reason; the counts, printed for the report."""
    for i, e in outcome.items():
        assert e.state in (State.RUNNING, State.STOPPED, State.FAILED), (i, e)
        if e.state is State.FAILED:
            assert e.reason is not Reason.NONE and e.detail, (i, e)
    counts = Counter(f"{e.state.value}/{e.reason.value}" + (f" ({e.detail[:40]})" if e.state is State.FAILED else "")
                     for e in outcome.values())
    print(f"outcome of {len(outcome)}: {dict(counts)}")
    return counts


async def _destroy(fleet, outcome: dict[str, End]) -> None:
    running = [i for i, e in outcome.items() if e.state is State.RUNNING]
    for start in range(0, len(running), 50):
        await asyncio.gather(*(_destroy_one(fleet, i) for i in running[start:start + 50]))


async def _destroy_one(fleet, sandbox_id: str) -> None:
    try:
        await (await fleet.sandbox(sandbox_id)).destroy()
    except errors.NotFound:
        pass


async def _confined(fleet, node_id: str) -> set[str]:
    reply = await fleet.bus.request(node_schema.subject(node_id, node_schema.AGENT_LIST), Empty(), ConfinedList)
    return set(reply.sandbox_ids)


async def _serves(fleet, **spec) -> None:
    sb = await fleet.create(**(spec or SMALL))
    assert (await sb.exec(["echo", "ok"])).stdout == b"ok\n"
    await sb.destroy()


def _kill(plat, service: str) -> int:
    pid = plat.service_pid(service)
    os.kill(pid, signal.SIGKILL)
    return pid


async def _running_exactly(fleet, plat, outcome: dict[str, End], settle_s: float = 15.0) -> None:
    """The node agrees with the records: its agent holds exactly the running ones (once the
    releases of the failed ones are through), and each answers."""
    running = {i for i, e in outcome.items() if e.state is State.RUNNING}
    deadline = time.monotonic() + settle_s
    while (held := await _confined(fleet, plat.node_id) & set(outcome)) != running and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert running <= held, f"running but not confined: {sorted(running - held)}"
    extra = {i: outcome[i] for i in sorted(held - running)}
    assert not extra, f"the agent still holds {len(extra)} ended sandbox(es) {settle_s:g}s on: {list(extra.items())[:3]}"
    for i in running:
        assert (await (await fleet.sandbox(i)).exec(["true"])).exit_code == 0


# -- placement ---------------------------------------------------------------------------


async def test_placement_killed_mid_batch_loses_none_of_it(fleet, plat):
    started = await FirstEvent("started").start(fleet)
    ids = await _gang(fleet, 100, **SMALL)
    await started.wait()
    old = _kill(plat, "placement")  # the batch is on its node: the node owns it from here
    await started.stop()
    await plat.restarted(fleet, "placement", old)

    outcome = await _outcome(fleet, ids)
    counts = _accounted(outcome)
    # Placement had handed the whole batch over; its death takes none of it.
    assert counts == Counter({"running/none": 100}), counts
    await _running_exactly(fleet, plat, outcome)
    await _serves(fleet)
    await _destroy(fleet, outcome)
    assert not await _confined(fleet, plat.node_id) & set(ids)


# -- launcher ----------------------------------------------------------------------------


async def test_launcher_killed_mid_launch_fails_the_unstarted_with_a_reason_and_keeps_the_started(fleet, plat):
    started = await FirstEvent("started").start(fleet)
    ids = await _gang(fleet, 100, **SMALL)
    await started.wait()
    old = _kill(plat, "launcher")
    await asyncio.sleep(0.2)  # events already on the wire when it died
    ran = set(started.ids)
    await started.stop()
    await plat.restarted(fleet, "launcher", old)

    outcome = await _outcome(fleet, ids)
    counts = _accounted(outcome)
    running = {i for i, e in outcome.items() if e.state is State.RUNNING}
    assert ran <= running, f"started before the kill but not re-adopted: {sorted(ran - running)[:5]}"
    assert len(running) >= 1
    for i, e in outcome.items():  # what it had not started is failed by its restart, saying where it was
        if e.state is State.FAILED:
            assert e.reason in (Reason.LOST_ON_RESTART, Reason.LAUNCH_FAILED), (i, e)
    assert sum(counts.values()) == 100
    await _running_exactly(fleet, plat, outcome)
    await _serves(fleet)
    await _destroy(fleet, outcome)
    assert not await _confined(fleet, plat.node_id) & set(ids)


async def test_launcher_killed_mid_destroy_finishes_or_keeps_each_sandbox(fleet, plat):
    boxes = await fleet.create_many(20, **SMALL)
    ids = [b.id for b in boxes]
    stopping = await FirstEvent("stopping").start(fleet)

    async def destroy(sb) -> bool:
        req = node_schema.DestroyRequest(sandbox_id=sb.id)
        try:  # not the SDK's 60 s: a request the dead launcher took is never answered
            await fleet.bus.request(node_schema.subject(plat.node_id, node_schema.DESTROY), req,
                                    node_schema.DestroyReply, timeout=15)
            return True
        except errors.SandfleetError:
            return False  # the launcher died under the request: the caller is told

    destroys = [asyncio.create_task(destroy(b)) for b in boxes]
    await stopping.wait()
    old = _kill(plat, "launcher")
    await stopping.stop()
    answered = dict(zip(ids, await asyncio.gather(*destroys)))
    await plat.restarted(fleet, "launcher", old)

    outcome = await _outcome(fleet, ids)
    _accounted(outcome)
    for i, e in outcome.items():
        if answered[i]:  # a destroy that was answered is done
            assert e.state is State.STOPPED, (i, e)
        # one whose destroy got no answer ended (a `stopping` record is finished by the restart)
        # or is still running, re-adopted: never in between
    assert any(not ok for ok in answered.values()), "the kill landed after every destroy was answered"
    await _running_exactly(fleet, plat, outcome)
    await _destroy(fleet, outcome)
    assert not await _confined(fleet, plat.node_id) & set(ids)


@pytest.fixture(scope="module")
async def base_layer(plat, tmp_path_factory):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("mw-base") / "base"
    make_busybox_base(src)
    async with sandfleet.connect(plat.url) as fleet:
        await Layers(fleet.bus).build_dir("mw-base", src)
    return "mw-base"


async def test_launcher_killed_mid_checkpoint_leaves_the_sandbox_usable(fleet, plat, base_layer):
    sb = await fleet.create(memory_mb=64, layers=[base_layer])
    try:
        await sb.write_file("/workspace/state", b"before")
        builds = plat.data_dir / "layer-cache" / "build"
        before = set(os.listdir(builds)) if builds.exists() else set()
        checkpoint = asyncio.create_task(sb.checkpoint("mw-ckpt", timeout_s=20))
        deadline = time.monotonic() + 60
        while not (builds.exists() and set(os.listdir(builds)) - before):  # the layer-cache builds it now
            assert time.monotonic() < deadline and not checkpoint.done(), "the checkpoint never reached its build"
            await asyncio.sleep(0.01)
        old = _kill(plat, "launcher")  # the sandbox is frozen for a consistent picture
        try:
            await checkpoint
        except errors.SandfleetError:
            pass  # its caller is told it failed
        await plat.restarted(fleet, "launcher", old)

        record = await fleet.get(sb.id)
        assert record.state is State.RUNNING, record
        v2_dir = cgroups.SandboxCgroups(cgroups.CgroupLayout.detect(), plat.node_id, sb.id).v2_dir
        assert Path(v2_dir, "cgroup.freeze").read_text().strip() == "0", "re-adopted as running, but still frozen"
        r = await sb.exec(["cat", "/workspace/state"], timeout_s=5)
        assert r.stdout == b"before"
        await sb.write_file("/workspace/state", b"after")
        again = await sb.checkpoint("mw-ckpt2")  # and the restarted launcher checkpoints it
        assert again.digest
    finally:
        await _destroy_one(fleet, sb.id)


# -- node agent and layer-cache ----------------------------------------------------------


async def test_agent_killed_mid_confine_loses_none_of_the_batch(fleet, plat):
    started = await FirstEvent("started").start(fleet)
    ids = await _gang(fleet, 60, **SMALL)
    await started.wait()
    old = _kill(plat, "agent")  # the launcher is confining the rest of the batch
    await asyncio.sleep(0.2)
    ran = set(started.ids)
    await started.stop()
    await plat.restarted(fleet, "agent", old)

    outcome = await _outcome(fleet, ids)
    _accounted(outcome)
    running = {i for i, e in outcome.items() if e.state is State.RUNNING}
    assert ran <= running and len(running) >= 1
    await _running_exactly(fleet, plat, outcome)
    await _serves(fleet)
    await _destroy(fleet, outcome)
    assert not await _confined(fleet, plat.node_id) & set(ids)


async def test_layer_cache_killed_mid_compose_loses_none_of_the_batch(fleet, plat, base_layer):
    started = await FirstEvent("started").start(fleet)
    ids = await _gang(fleet, 30, memory_mb=32, cpu=0.01, layers=[base_layer])
    await started.wait()
    old = _kill(plat, "layer-cache")  # the launcher is composing the rest of the batch's roots
    await asyncio.sleep(0.2)
    ran = set(started.ids)
    await started.stop()
    await plat.restarted(fleet, "layer-cache", old)

    outcome = await _outcome(fleet, ids)
    _accounted(outcome)
    running = {i for i, e in outcome.items() if e.state is State.RUNNING}
    assert ran <= running and len(running) >= 1
    await _running_exactly(fleet, plat, outcome)
    for i in running:  # a root composed before the kill still reads and writes
        r = await (await fleet.sandbox(i)).exec(["cat", "/etc/hostname"])
        assert r.stdout == b"base\n"
    await _serves(fleet, memory_mb=32, layers=[base_layer])
    await _destroy(fleet, outcome)
    assert not await _confined(fleet, plat.node_id) & set(ids)


# -- security monitor --------------------------------------------------------------------


async def test_security_monitor_killed_mid_policy_acts_once_after_its_restart(fleet, plat):
    await fleet.set_policy(task="mw-kill", action="kill", thresholds={"network": 1})
    sb = await fleet.create(memory_mb=64, host_view=True, labels={"task": "mw-kill"})
    seen = asyncio.Event()
    killed: list[int] = []

    async def violation(_msg) -> None:  # the monitor is consuming this very violation now
        if not killed:
            killed.append(_kill(plat, "security-monitor"))
        seen.set()

    sub = await fleet.bus.nc.subscribe(violations.sandbox_filter(sb.id), cb=violation)
    await fleet.bus.nc.flush()
    try:
        await sb.exec(["python3", "-c", CHEAT], timeout_s=20)
    except errors.ServiceFailure:
        pass  # the kill may land before the command returns
    await asyncio.wait_for(seen.wait(), 30)
    await sub.unsubscribe()
    await plat.restarted(fleet, "security-monitor", killed[0])

    deadline = time.monotonic() + 30
    while (end := (await _outcome(fleet, [sb.id]))[sb.id]).state is State.RUNNING:
        assert time.monotonic() < deadline, "the restarted monitor never acted on the violation"
        await asyncio.sleep(0.2)
    assert (end.state, end.reason) == (State.FAILED, Reason.VIOLATION), end
    # The kill may have been done before the crash; the action is announced either way, once: the
    # redelivered violation (after the consumer's ack wait) finds it pending and finishes it.
    actions = await _actions(fleet, sb.id)
    assert [a.action for a in actions] == ["kill"], actions
    assert actions[0].outcome == "done", actions[0]  # a retried kill that had landed is still "done"
    print(f"action after the monitor's restart: {actions[0].outcome!r}")
    assert (await fleet.security_record(sb.id)).action_state == "done"


async def _actions(fleet, sandbox_id: str, timeout: float = 45.0) -> list[SecurityAction]:
    """The sandbox's security actions: waits for the first, then for a quiet second more."""
    found: list[SecurityAction] = []
    stream = fleet.violations(sandbox_id, replay=True, actions=True).__aiter__()
    deadline = time.monotonic() + timeout
    try:
        while True:
            wait = 1.0 if found else deadline - time.monotonic()
            try:
                event = await asyncio.wait_for(stream.__anext__(), max(0.01, wait))
            except asyncio.TimeoutError:
                break
            if isinstance(event, SecurityAction):
                found.append(event)
    finally:
        await stream.aclose()
    return found


# -- the supervisor itself ---------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop_orphans(state: dict) -> None:
    """Stop what a dead supervisor left, as its own stop would: services in reverse start order
    (the launcher destroys its sandboxes while the agent is still there), the bus last."""
    order = ["security-monitor", "launcher", "reclaimer", "layer-cache", "agent", "placement"]
    pids = [state["services"][n] for n in order] + [state["services"][s["name"]] for s in state["nats"]]
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:  # stopped by us or by `down`: the supervisor's children were handed to us, its subreaper
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


async def test_supervisor_killed_mid_batch_leaves_its_services_serving(fleet, plat):
    """Last in the module: it ends the module's platform itself (its teardown's `down` then
    finds no supervisor and only checks that nothing is left)."""
    state = plat.state()
    try:
        started = await FirstEvent("started").start(fleet)
        ids = await _gang(fleet, 30, **SMALL)
        await started.wait()
        os.kill(state["pid"], signal.SIGKILL)
        await started.stop()
        try:
            os.waitpid(state["pid"], 0)
        except ChildProcessError:
            pass
        # Nothing kills a service when its supervisor dies: the batch goes on, the bus and
        # every service serve on (unsupervised: none would be restarted now).
        outcome = await _outcome(fleet, ids)
        assert _accounted(outcome) == Counter({"running/none": 30})
        assert all(_alive(pid) for pid in state["services"].values())
        for service in sandfleet.client.SERVICES:
            assert await fleet.ping(service), service
        await _running_exactly(fleet, plat, outcome)
        await _serves(fleet)
        down = plat.cli("down", "--data-dir", str(plat.data_dir), check=False)
        left = [n for n, pid in state["services"].items() if _alive(pid)]
    finally:
        await fleet.close()
        _stop_orphans(state)
    # `down` finds the supervisor gone and stops what it had started, bus last
    assert down.returncode == 0 and b"stopped what it had started" in down.stderr, down.stderr
    assert not left, f"`sandfleet down` after a supervisor crash left {sorted(left)} running (stopped by the test)"

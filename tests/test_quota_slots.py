"""A quota's slot comes back however its sandbox ends, on real nodes.

Each test holds a task quota of one concurrent sandbox, shows the slot taken (a second create
is refused with `quota:`), ends the sandbox one way (expiry, its init dying, a failed launch, a
security policy's kill, its node lost) and then shows the slot back: usage 0 and a new create
admitted. Destroy is covered by tests/test_placement_scale.py.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from types import SimpleNamespace
from unittest import mock

import pytest

import sandfleet
from sandfleet import errors
from schemas.sandbox import ENDED, Reason, State
from services.placement.quotas import Quotas
from tests.conftest import NODE_ID, start_platform, stop_platform

CHEAT = ("import socket\n"
         "try: socket.socket().connect(('10.1.2.3', 80))\n"
         "except PermissionError: pass")


async def _held(fleet, task: str, **spec) -> sandfleet.Sandbox:
    """A quota of one for `task`, and the sandbox that takes its slot."""
    await fleet.set_quota(task=task, max_concurrent=1)
    sb = await fleet.create(memory_mb=64, host_view=True, labels={"task": task}, **spec)
    assert (await fleet.quota(task=task)).active == 1
    with pytest.raises(errors.Capacity, match=f"quota: task '{task}' allows 1 concurrent"):
        await fleet.create(memory_mb=64, host_view=True, labels={"task": task})
    return sb


async def _ended(fleet, sandbox_id: str, timeout: float = 60.0) -> tuple[State, Reason]:
    """How the sandbox ended: its record's state and reason, or its last event's once a stopped
    record is forgotten (its events stay in the stream)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            record = await fleet.get(sandbox_id)
            if record.state in ENDED:
                return record.state, record.reason
        except errors.NotFound:
            last = (await fleet.history(sandbox_id))[-1]
            return last.state, last.reason
        assert time.monotonic() < deadline, f"{sandbox_id} never ended: {record.state}"
        await asyncio.sleep(0.2)


async def _slot_back(fleet, task: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (active := (await fleet.quota(task=task)).active) != 0:
        assert time.monotonic() < deadline, f"task {task!r} still counts {active} live sandbox(es)"
        await asyncio.sleep(0.2)
    again = await fleet.create(memory_mb=64, host_view=True, labels={"task": task})
    assert (await again.exec(["true"])).exit_code == 0
    await again.destroy()


def _task(what: str) -> str:
    return f"quota-{what}-{secrets.token_hex(3)}"


async def test_a_slot_comes_back_when_the_sandbox_expires(fleet):
    task = _task("expiry")
    sb = await _held(fleet, task, timeout_s=2)
    assert await _ended(fleet, sb.id) == (State.STOPPED, Reason.EXPIRED)
    await _slot_back(fleet, task)


async def test_a_slot_comes_back_when_the_init_dies(fleet):
    task = _task("exited")
    sb = await _held(fleet, task)
    os.kill((await fleet.get(sb.id)).init_pid, signal.SIGKILL)
    assert await _ended(fleet, sb.id) == (State.FAILED, Reason.PROCESS_EXITED)
    await _slot_back(fleet, task)


async def test_a_slot_comes_back_when_the_launch_fails(fleet):
    task = _task("launch")
    await fleet.set_quota(task=task, max_concurrent=1)
    with pytest.raises(errors.ServiceFailure):
        await fleet.create(memory_mb=64, labels={"task": task}, layers=["no-such-layer-for-quota"])
    await _slot_back(fleet, task)


async def test_a_slot_comes_back_when_a_policy_kills_the_sandbox(fleet):
    task = _task("policy")
    await fleet.set_policy(task=task, action="kill", thresholds={"network": 1})
    sb = await _held(fleet, task)
    try:
        await sb.exec(["python3", "-c", CHEAT], timeout_s=20)
    except errors.ServiceFailure:
        pass  # the kill may land before the command returns
    assert await _ended(fleet, sb.id) == (State.FAILED, Reason.VIOLATION)
    await _slot_back(fleet, task)


async def _trail(fleet, platform, sandbox_id: str) -> str:
    """What the quota release saw, for a failure message: its consumer, the member key, the
    sandbox's events and placement's warnings."""
    consumer = await fleet.bus.js.consumer_info("EVENTS", "placement-quotas")
    kv = await fleet.bus.js.key_value("quotas")
    try:
        member = [k for k in await kv.keys() if k.startswith("m.") and k.endswith(f".{sandbox_id}")]  # m.<node>.<id>
    except Exception as exc:  # noqa: BLE001 (a failure message: whatever it was)
        member = type(exc).__name__
    warnings = [line for line in (platform.data_dir / "logs" / "placement.log").read_text().splitlines()
                if " INFO " not in line]
    return (f"consumer delivered={consumer.delivered.stream_seq} ack_floor={consumer.ack_floor.stream_seq} "
            f"pending={consumer.num_pending} ack_pending={consumer.num_ack_pending} member={member!r} "
            f"events={[(e.state.value, e.seq) for e in await fleet.history(sandbox_id)]} placement={warnings[-5:]}")


@pytest.fixture(scope="module")
def losable(leak_check, tmp_path_factory):
    """A platform of its own whose node placement gives up 4 s after its last heartbeat."""
    with mock.patch.dict(os.environ, {"SANDFLEET_NODE_LOST_S": "4", "SANDFLEET_FENCE_S": "1"}):
        p = start_platform(tmp_path_factory.mktemp("quota-lost"), f"{NODE_ID}-ql")
    yield p
    stop_platform(p)


async def test_a_slot_comes_back_when_the_node_is_lost(losable):
    task = _task("lost")
    async with sandfleet.connect(losable.url) as fleet:
        sb = await _held(fleet, task)
        launcher = losable.service_pid("launcher")
        os.kill(launcher, signal.SIGSTOP)  # no heartbeats: the node is lost to placement
        try:
            assert await _ended(fleet, sb.id) == (State.FAILED, Reason.NODE_LOST)
            deadline = time.monotonic() + 45  # past the release consumer's ack wait (30 s): a redelivery counts
            while (active := (await fleet.quota(task=task)).active) != 0:
                if time.monotonic() > deadline:
                    trail = await _trail(fleet, losable, sb.id)
                    raise AssertionError(f"a lost node's sandbox still counts ({active}): {trail}")
                await asyncio.sleep(0.2)
        finally:
            os.kill(launcher, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while losable.node_id not in {n.id for n in await fleet.nodes()}:  # its registration expired meanwhile
            assert time.monotonic() < deadline, "the node never registered again"
            await asyncio.sleep(0.2)
        await _slot_back(fleet, task, timeout=60)  # the node is back (and fenced what it ran)


async def test_the_release_consumer_pulls_on_after_the_plain_timeout_nats_py_raises_under_load():
    """nats-py's `fetch` raises a plain asyncio.TimeoutError, not its own subclass, when the
    server's answer to its no-wait probe lands just before its timer (a loaded machine). The
    consumer caught only the subclass and died without a word: from then on no slot of any
    sandbox came back (the node-loss test above caught it: its consumer had delivered nothing).
    A unit test: only the pull subscription is faked, to raise what nats-py raises."""
    pulled_again = asyncio.Event()

    class Subscription:
        calls = 0

        async def fetch(self, batch: int, timeout: float) -> list:
            self.calls += 1
            if self.calls == 1:
                raise asyncio.TimeoutError
            pulled_again.set()
            await asyncio.Event().wait()  # idle until cancelled
            return []

        async def unsubscribe(self) -> None:
            pass

    async def add_consumer(*_: object, **__: object) -> None:
        pass

    async def bind(*_: object, **__: object) -> Subscription:
        return Subscription()

    async def stream_info(*_: object, **__: object) -> SimpleNamespace:  # no member key of an older placement
        return SimpleNamespace(state=SimpleNamespace(subjects=None))

    bus = SimpleNamespace(js=SimpleNamespace(add_consumer=add_consumer, pull_subscribe_bind=bind, stream_info=stream_info))
    consumer = asyncio.create_task(Quotas(bus, kv=None).release_ended())  # type: ignore[arg-type]
    pulling = asyncio.create_task(pulled_again.wait())
    try:
        await asyncio.wait({consumer, pulling}, return_when=asyncio.FIRST_COMPLETED)
        assert not consumer.done(), f"the release consumer died: {consumer.exception()!r}"
    finally:
        consumer.cancel()
        pulling.cancel()

"""Durable launches (issue 16 §2): what placement handed a node survives the node's services dying.

`kill -9` of the launcher, the node agent or the layer-cache in the middle of a real batch
(`fleet.create_many`, the kill triggered by the batch's first `started` event): every sandbox of
the batch ends `running`, none has two inits (counted on the host, from /proc), and destroying
them leaves nothing. The first tests are of the launcher's retrying client alone (no bus): a
call to a node-local service that is restarting asks again until it answers, and gives up with
a typed error only past its bound.

All of it runs on one platform of the module's own (a crash mid-batch is no neighbour for the
session's other tests).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import pytest

import sandfleet
from sandfleet import errors
from sandfleet.layers_client import Layers
from schemas import events
from schemas import node as node_schema
from schemas.node import ConfinedList, Empty
from schemas.sandbox import CREATE_MANY, CreateManyReply, CreateManyRequest, SandboxSpec
from services.launcher import clients
from services.launcher.clients import RestartingService, ServiceDown
from tests.conftest import NODE_ID, own_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

BATCH = 60
QUIET = {"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101"}  # a shared machine's pressure
SMALL = dict(memory_mb=16, cpu=0.01, host_view=True)
HANG_GUARD_S = 60.0  # only so a broken retry fails the test instead of hanging it


# -- the retrying client, alone ------------------------------------------------------------


class FlakyService:
    """Answers as told, one entry per request: an exception to raise, "hang" (a request the
    dying service took: never answered), or a value to answer with."""

    def __init__(self, *script: object) -> None:
        self.script = list(script)
        self.asked = 0

    async def ask(self) -> object:
        self.asked += 1
        step = self.script.pop(0) if self.script else "ok"
        if step == "hang":
            await asyncio.Event().wait()
        if isinstance(step, BaseException):
            raise step
        return step


async def test_a_call_asks_again_until_the_restarted_service_answers():
    service = FlakyService(errors.NoResponders("gone"), errors.Timeout("lost"), errors.NoResponders("gone"), "made")
    answer = await asyncio.wait_for(RestartingService("agent").call(service.ask, budget=HANG_GUARD_S), HANG_GUARD_S)
    assert answer == "made" and service.asked == 4


async def test_an_error_reply_is_an_answer_and_is_not_asked_again():
    service = FlakyService(errors.InvalidRequest("bad rule"))
    with pytest.raises(errors.InvalidRequest):
        await RestartingService("agent").call(service.ask, budget=HANG_GUARD_S)
    assert service.asked == 1


async def test_calls_sent_before_the_service_is_found_gone_ask_again_without_waiting_out_their_timeout():
    """The first call's request is never answered (its service died holding it) and has no
    timeout of its own here: only another call finding nobody subscribed can free it."""
    calls = RestartingService("layer-cache")
    held = FlakyService("hang", "composed")
    first = asyncio.create_task(calls.call(held.ask, budget=HANG_GUARD_S))
    while held.asked == 0:
        await asyncio.sleep(0)
    second = FlakyService(errors.NoResponders("gone"), "composed too")
    assert await asyncio.wait_for(calls.call(second.ask, budget=HANG_GUARD_S), HANG_GUARD_S) == "composed too"
    assert await asyncio.wait_for(first, HANG_GUARD_S) == "composed"
    assert held.asked == 2


async def test_a_probe_finding_the_service_gone_frees_calls_that_all_wait(monkeypatch):
    """Every call waits on a lost request (no new call comes to find the service gone): the
    probe sent while they wait finds it for them."""
    monkeypatch.setattr(clients, "PROBE_EVERY_S", 0.01)
    probe = FlakyService(errors.Timeout("busy"), errors.NoResponders("gone"), *["there"] * 1000)
    calls = RestartingService("the node agent", probe=probe.ask)
    held = [FlakyService("hang", f"confined {n}") for n in range(3)]
    answers = await asyncio.wait_for(asyncio.gather(*(calls.call(h.ask, budget=HANG_GUARD_S) for h in held)),
                                     HANG_GUARD_S)
    assert answers == ["confined 0", "confined 1", "confined 2"] and probe.asked >= 2


async def test_a_call_gives_up_past_its_bound_with_a_typed_error():
    service = FlakyService(*[errors.NoResponders("gone")] * 1000)
    with pytest.raises(ServiceDown, match="did not answer within 0.3s") as raised:
        await RestartingService("the node agent").call(service.ask, budget=0.3)
    assert isinstance(raised.value, errors.Timeout) and service.asked > 1


async def test_a_service_gone_longer_than_any_restart_fails_calls_at_once(monkeypatch):
    monkeypatch.setattr(clients, "RESTART_WAIT_S", 0.0)
    calls = RestartingService("the node agent")
    with pytest.raises(ServiceDown):
        await calls.call(FlakyService(*[errors.NoResponders("gone")] * 1000).ask, budget=0.2)
    late = FlakyService(*[errors.NoResponders("gone")] * 1000)
    with pytest.raises(ServiceDown):
        await calls.call(late.ask, budget=HANG_GUARD_S)
    assert late.asked == 1
    assert await calls.call(FlakyService("back").ask, budget=1) == "back"  # and it is trusted again once it answers


# -- kill -9 mid-batch on a real platform -------------------------------------------------


@pytest.fixture(scope="module")
def plat(leak_check, tmp_path_factory):
    with own_platform(tmp_path_factory.mktemp("durable"), f"{NODE_ID}-dl", env=QUIET) as p:
        yield p


@pytest.fixture
async def fleet(plat):
    async with sandfleet.connect(plat.url) as f:
        yield f


@pytest.fixture(scope="module")
async def base_layer(plat, tmp_path_factory):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("dl-base") / "base"
    make_busybox_base(src)
    async with sandfleet.connect(plat.url) as fleet:
        await Layers(fleet.bus).build_dir("dl-base", src)
    return "dl-base"


def inits_on_host(node_id: str) -> Counter:
    """Sandbox id → how many sandbox inits (pid 1 of a pid namespace of their own) run in its
    cgroups, read from /proc: a launch built twice would show two."""
    marker = f"/sandfleet/{node_id}/"
    found: Counter = Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                paths = [line.rstrip("\n").split(":", 2)[2] for line in f]
            with open(f"/proc/{pid}/status") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except (OSError, IndexError):
            continue  # ended meanwhile
        owners = {p.split(marker, 1)[1].split("/")[0] for p in paths if marker in p}
        if len(nspid) >= 2 and nspid[-1] == "1" and len(owners) == 1:
            found[owners.pop()] += 1
    return found


async def _confined(fleet, node_id: str) -> set[str]:
    reply = await fleet.bus.request(node_schema.subject(node_id, node_schema.AGENT_LIST), Empty(), ConfinedList)
    return set(reply.sandbox_ids)


async def _batch_through_a_kill(fleet, plat, service: str, make=None, **spec) -> tuple[list, int]:
    """`fleet.create_many(BATCH)` (or `make()`), with `service` killed (-9) at the batch's first
    `started` event; returns the batch's sandboxes (create_many raises if any failed) and how
    many had started when the kill landed."""
    started: set[str] = set()
    first = asyncio.Event()

    async def seen(msg) -> None:
        started.add(events.sandbox_id_of(msg.subject))
        first.set()

    sub = await fleet.bus.nc.subscribe(events.sandbox_subject("*", "started"), cb=seen)
    await fleet.bus.nc.flush()
    batch = asyncio.create_task(make() if make else fleet.create_many(BATCH, **spec))
    try:
        await asyncio.wait_for(first.wait(), 120)
        old = plat.service_pid(service)
        os.kill(old, signal.SIGKILL)
        ran = len(started)
    finally:
        await sub.unsubscribe()
    await plat.restarted(fleet, service, old)
    try:
        boxes = await batch
    except errors.ServiceFailure as exc:
        raise AssertionError(f"{service} killed mid-batch failed some of it: {exc}") from None
    return boxes, ran


async def _each_once_then_nothing(fleet, plat, boxes: list) -> None:
    """Every sandbox runs, with one init on the host, answers, and destroying them leaves
    nothing of them in the agent."""
    ids = {b.id for b in boxes}
    assert len(ids) == BATCH
    records = {r.id: r for r in await fleet.list()}
    assert Counter(records[i].state.value for i in ids) == Counter({"running": BATCH})
    inits = inits_on_host(plat.node_id)
    assert {i: inits[i] for i in ids if inits[i] != 1} == {}, "a sandbox with no init or with two"
    for start in range(0, BATCH, 20):
        results = await asyncio.gather(*(b.exec(["true"]) for b in boxes[start:start + 20]))
        assert [r.exit_code for r in results] == [0] * len(results)
    for start in range(0, BATCH, 20):
        await asyncio.gather(*(b.destroy() for b in boxes[start:start + 20]))
    assert not await _confined(fleet, plat.node_id) & ids
    assert not set(inits_on_host(plat.node_id)) & ids


async def test_launcher_killed_mid_batch_builds_all_of_it_once(fleet, plat):
    boxes, ran = await _batch_through_a_kill(fleet, plat, "launcher", **SMALL)
    print(f"launcher killed with {ran} of {BATCH} started")
    assert ran < BATCH, "the kill landed after the whole batch had started"
    await _each_once_then_nothing(fleet, plat, boxes)


async def test_agent_killed_mid_batch_builds_all_of_it_once(fleet, plat):
    boxes, ran = await _batch_through_a_kill(fleet, plat, "agent", **SMALL)
    print(f"agent killed with {ran} of {BATCH} started")
    assert ran < BATCH, "the kill landed after the whole batch had started"
    await _each_once_then_nothing(fleet, plat, boxes)


async def test_layer_cache_killed_mid_batch_builds_all_of_it_once(fleet, plat, base_layer):
    boxes, ran = await _batch_through_a_kill(fleet, plat, "layer-cache", memory_mb=32, cpu=0.01, layers=[base_layer])
    print(f"layer-cache killed with {ran} of {BATCH} started")
    assert ran < BATCH, "the kill landed after the whole batch had started"
    for b in boxes[:5]:  # roots composed before and after the kill both read
        assert (await b.exec(["cat", "/etc/hostname"])).stdout == b"base\n"
    await _each_once_then_nothing(fleet, plat, boxes)


async def test_a_waited_batch_whose_launcher_was_killed_under_it_is_answered_with_what_runs(fleet, plat):
    """A caller waiting for the launch (`wait=True`, as a single create does) never hears back
    from the killed launcher; placement then answers with what the records say once the
    restarted launcher has built them: all of them, none reported failed while it runs."""
    async def waited() -> list:
        request = CreateManyRequest(count=BATCH, spec=SandboxSpec(**SMALL), wait=True)
        reply = await fleet.bus.request(CREATE_MANY, request, CreateManyReply, timeout=120)
        assert (reply.failed, reply.errors) == (0, []), reply.errors
        return [await fleet.sandbox(s.id) for s in reply.sandboxes]

    boxes, ran = await _batch_through_a_kill(fleet, plat, "launcher", make=waited)
    print(f"launcher killed under a waited batch with {ran} of {BATCH} started")
    assert ran < BATCH, "the kill landed after the whole batch had started"
    await _each_once_then_nothing(fleet, plat, boxes)

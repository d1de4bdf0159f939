"""Placement at scale against a real nats-server and real placement processes (two replicas, one
queue group), with SIMULATED nodes (loadtest/simnode.py: they register, heartbeat and move
records through their states, and create nothing). Each test registers its own nodes and
removes them at the end, so no test sees another's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import msgspec
import nats.js.errors
import pytest

import sandfleet
from loadtest.simnode import ControlPlane, SimulatedNode
from sandfleet import errors
from sandfleet.bus import Bus, encode
from sandfleet.store import BatchRefused, SandboxStore, ensure_state
from schemas import events
from schemas import node as node_schema
from schemas.node import NodeInfo, NodePressure
from schemas.errors import ErrorCode
from schemas.sandbox import (
    KV_BUCKET,
    MAX_BATCH,
    CreateManyRequest,
    Reason,
    SandboxBatch,
    SandboxRecord,
    SandboxSpec,
    State,
    batch_key,
    batch_of,
)
from services.launcher.starting import StartingMarks
from services.placement.handlers import Deps, _unplace, create_many, fail_stuck, new_id, new_token
from services.placement.policy import NodeView

LOST_S = 5.0


@pytest.fixture(scope="module")
async def plane():
    cp = await ControlPlane(replicas=2, env={"SANDFLEET_NODE_LOST_S": str(LOST_S)}).start()
    bus = await Bus.connect(cp.url, "placement-scale-test")
    try:
        await cp.wait_for_replicas(bus, timeout=60)
        async with sandfleet.connect(cp.url) as fleet:
            yield cp, bus, await SandboxStore.open(bus), fleet
    finally:
        await bus.close()
        cp.stop()


class Nodes:
    """Simulated nodes for one test; gone from the registry when it ends."""

    def __init__(self, bus: Bus, store: SandboxStore) -> None:
        self.bus, self.store, self.nodes = bus, store, []

    async def add(self, node_id: str, **kw) -> SimulatedNode:
        n = await SimulatedNode(self.bus, self.store, f"{node_id}-{time.monotonic_ns() % 10**8}",
                                heartbeat_s=0.5, **kw).start()
        self.nodes.append(n)
        return n

    async def settle(self) -> None:
        await asyncio.sleep(0.5)  # both replicas' KV watches deliver the registrations

    async def close(self) -> None:
        kv = await self.bus.js.key_value(node_schema.KV_BUCKET)
        for n in self.nodes:
            await n.silence()
            await kv.delete(n.id)


@pytest.fixture
async def nodes(plane):
    _, bus, store, _ = plane
    made = Nodes(bus, store)
    yield made
    await made.close()


async def replica_requests(bus: Bus, endpoint: str) -> list[int]:
    """Requests each placement replica has served on `endpoint` (nats.micro STATS)."""
    inbox, seen = bus.nc.new_inbox(), []

    async def stats(msg) -> None:
        if not (msg.headers or {}).get("Status"):
            seen.append(json.loads(msg.data))

    sub = await bus.nc.subscribe(inbox, cb=stats)
    await bus.nc.publish("$SRV.STATS.placement", b"", reply=inbox)
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    return [next(e["num_requests"] for e in s["endpoints"] if e["name"] == endpoint) for s in seen]


async def test_two_placement_replicas_never_double_book_a_node(plane, nodes):
    _, bus, _, fleet = plane
    a, b = await nodes.add("db-a", capacity=30), await nodes.add("db-b", capacity=30)
    await nodes.settle()
    before = await replica_requests(bus, "create_many")
    # 20 batches of 5 at once over 60 free slots: all-or-nothing, so at most 12 can fit (20, so both
    # replicas get some: the queue group picks one at random per request). A batch
    # may be refused while another replica's half-booked batch holds room it later gives back,
    # so fewer may be made; what must never happen is more sandboxes than room, or a lost one.
    results = await asyncio.gather(
        *(fleet.create_many(5, memory_mb=16, cpu=0.01) for _ in range(20)), return_exceptions=True
    )
    after = await replica_requests(bus, "create_many")
    assert len(after) == 2 and all(x > y for x, y in zip(sorted(after), sorted(before))), (before, after)
    made = [r for r in results if isinstance(r, list)]
    refused = [r for r in results if not isinstance(r, list)]
    assert all(isinstance(r, errors.Capacity) for r in refused), refused
    assert len(a.live) <= 30 and len(b.live) <= 30
    assert len(a.live) + len(b.live) == 5 * len(made) and 1 <= len(made) <= 12
    more = await fleet.create_many(60 - 5 * len(made), memory_mb=16, cpu=0.01) if len(made) < 12 else []
    assert len(a.live) + len(b.live) == 5 * len(made) + len(more) == 60  # the room given back was really free


async def test_a_lost_node_has_its_sandboxes_reported_failed(plane, nodes):
    _, _, store, fleet = plane
    doomed = await nodes.add("lost")
    await nodes.settle()
    boxes = await fleet.create_many(5, memory_mb=16, cpu=0.01)
    assert {b.node for b in boxes} == {doomed.id}
    await doomed.silence()
    deadline = time.monotonic() + LOST_S + 20
    while time.monotonic() < deadline:
        records = [await fleet.get(b.id) for b in boxes]
        if all(r.state is State.FAILED for r in records):
            break
        await asyncio.sleep(0.5)
    assert [(r.state, r.reason) for r in records] == [(State.FAILED, Reason.NODE_LOST)] * 5
    history = await fleet.history(boxes[0].id)
    assert [e.name for e in history].count("failed") == 1  # one replica reported it, once


async def test_a_node_under_pressure_receives_no_new_sandboxes(plane, nodes):
    _, _, _, fleet = plane
    hot = await nodes.add("hot", pressure=NodePressure(memory=80.0))
    cool = await nodes.add("cool")
    await nodes.settle()
    boxes = await fleet.create_many(20, memory_mb=16, cpu=0.01)
    assert {b.node for b in boxes} == {cool.id} and not hot.live
    cool.pressure = NodePressure(memory=80.0)
    await cool.beat()
    await nodes.settle()
    with pytest.raises(errors.Capacity, match="memory pressure"):
        await fleet.create(memory_mb=16, cpu=0.01)


async def test_sandboxes_go_to_the_nodes_that_hold_their_layers(plane, nodes):
    _, _, _, fleet = plane
    both = await nodes.add("both", capacity=5, layers=("base", "tools"))
    base = await nodes.add("base", capacity=5, layers=("base",))
    await nodes.add("bare", capacity=50)
    await nodes.settle()
    one = await fleet.create(memory_mb=16, cpu=0.01, layers=["base", "tools"])
    assert one.node == both.id
    boxes = await fleet.create_many(8, memory_mb=16, cpu=0.01, layers=["base", "tools"])
    assert sorted(b.node for b in boxes) == sorted([both.id] * 4 + [base.id] * 4)


async def test_quotas_refuse_with_a_capacity_error_and_give_slots_back(plane, nodes):
    _, _, _, fleet = plane
    await nodes.add("quota")
    await nodes.settle()
    state = await fleet.set_quota(task="tq", max_concurrent=3)
    assert state.quota.max_concurrent == 3 and state.active == 0
    boxes = [await fleet.create(memory_mb=16, cpu=0.01, labels={"task": "tq"}) for _ in range(3)]
    with pytest.raises(errors.Capacity, match="quota: task 'tq' allows 3 concurrent"):
        await fleet.create(memory_mb=16, cpu=0.01, labels={"task": "tq"})
    await fleet.create(memory_mb=16, cpu=0.01, labels={"task": "other"})  # other tasks are not limited
    await boxes[0].destroy()
    deadline = time.monotonic() + 20
    while (await fleet.quota(task="tq")).active != 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await fleet.create(memory_mb=16, cpu=0.01, labels={"task": "tq"})

    await fleet.set_quota(tenant="acme", max_creates_per_s=0.2)  # a bucket of 1, refilled every 5 s
    with pytest.raises(errors.Capacity, match="never fits"):
        await fleet.create_many(2, memory_mb=16, cpu=0.01, labels={"tenant": "acme"})
    await fleet.create(memory_mb=16, cpu=0.01, labels={"tenant": "acme"})
    with pytest.raises(errors.Capacity, match="creates/s"):
        await fleet.create(memory_mb=16, cpu=0.01, labels={"tenant": "acme"})


async def test_a_gang_batch_of_2000_on_simulated_nodes_is_all_placed_and_started(plane, nodes):
    _, _, store, fleet = plane
    sims = [await nodes.add(f"gang{i}", capacity=125) for i in range(16)]  # 2,000 slots
    await nodes.settle()
    seen = []
    boxes = await fleet.create_many(2000, memory_mb=64, cpu=0.1, progress=seen.append)
    assert len({b.id for b in boxes}) == 2000
    deadline = time.monotonic() + 30
    while sum(len(s.live) for s in sims) < 2000 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # a node answers its launch just after the events went out
    assert all(len(s.live) == 125 for s in sims) and sum(len(s.live) for s in sims) == 2000
    assert seen[-1].done and seen[-1].running == 2000 and seen[-1].failed == 0
    assert [p.running for p in seen] == sorted(p.running for p in seen)  # progress only moves forward
    record, _ = await store.get(boxes[-1].id)
    # scheduled, running (and starting between, were the launch slower than the grace): once each
    assert record.state is State.RUNNING and record.seq in (2, 3)
    with pytest.raises(errors.Capacity):  # the nodes are full: the next batch is refused whole
        await fleet.create_many(10, memory_mb=64, cpu=0.1)


async def test_every_lifecycle_event_of_a_batch_is_stored_once(plane, nodes):
    # Events go out in pipelined bursts, sent back to back with the record writes: none of a
    # batch's may go missing from the stream, nor be stored twice.
    _, _, _, fleet = plane
    await nodes.add("events-a", capacity=300)
    await nodes.add("events-b", capacity=300)
    await nodes.settle()
    ids = {b.id for b in await fleet.create_many(500, memory_mb=16, cpu=0.01)}
    stored: dict[str, list[str]] = {}
    for event in await fleet.history():
        if event.sandbox_id in ids:
            stored.setdefault(event.sandbox_id, []).append(event.name)
    assert len(stored) == 500
    assert all(names in (["scheduled", "started"], ["scheduled", "starting", "started"]) for names in stored.values())


def _scheduled(n: int) -> list[SandboxRecord]:
    now = time.time()
    return [SandboxRecord(id=new_id(), node="marks", spec=SandboxSpec(cpu=0.1, memory_mb=64), state=State.SCHEDULED,
                          created_at=now, updated_at=now) for _ in range(n)]


async def _names(fleet, sandbox_id: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [e.name for e in await fleet.history(sandbox_id, idle_s=0.3)]


async def test_a_launch_done_within_the_grace_is_never_marked_starting(plane):
    _, _, store, fleet = plane
    stored = await store.create_many(_scheduled(3))
    ids = [r.id for r, _ in stored]
    marks = StartingMarks(store, ids, known={r.id: (r, rev) for r, rev in stored}, grace=0.5)
    assert [await marks.settle(i) for i in ids] == [None, None, None]
    await asyncio.sleep(0.7)  # past the grace: nothing is left to mark
    for i in ids:
        assert (await store.get(i))[0].state is State.SCHEDULED
    done = await store.transition_many(ids, State.RUNNING, known={r.id: (r, rev) for r, rev in stored})
    assert all(r.state is State.RUNNING and r.seq == 2 for r in done)
    assert await _names(fleet, ids[0]) == ["scheduled", "started"]


async def test_a_launch_outlasting_the_grace_is_marked_starting_before_it_runs(plane):
    _, _, store, fleet = plane
    stored = await store.create_many(_scheduled(4))
    ids = [r.id for r, _ in stored]
    marks = StartingMarks(store, ids, known={r.id: (r, rev) for r, rev in stored}, grace=0.1)
    assert await marks.settle(ids[0]) is None  # done early: not marked
    await store.transition(ids[0], State.RUNNING, known=stored[0])
    await store.transition(ids[1], State.FAILED, Reason.LAUNCH_FAILED, "placement gave up",
                           only_from=frozenset({State.SCHEDULED}))
    await asyncio.sleep(0.4)
    assert (await store.get(ids[2]))[0].state is State.STARTING
    assert (await marks.settle(ids[1])).code is ErrorCode.CONFLICT  # it had ended: the mark was refused
    assert await marks.settle(ids[2]) is None and await marks.settle(ids[3]) is None
    assert (await store.transition(ids[2], State.RUNNING, known=stored[2])).seq == 3
    assert await _names(fleet, ids[0]) == ["scheduled", "started"]
    assert await _names(fleet, ids[2]) == ["scheduled", "starting", "started"]


async def test_simulated_nodes_in_a_process_of_their_own_take_a_gang_batch():
    cp = await ControlPlane(replicas=1).start()
    try:
        cp.add_simnodes(4, capacity=50)
        async with sandfleet.connect(cp.url) as fleet:
            await cp.wait_for_replicas(fleet.bus, timeout=60)
            await asyncio.sleep(0.5)  # placement has heard the nodes
            boxes = await fleet.create_many(200, memory_mb=16, cpu=0.01)
            assert sorted({b.node for b in boxes}) == [f"sim-{i:03d}" for i in range(4)]
            assert len(cp.simnode_pids) == 1
    finally:
        cp.stop()
    assert not cp.simnode_pids


async def test_placements_reply_to_the_largest_batch_fits_one_bus_message(plane):
    """The largest gang reply there is: MAX_BATCH sandboxes one a node, every node with the longest
    id a node may have (64 characters, what its cgroups allow), so each sandbox carries a placement
    of its own. Placement's handler answers two such batches for real (recording all of MAX_BATCH
    would cost the suite many seconds); each sandbox adds the same bytes to its reply, so the size
    at MAX_BATCH follows exactly, and it must fit the payload limit of the bus placement answers on."""
    _, bus, store, _ = plane
    sizes = {}
    for count in (50, 100):
        now, view = time.time(), NodeView()
        for n in range(count):
            view.heartbeat(NodeInfo(id=f"reply{count}-{n:05d}".ljust(64, "x"), isolation=["process"], capacity=1,
                                    running=0, cpus=4, memory_mb=4096, at=now))
        deps = Deps(bus=bus, store=store, nodes=view)
        reply = await create_many(deps, CreateManyRequest(count=count, spec=SandboxSpec(cpu=0.01, memory_mb=16),
                                                          wait=False))
        assert sorted(len(p.ids) for p in reply.placements) == [1] * count
        sizes[count] = len(encode(reply))  # as the bus sends it
        await asyncio.gather(*deps.launches)  # no such nodes: their launches end the records failed
    per_sandbox, rest = divmod(sizes[100] - sizes[50], 50)
    assert rest == 0, sizes  # the reply grows by whole placements, nothing else
    largest = sizes[100] + per_sandbox * (MAX_BATCH - 100)
    assert largest <= bus.nc.max_payload, f"a reply of {largest} bytes, over the bus's {bus.nc.max_payload}"


async def test_a_real_node_heartbeat_reports_allocation_pressure_and_what_it_took(fleet):
    """The real launcher of the session platform (not simulated) fills the fields placement uses."""
    box = await fleet.create(memory_mb=64, cpu=0.5, host_view=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            (info,) = [n for n in await fleet.nodes() if n.id == box.node]
            if info.allocated_memory_mb >= 64:
                break
            await asyncio.sleep(0.5)
        assert not info.simulated and info.instance and info.accepted >= 1 and info.accepted_memory_mb >= 64
        assert info.allocated_memory_mb >= 64 and info.allocated_cpu >= 0.5
        assert 0.0 <= info.pressure.cpu <= 100.0 and 0.0 <= info.pressure.memory <= 100.0
    finally:
        await box.destroy()


async def test_events_go_one_ack_each_to_a_stream_that_takes_no_batches(plane):
    # A stream made by an older sandfleet, or tuned by an operator, without allow_batched.
    _, bus, store, fleet = plane
    info = await bus.js.stream_info(events.STREAM)
    await bus.js.update_stream(dataclasses.replace(info.config, allow_batched=False))
    try:
        fresh = SandboxStore(bus, store.kv)
        stored = await fresh.create_many(_scheduled(3))
        assert not fresh._ingest  # refused as a batch, then sent one by one
        for record, _ in stored:
            assert await _names(fleet, record.id) == ["scheduled"]
    finally:
        await ensure_state(bus)
    assert (await bus.js.stream_info(events.STREAM)).config.allow_batched  # ensure_state turns it back on
    batched = SandboxStore(bus, store.kv)
    stored = await batched.create_many(_scheduled(2500))  # two batches
    assert batched._ingest
    names = {e.sandbox_id: e.name for e in await fleet.history()}
    assert all(names.get(record.id) == "scheduled" for record, _ in stored)


async def test_a_burst_cancelled_while_the_reply_subscription_is_made_does_not_cancel_the_others(plane):
    _, bus, store, _ = plane
    fresh = SandboxStore(bus, store.kv)  # its shared reply subscription is made on first use
    first = asyncio.create_task(fresh.read_many(["sb-absent-1"]))
    second = asyncio.create_task(fresh.read_many(["sb-absent-2"]))
    await asyncio.sleep(0)  # both wait on the subscription's set-up
    first.cancel()
    got = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(got[0], asyncio.CancelledError) and got[1] == {}


async def test_records_are_read_in_batches_and_one_by_one_from_a_bucket_without_direct_gets(plane):
    _, bus, store, _ = plane
    stored = await store.create_many(_scheduled(1500))  # two direct-get batches
    ids = [r.id for r, _ in stored] + ["sb-never-made"]
    await store.forget(ids[0])  # purged: no record
    batched = await store.read_many(ids)
    assert sorted(batched) == sorted(ids[1:-1])
    assert all(batched[r.id] == (r, revision) for r, revision in stored[1:])
    bucket = f"KV_{KV_BUCKET}"
    info = await bus.js.stream_info(bucket)
    await bus.js.update_stream(dataclasses.replace(info.config, allow_direct=False))  # as an older sandfleet made it
    try:
        assert await store.read_many(ids) == batched
    finally:
        await ensure_state(bus)
    assert (await bus.js.stream_info(bucket)).config.allow_direct  # ensure_state turns it back on


async def test_a_batch_that_collides_with_an_existing_id_leaves_that_sandbox_alone(plane):
    _, bus, store, _ = plane
    ((existing, _),) = await store.create_many(_scheduled(1))
    batch = _scheduled(2) + [msgspec.structs.replace(existing, created_at=time.time())]
    with pytest.raises(BatchRefused) as refused:
        await store.create_many(batch)
    assert list(refused.value.refused) == [existing.id]
    # Placement gives the batch back: it ends what it wrote, never the sandbox it collided with.
    await _unplace(Deps(bus=bus, store=store, nodes=NodeView()), existing.spec, {}, batch, [], refused.value)
    assert [(await store.get(r.id))[0].state for r in batch] == [State.FAILED, State.FAILED, State.SCHEDULED]


async def test_a_batch_that_was_never_recorded_still_ends_its_sandboxes_event_trail(plane):
    # An unanswered batch: its records may not be stored while their `scheduled` events were.
    _, bus, store, fleet = plane
    (record,) = _scheduled(1)
    scheduled = store._event(msgspec.structs.replace(record, seq=1), None)
    await store._pipelined([(scheduled.subject, encode(scheduled), {"Nats-Msg-Id": f"{record.id}:1"})], 10)
    unanswered = errors.ServiceError(ErrorCode.TIMEOUT, "1 of 1 writes unanswered")
    await _unplace(Deps(bus=bus, store=store, nodes=NodeView()), record.spec, {}, [record], [], unanswered)
    assert await _names(fleet, record.id) == ["scheduled", "failed"]
    with pytest.raises(errors.ServiceError):  # and still no record
        await store.get(record.id)


async def test_a_gang_batch_whose_events_cannot_be_stored_is_answered_and_never_launched(plane, nodes):
    # A large gang batch is answered once its records are stored; its `scheduled` events follow,
    # before any launch. If the server refuses them, no sandbox of the batch may reach a node.
    _, bus, store, _ = plane
    sim = await nodes.add("unannounced", capacity=600)
    view = NodeView()
    view.heartbeat(sim.info())
    deps = Deps(bus=bus, store=SandboxStore(bus, store.kv), nodes=view)
    info = await bus.js.stream_info(events.STREAM)
    # For a moment the stream takes only `failed` events: the batch's first events find none.
    await bus.js.update_stream(dataclasses.replace(info.config, subjects=[events.sandbox_subject("*", "failed")]))
    try:
        reply = await create_many(deps, CreateManyRequest(count=501, spec=SandboxSpec(cpu=0.01, memory_mb=16),
                                                          wait=False))
        await asyncio.gather(*deps.launches)
    finally:
        await bus.js.update_stream(info.config)
    ids = [i for p in reply.placements for i in p.ids]
    assert len(ids) == 501 and sim.accepted == 0 and not sim.live
    recorded = await store.read_many(ids)
    assert sorted(recorded) == sorted(ids) and {r.state for r, _ in recorded.values()} == {State.FAILED}


def _batch(count: int, node: str = "marks") -> SandboxBatch:
    return SandboxBatch(token=new_token(), node=node, spec=SandboxSpec(cpu=0.1, memory_mb=64), count=count,
                        created_at=time.time(), tenant="acme")


async def _stored_in(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.last_seq


async def test_a_batch_is_one_stored_record_and_its_members_read_scheduled_until_their_first_change(plane):
    _, bus, store, fleet = plane
    batch = _batch(300)
    before = await _stored_in(bus, f"KV_{KV_BUCKET}")
    (members,) = await store.create_batches([batch])
    assert await _stored_in(bus, f"KV_{KV_BUCKET}") == before + 1  # one message for 300 sandboxes
    ids = [r.id for r, _ in members]
    assert ids == batch.ids() and all(batch_of(i) == (batch.token, n) for n, i in enumerate(ids))
    record, revision = await store.get(ids[7])
    assert (record.state, record.seq, record.tenant, revision) == (State.SCHEDULED, 1, "acme", 0)
    assert await store.read_many(ids) == {r.id: (r, 0) for r, _ in members}
    assert (await fleet.get(ids[0])).state is State.SCHEDULED
    # The first change writes the member's own record; from then it is the record.
    done = await store.transition_many(ids[:2], State.RUNNING, known={r.id: (r, rev) for r, rev in members})
    assert [r.state for r in done] == [State.RUNNING, State.RUNNING]
    assert (await store.get(ids[0]))[0].seq == 2 and (await store.get(ids[0]))[1] > 0
    assert (await store.get(ids[2]))[0].state is State.SCHEDULED
    assert await _names(fleet, ids[0]) == ["scheduled", "started"]
    listed = {r.id: r.state for r in await store.all("marks") if r.id in set(ids)}
    assert len(listed) == 300 and listed[ids[0]] is State.RUNNING and listed[ids[5]] is State.SCHEDULED


async def test_two_first_writers_of_a_batch_member_one_wins_and_the_other_is_refused(plane):
    # Placement failing a launch whose reply was lost races the node's `running`: both start from
    # the batch's `scheduled`, and only one may land (both expect no own record yet).
    _, _, store, _ = plane
    (members,) = await store.create_batches([_batch(2)])
    (first, known), (second, known2) = members
    node_side = SandboxStore(store.bus, store.kv)
    ran, failed = await asyncio.gather(
        node_side.transition_many([first.id], State.RUNNING, known={first.id: (first, known)}),
        store.transition(first.id, State.FAILED, Reason.LAUNCH_FAILED, "no reply",
                         only_from=frozenset({State.SCHEDULED}), known=(first, known)),
        return_exceptions=True)
    final = (await store.get(first.id))[0]
    if isinstance(failed, errors.ServiceError):  # the node got there first: placement must not fail it
        assert final.state is State.RUNNING and failed.code is ErrorCode.CONFLICT
    else:
        assert final.state is State.FAILED and isinstance(ran[0], errors.ServiceError)
    assert final.seq == 2
    assert (await store.get(second.id))[0].state is State.SCHEDULED  # its neighbour untouched


async def test_a_forgotten_batch_member_stays_gone(plane):
    _, _, store, fleet = plane
    (members,) = await store.create_batches([_batch(3, node="forgetting")])
    ids = [r.id for r, _ in members]
    await store.transition(ids[0], State.STOPPING, Reason.REQUESTED, known=members[0])
    await store.transition(ids[0], State.STOPPED, Reason.REQUESTED)
    await store.forget(ids[0])
    with pytest.raises(errors.ServiceError) as gone:
        await store.get(ids[0])
    assert gone.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(errors.NotFound):
        await fleet.get(ids[0])
    assert sorted(await store.read_many(ids)) == sorted(ids[1:])
    assert sorted(r.id for r in await store.all("forgetting", include_ended=True)) == sorted(ids[1:])
    with pytest.raises(errors.ServiceError):  # nor can it be written again from its batch
        await store.transition(ids[0], State.FAILED, Reason.LAUNCH_FAILED, "late", known=members[0])


async def test_a_batch_whose_token_is_taken_is_refused_whole_and_touches_nothing(plane):
    _, _, store, _ = plane
    batch = _batch(2)
    (members,) = await store.create_batches([batch])
    await store.transition(members[0][0].id, State.RUNNING, known=members[0])
    with pytest.raises(BatchRefused) as refused:
        await store.create_batches([msgspec.structs.replace(batch, count=5)])
    assert sorted(refused.value.refused) == sorted(msgspec.structs.replace(batch, count=5).ids())
    assert (await store.get(members[0][0].id))[0].state is State.RUNNING
    assert batch_of("sb-0123456789ab") is None and batch_of("sb-0123456789-07") is None


def test_a_batch_launch_is_its_batch_record_and_reads_as_one_item_per_member():
    batch = _batch(3, node="sim-7")
    request = msgspec.json.decode(encode(node_schema.LaunchRequest(batch=batch, answer_by=42.0)),
                                  type=node_schema.LaunchRequest)
    items = request.items()
    assert [i.id for i in items] == batch.ids() and request.sandboxes == []
    assert all(i.spec == batch.spec and i.record == batch.record(n) and i.revision == 0 and i.answer_by == 42.0
               for n, i in enumerate(items))
    assert node_schema.LaunchRequest().items() == []  # names no sandbox: the node refuses it
    with pytest.raises(msgspec.ValidationError):  # a token a batch key cannot have
        msgspec.json.decode(encode(msgspec.structs.replace(batch, token="../x")), type=SandboxBatch)


async def test_placement_sends_a_gang_to_each_node_as_batch_launches(plane, nodes):
    _, bus, _, fleet = plane
    sims = [await nodes.add("batched", capacity=1000) for _ in range(2)]
    seen: list[node_schema.LaunchRequest] = []

    async def copy(msg) -> None:  # type: ignore[no-untyped-def]  # outside the node's queue group: a copy of each
        seen.append(msgspec.json.decode(msg.data, type=node_schema.LaunchRequest))

    subs = [await bus.nc.subscribe(node_schema.subject(sim.id, node_schema.LAUNCH), cb=copy) for sim in sims]
    await bus.nc.flush()
    await nodes.settle()
    try:
        boxes = await fleet.create_many(1200, memory_mb=16, cpu=0.01)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    assert seen and all(r.batch is not None and not r.sandboxes and r.batch.count <= 500 for r in seen)
    assert sorted(b.id for b in boxes) == sorted(i for r in seen for i in r.batch.ids())  # type: ignore[union-attr]
    assert {r.batch.node for r in seen} <= {sim.id for sim in sims}  # type: ignore[union-attr]


async def test_the_stuck_sweep_purges_spent_batch_records_and_keeps_the_rest(plane):
    _, bus, store, _ = plane
    (spent,), (live,) = await store.create_batches([_batch(2)]), await store.create_batches([_batch(2)])
    for r, revision in spent:
        await store.transition(r.id, State.RUNNING, known=(r, revision))
    await store.transition(spent[0][0].id, State.STOPPING, Reason.REQUESTED)
    await store.transition(spent[0][0].id, State.STOPPED, Reason.REQUESTED)
    await store.forget(spent[0][0].id)
    await store.transition(live[0][0].id, State.RUNNING, known=live[0])  # its second still reads from it
    await fail_stuck(Deps(bus=bus, store=store, nodes=NodeView()), time.time())
    kv = await bus.js.key_value(KV_BUCKET)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(batch_key(spent[0][0].id[3:13]))
    assert (await kv.get(batch_key(live[0][0].id[3:13]))).value
    assert (await store.get(spent[1][0].id))[0].state is State.RUNNING
    with pytest.raises(errors.ServiceError):
        await store.get(spent[0][0].id)
    assert (await store.get(live[1][0].id))[0].state is State.SCHEDULED

"""Placement's pure logic, no bus: overcommit, pressure, locality, the booking ledger's arithmetic, quotas."""

from __future__ import annotations

import msgspec
import pytest

from schemas.node import NodeBooking, NodeInfo, NodePressure
from schemas.sandbox import CreateRequest, Quota, QuotaUsage, SandboxSpec
from services.placement.policy import (
    Limits, NoCapacity, NodeView, NoEligibleNode, UnknownNode, booked, in_transit, released, spread,
)
from services.placement.quotas import QuotaExceeded, admit

NOW = 1000.0


def node(node_id, *, capacity=1000, cpus=2, memory_mb=1024, running=0, allocated_cpu=0.0, allocated_memory_mb=0,
         pressure=NodePressure(), layers=(), instance="i1", accepted=0, accepted_cpu=0.0, accepted_memory_mb=0, at=NOW):
    return NodeInfo(id=node_id, isolation=["process"], capacity=capacity, running=running, cpus=cpus,
                    memory_mb=memory_mb, at=at, allocated_cpu=allocated_cpu, allocated_memory_mb=allocated_memory_mb,
                    pressure=pressure, layers=list(layers), instance=instance, accepted=accepted,
                    accepted_cpu=accepted_cpu, accepted_memory_mb=accepted_memory_mb)


def view(*infos, **limits):
    v = NodeView(limits=Limits(**limits))
    for info in infos:
        v.heartbeat(info)
    return v


def test_cpu_is_placed_against_the_overcommit_ratio():
    v = view(node("a", cpus=2), cpu_overcommit=4.0, memory_overcommit=100.0)
    spec = SandboxSpec(cpu=0.5, memory_mb=16)
    assert v.free("a", spec) == 16  # 2 cores x 4 / 0.5
    with pytest.raises(NoCapacity):
        v.plan(spec, 17, NOW)


def test_memory_is_placed_against_the_overcommit_ratio_after_what_the_node_holds():
    v = view(node("a", memory_mb=1024, allocated_memory_mb=512), memory_overcommit=1.5)
    assert v.free("a", SandboxSpec(cpu=0.01, memory_mb=256)) == 4  # (1536 - 512) / 256


def test_a_node_under_memory_pressure_gets_nothing_new_and_one_under_cpu_pressure_only_overflow():
    v = view(node("hot", pressure=NodePressure(memory=60.0)), node("busy", pressure=NodePressure(cpu=99.0)),
             node("cool", capacity=40), memory_psi_limit=25.0, cpu_psi_limit=95.0)
    assert v.plan(SandboxSpec(memory_mb=16, cpu=0.01), 30, NOW) == {"cool": 30}
    assert v.plan(SandboxSpec(memory_mb=16, cpu=0.01), 50, NOW) == {"cool": 40, "busy": 10}
    v.heartbeat(node("cool", pressure=NodePressure(memory=30.0)))
    assert v.plan(SandboxSpec(memory_mb=16, cpu=0.01), 5, NOW) == {"busy": 5}  # CPU-saturated, still works
    v.heartbeat(node("busy", pressure=NodePressure(cpu=99.0, memory=40.0)))
    with pytest.raises(NoCapacity, match="memory pressure"):
        v.plan(SandboxSpec(memory_mb=16, cpu=0.01), 1, NOW)


def test_nodes_holding_the_layers_fill_first_then_the_rest():
    v = view(node("both", capacity=4, layers=["base", "tools"]), node("base-only", capacity=4, layers=["base"]),
             node("none", capacity=100))
    spec = SandboxSpec(memory_mb=16, cpu=0.01, layers=["base", "tools"])
    assert v.plan(spec, 3, NOW) == {"both": 3}
    assert v.plan(spec, 6, NOW) == {"both": 4, "base-only": 2}
    assert v.plan(spec, 10, NOW) == {"both": 4, "base-only": 4, "none": 2}


def test_a_batch_spreads_in_proportion_to_free_room():
    assert spread({"a": 300, "b": 100}, 40) == {"a": 30, "b": 10}
    assert sum(spread({"a": 3, "b": 3, "c": 3}, 7).values()) == 7


def test_bookings_in_transit_are_what_the_node_instance_has_not_taken_yet():
    spec = SandboxSpec(cpu=0.5, memory_mb=100)
    info = node("a", accepted=10, accepted_cpu=5.0, accepted_memory_mb=1000)
    b = booked(info, None, 4, spec)
    assert (b.instance, b.count, b.cpu, b.memory_mb) == ("i1", 14, 7.0, 1400)
    assert in_transit(info, b).count == 4
    taken = node("a", accepted=13, accepted_cpu=6.5, accepted_memory_mb=1300)
    assert in_transit(taken, b).count == 1 and in_transit(taken, b).memory_mb == 100
    restarted = node("a", instance="i2")
    assert in_transit(restarted, b).count == 0
    assert booked(restarted, b, 1, spec).count == 1  # the new instance starts afresh
    assert released(b, 4, spec).count == 10


def test_a_node_that_does_not_count_forgets_bookings_at_its_next_heartbeat():
    spec = SandboxSpec(cpu=0.5, memory_mb=100)
    b = booked(node("a", instance=""), None, 3, spec)
    assert in_transit(node("a", instance=""), b).count == 3
    assert in_transit(node("a", instance="", at=NOW + 2), b).count == 0


def test_bookings_by_another_replica_reduce_the_free_room():
    v = view(node("a", capacity=10))
    v.set_booking("a", NodeBooking(instance="i1", count=7))
    assert v.free("a") == 3
    with pytest.raises(NoCapacity):
        v.plan("process", 4, NOW)


def test_a_quiet_node_gets_nothing_new_and_a_long_silent_one_is_lost():
    v = view(node("quiet", at=NOW - 12), node("silent", at=NOW - 40), node("b"), node_lost_s=30.0)
    assert v.eligible("process", NOW) == ["b"]
    assert v.alive(NOW) == ["quiet", "b"]


def test_a_quota_admits_up_to_its_concurrency():
    q = Quota(name="t", max_concurrent=3)
    usage = admit(q, QuotaUsage(), 2, NOW)
    assert usage.active == 2
    with pytest.raises(QuotaExceeded, match="quota: task 't' allows 3 concurrent"):
        admit(q, usage, 2, NOW)


def test_a_quota_limits_creates_per_second_with_a_one_second_bucket():
    q = Quota(name="t", max_creates_per_s=10)
    usage = admit(q, QuotaUsage(), 10, NOW)
    with pytest.raises(QuotaExceeded, match="retry in"):
        admit(q, usage, 1, NOW)
    assert admit(q, usage, 5, NOW + 0.5).tokens == pytest.approx(0.0)
    with pytest.raises(QuotaExceeded, match="never fits"):
        admit(q, QuotaUsage(), 11, NOW)


def test_a_small_batch_goes_to_a_few_roomy_nodes_not_one_each_to_all():
    v = view(*(node(f"n{i}", capacity=100 + i) for i in range(160)), min_share=16)
    plan = v.plan(SandboxSpec(memory_mb=16, cpu=0.01), 100, NOW)
    assert sum(plan.values()) == 100 and len(plan) == 7
    assert set(plan) == {f"n{i}" for i in range(153, 160)}  # the roomiest


def test_a_pinned_create_goes_to_that_node_only_even_when_others_have_more_room():
    v = view(node("small", capacity=3), node("big", capacity=100, layers=["base"]))
    spec = SandboxSpec(memory_mb=16, cpu=0.01, layers=["base"])
    assert v.plan(spec, 2, NOW, node="small") == {"small": 2}
    assert v.place(spec, 3, NOW, node="small") == {"small": 3}
    with pytest.raises(NoCapacity, match="room for 0 on 1 node"):  # full: no overflow elsewhere
        v.plan(spec, 1, NOW, node="small")
    assert v.plan(spec, 1, NOW) == {"big": 1}


def test_a_pinned_create_names_an_unknown_silent_pressured_or_incapable_node():
    v = view(node("a"), node("quiet", at=NOW - 12), node("hot", pressure=NodePressure(memory=60.0)),
             node("gone", at=NOW - 100), node_lost_s=30.0, memory_psi_limit=25.0)
    with pytest.raises(UnknownNode, match="'nowhere' is not registered"):
        v.plan("process", 1, NOW, node="nowhere")
    with pytest.raises(UnknownNode, match="'gone'"):  # lost: as good as unknown
        v.plan("process", 1, NOW, node="gone")
    with pytest.raises(NoCapacity, match="no heartbeat for 12 s"):
        v.plan("process", 1, NOW, node="quiet")
    with pytest.raises(NoCapacity, match="hot \\(memory pressure 60%\\)"):
        v.plan("process", 1, NOW, node="hot")
    with pytest.raises(NoEligibleNode, match="'a' cannot run isolation 'container'"):
        v.plan("container", 1, NOW, node="a")


def test_a_cpu_pressured_node_still_takes_a_create_pinned_to_it():
    v = view(node("busy", pressure=NodePressure(cpu=99.0)), node("calm"), cpu_psi_limit=95.0)
    assert v.plan(SandboxSpec(memory_mb=16, cpu=0.01), 1, NOW, node="busy") == {"busy": 1}


def test_the_create_request_takes_a_node_id_and_refuses_a_malformed_one():
    assert msgspec.convert({"node": "n-1"}, CreateRequest).node == "n-1"
    assert msgspec.convert({}, CreateRequest).node is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"node": "../etc"}, CreateRequest)


def _room(v: NodeView, spec: SandboxSpec) -> int:
    """The most sandboxes of `spec` a plan places now (one more is refused)."""
    total = sum(v.free(n, spec) for n in v.nodes)
    assert sum(v.plan(spec, total, NOW).values()) == total if total else True
    with pytest.raises(NoCapacity):
        v.plan(spec, total + 1, NOW)
    return total


def test_the_room_a_plan_remembers_follows_every_heartbeat_booking_size_layer_and_limit():
    v = view(node("a", capacity=10, cpus=2, memory_mb=1024), node("b", capacity=4, layers=("base",)),
             cpu_overcommit=1.0, memory_overcommit=1.0)
    small, large = SandboxSpec(cpu=0.1, memory_mb=16), SandboxSpec(cpu=1.0, memory_mb=16)
    assert (_room(v, small), _room(v, large)) == (14, 4)  # each: what a plan from scratch finds
    v.place(small, 4, NOW)  # a new booking on both
    assert (_room(v, small), _room(v, large)) == (10, 2)
    v.heartbeat(node("a", capacity=10, cpus=2, memory_mb=1024, running=5, accepted=3, accepted_cpu=0.3,
                     accepted_memory_mb=48, allocated_cpu=0.5, allocated_memory_mb=80))  # it took them, and more run
    assert (_room(v, small), _room(v, large)) == (8, 2)
    layered = SandboxSpec(cpu=0.1, memory_mb=16, layers=["base"])
    assert next(iter(v.plan(layered, 1, NOW))) == "b"  # the node holding the layer first
    v.heartbeat(node("b", capacity=4))  # it dropped the layer
    v.heartbeat(node("a", capacity=10, layers=("base",)))  # and this one has it
    assert next(iter(v.plan(layered, 1, NOW))) == "a"
    v.limits = Limits(cpu_overcommit=1.0, memory_overcommit=1.0, memory_psi_limit=0.5)
    v.heartbeat(node("a", capacity=10, pressure=NodePressure(memory=1.0)))
    assert _room(v, small) == v.free("b", small) and v.free("a", small) == 0
    v.forget("a")
    v.heartbeat(node("a", capacity=3, instance="i2"))  # back, restarted: the old booking is not its
    assert v.free("a", small) == 3

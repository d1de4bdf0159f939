"""A trainer's view through the SDK, against the real platform: create, exec, files, destroy, events."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

import sandfleet
from sandfleet import errors
from sandfleet.credentials import connect_options
from sandfleet.store import SandboxStore
from schemas import node as node_schema
from schemas import sandbox
from schemas.errors import ErrorCode
from schemas.node import LaunchItem, LaunchReply, LaunchRequest
from schemas.sandbox import Reason, SandboxRecord, SandboxSpec, State
from services.placement.handlers import new_id
from tests.leaks import Snapshot


async def _collect(fleet, sandbox_id, until: str, timeout: float = 15.0):
    got = []

    async def run():
        async for ev in fleet.events(sandbox_id, replay=True):
            got.append(ev)
            if ev.name == until:
                return

    await asyncio.wait_for(run(), timeout)
    return got


async def test_created_sandbox_runs_commands_in_its_workspace(fleet):
    sb = await fleet.create(isolation="process", cpu=1.0, memory_mb=256, timeout_s=600, labels={"task": "t1"}, host_view=True)
    assert sb.id and sb.node
    try:
        r = await sb.exec(["sh", "-c", "echo hi; echo err >&2; pwd; exit 3"], timeout_s=30)
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"hi\n/workspace\n", b"err\n")
    finally:
        await sb.destroy()


async def test_files_written_are_read_back_and_seen_by_commands(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True)
    try:
        await sb.write_file("/workspace/a.txt", b"data")
        assert await sb.read_file("/workspace/a.txt") == b"data"
        r = await sb.exec(["cat", "/workspace/a.txt"])
        assert r.stdout == b"data"
        with pytest.raises(errors.NotFound):
            await sb.read_file("/workspace/missing")
        with pytest.raises(errors.InvalidRequest):
            await sb.write_file("/usr/bin/evil", b"x")
    finally:
        await sb.destroy()


async def test_lifecycle_events_follow_the_state_machine(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True)
    record = await sb.destroy()
    assert record.state is State.STOPPED and record.reason is Reason.REQUESTED
    got = await _collect(fleet, sb.id, "stopped")
    # `starting` is recorded only for a launch still building after the grace (0.5 s).
    assert [e.name for e in got if e.name != "starting"] == ["scheduled", "started", "stopping", "stopped"]
    assert [e.seq for e in got] == list(range(1, len(got) + 1))


async def test_expired_sandbox_is_destroyed_and_its_event_says_so(fleet):
    sb = await fleet.create(memory_mb=128, timeout_s=1, host_view=True)
    got = await _collect(fleet, sb.id, "stopped", timeout=15)
    assert got[-1].reason is Reason.EXPIRED
    with pytest.raises(errors.NotFound):
        await sb.exec(["true"])


async def test_handle_for_an_existing_sandbox_by_id(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True)
    try:
        again = await fleet.sandbox(sb.id)
        assert again.node == sb.node
        assert (await again.exec(["echo", "same"])).stdout == b"same\n"
        assert sb.id in {r.id for r in await fleet.list()}
    finally:
        await sb.destroy()
    with pytest.raises(errors.NotFound):
        await fleet.sandbox(sb.id)


async def test_create_many_is_one_batch_of_usable_sandboxes(fleet):
    many = await fleet.create_many(40, isolation="process", memory_mb=64, host_view=True)
    try:
        assert len({sb.id for sb in many}) == 40
        outs = await asyncio.gather(*(sb.exec(["hostname"]) for sb in many[:5]))
        assert all(o.exit_code == 0 for o in outs)
    finally:
        await asyncio.gather(*(sb.destroy() for sb in many))


async def test_exec_timeout_kills_the_command(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True)
    try:
        r = await sb.exec(["sh", "-c", "sleep 30"], timeout_s=0.5)
        assert r.timed_out
        assert (await sb.exec(["true"])).exit_code == 0
    finally:
        await sb.destroy()


async def test_a_vm_level_sandbox_without_layers_is_a_typed_error(fleet):
    """Every level runs on this node now (a level no node offers is placement's Unsupported:
    tests/test_placement_policy.py); a VM's root is its layers, so none is a caller's mistake."""
    with pytest.raises(errors.InvalidRequest, match="layers"):
        await fleet.create(isolation="vm")


async def test_sandbox_sees_host_system_read_only_and_nothing_private(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True)
    try:
        r = await sb.exec(["sh", "-c", "ls /; test -e /root || echo noroot; test -e /home || echo nohome; "
                           "touch /usr/x 2>/dev/null || echo rousr; ls /proc | grep -c '^[0-9]'"])
        listing = r.stdout.decode()
        assert "noroot" in listing and "nohome" in listing and "rousr" in listing
        for hidden in ("work", "srv", "var", "root", "home"):
            assert f"\n{hidden}\n" not in f"\n{listing}"
        assert int(listing.strip().splitlines()[-1]) <= 5  # init, sh, ls, grep: none of the host's
    finally:
        await sb.destroy()


async def test_sdk_rejects_bad_limits_before_sending(fleet, platform):
    watcher = await nats.connect(platform.url, **connect_options(platform.url))  # its own sees what the SDK sends
    try:
        subs = [await watcher.subscribe(s) for s in (sandbox.CREATE, sandbox.CREATE_MANY)]
        await watcher.flush()
        with pytest.raises(errors.InvalidRequest):
            await fleet.create(memory_mb=-5)
        with pytest.raises(errors.InvalidRequest):
            await fleet.create_many(2, memory_mb=-5)
        await fleet.bus.nc.flush()  # whatever the SDK sent has reached the server...
        await watcher.flush()  # ...and been delivered to this connection's queues
        assert [sub.pending_msgs for sub in subs] == [0, 0]
    finally:
        await watcher.close()


async def test_unreachable_bus_is_no_responders():
    with pytest.raises(errors.NoResponders):
        await sandfleet.connect("nats://127.0.0.1:1")


async def test_a_launch_sent_straight_to_a_node_for_an_unknown_sandbox_fails_alone(fleet, platform):
    # Only placement launches, with each record; anyone on the bus may still send one.
    request = LaunchRequest(sandboxes=[LaunchItem(id="sb-neverrecorded", spec=SandboxSpec(host_view=True, memory_mb=64))])
    reply = await fleet.bus.request(node_schema.subject(platform.node_id, node_schema.LAUNCH), request, LaunchReply,
                                    timeout=30)
    assert [(r.ok, r.code) for r in reply.results] == [(False, ErrorCode.NOT_FOUND)]


async def test_a_sandbox_placement_ended_while_its_node_built_it_is_torn_down(fleet, platform):
    # Its record ended (placement gave up on the launch) after the request left: the node,
    # which writes nothing before the grace, finds out at its `running` write and tears it down.
    store = await SandboxStore.open(fleet.bus)
    now = time.time()
    record = SandboxRecord(id=new_id(), node=platform.node_id, spec=SandboxSpec(host_view=True, memory_mb=64),
                           state=State.SCHEDULED, created_at=now, updated_at=now)
    ((record, revision),) = await store.create_many([record])
    await store.transition(record.id, State.FAILED, Reason.LAUNCH_FAILED, "placement gave up")
    request = LaunchRequest(sandboxes=[LaunchItem(id=record.id, spec=record.spec, record=record, revision=revision)])
    reply = await fleet.bus.request(node_schema.subject(platform.node_id, node_schema.LAUNCH), request, LaunchReply,
                                    timeout=30)
    assert [r.ok for r in reply.results] == [False]
    assert (await fleet.get(record.id)).state is State.FAILED
    assert not [c for c in Snapshot.take().cgroups if record.id in c]  # its processes and cgroup are gone

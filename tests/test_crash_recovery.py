"""`kill -9` of a service while sandboxes run: after its restart each sandbox is usable or failed with a reason.

Kills in the middle of a service's own work are in tests/test_crash_midwork.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

from linuxnode import netns
from schemas.sandbox import Reason, State


async def test_launcher_killed_keeps_live_sandboxes_and_fails_the_dead_one(fleet, platform):
    keep = await fleet.create(memory_mb=64, host_view=True)
    lose = await fleet.create(memory_mb=64, host_view=True)
    await keep.write_file("/workspace/state", b"before")
    lose_init = (await fleet.get(lose.id)).init_pid
    old = platform.service_pid("launcher")
    os.kill(old, signal.SIGKILL)
    os.kill(lose_init, signal.SIGKILL)  # dies while nobody watches
    await platform.restarted(fleet, "launcher", old)

    r = await keep.exec(["cat", "/workspace/state"])
    assert r.stdout == b"before"
    record = await fleet.get(lose.id)
    assert record.state is State.FAILED and record.reason is Reason.LOST_ON_RESTART
    await keep.destroy()


async def test_agent_killed_keeps_sandboxes_usable_and_reclaims_orphans(fleet, platform):
    sb = await fleet.create(memory_mb=64, host_view=True)
    # Leave an orphaned namespace as a crashed launch would; the restarted agent must reclaim it.
    orphan = f"sf-{platform.node_id}.orphan-test"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    old = platform.service_pid("agent")
    os.kill(old, signal.SIGKILL)
    await platform.restarted(fleet, "agent", old)

    assert (await sb.exec(["echo", "alive"])).stdout == b"alive\n"
    assert not os.path.exists(f"/run/netns/{orphan}")
    fresh = await fleet.create(memory_mb=64, host_view=True)
    assert (await fresh.exec(["true"])).exit_code == 0
    await asyncio.gather(sb.destroy(), fresh.destroy())
    assert not netns.exists(platform.node_id, sb.id)


async def test_a_sandbox_left_scheduled_by_a_placement_killed_before_its_launch_is_failed_by_the_restarted_one(
        fleet, platform):
    """A placement replica that died between writing a record and asking its node leaves it
    `scheduled` with no launch. The record is left here as such a replica leaves it, aged past
    STUCK_AFTER_S (a real kill in that window would make the test wait 120 s and more); then
    placement is killed for real and its restarted process must fail it as it starts."""
    from sandfleet.store import SandboxStore
    from schemas.sandbox import SandboxRecord, SandboxSpec
    from services.placement.handlers import STUCK_AFTER_S

    store = await SandboxStore.open(fleet.bus)
    old = time.time() - STUCK_AFTER_S - 60
    stuck = f"sb-stuck{os.getpid():x}"
    await store.create(SandboxRecord(id=stuck, node="gone", spec=SandboxSpec(host_view=True), state=State.SCHEDULED,
                                     created_at=old, updated_at=old))
    killed = platform.service_pid("placement")
    os.kill(killed, signal.SIGKILL)
    await platform.restarted(fleet, "placement", killed)

    deadline = time.monotonic() + 30
    while (got := await fleet.get(stuck)).state is State.SCHEDULED:
        assert time.monotonic() < deadline, "the restarted placement left the sandbox scheduled"
        await asyncio.sleep(0.2)
    assert (got.state, got.reason, got.detail) == (State.FAILED, Reason.LAUNCH_FAILED, "never launched")
    sb = await fleet.create(memory_mb=64, host_view=True)  # and it places again
    assert (await sb.exec(["true"])).exit_code == 0
    await sb.destroy()
    await store.forget(stuck)

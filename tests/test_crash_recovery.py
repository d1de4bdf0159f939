"""`kill -9` of a service while sandboxes run: after its restart each sandbox is usable or failed with a reason."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

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
    assert not os.path.exists(f"/run/netns/sf-{platform.node_id}.{sb.id}")


async def test_a_sandbox_left_scheduled_by_a_dead_placement_is_failed_not_lost(fleet):
    from sandfleet.store import SandboxStore
    from schemas.sandbox import SandboxRecord, SandboxSpec
    from services.placement import handlers
    from services.placement.policy import NodeView

    store = await SandboxStore.open(fleet.bus)
    old = time.time() - 3600
    record = SandboxRecord(id="sb-stuck0001", node="gone", spec=SandboxSpec(host_view=True), state=State.SCHEDULED,
                           created_at=old, updated_at=old)
    await store.create(record)
    failed = await handlers.fail_stuck(handlers.Deps(fleet.bus, store, NodeView()), time.time())
    # The platform's own placement sweeps too and may get there first; either way it ends failed.
    assert "sb-stuck0001" in failed or (await fleet.get("sb-stuck0001")).state is State.FAILED
    got = await fleet.get("sb-stuck0001")
    assert got.state is State.FAILED and got.reason is Reason.LAUNCH_FAILED
    await store.forget("sb-stuck0001")

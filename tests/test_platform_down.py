"""`sandfleet down` destroys every sandbox and leaves nothing behind on the machine."""

from __future__ import annotations

import asyncio
import time

import sandfleet
from tests.conftest import start_platform, stop_platform
from tests.leaks import Snapshot


async def test_down_destroys_sandboxes_and_leaves_no_process_cgroup_netns_or_mount(tmp_path):
    before = Snapshot.take()
    p = start_platform(tmp_path / "data", "downnode")
    try:
        async with sandfleet.connect(p.url) as fleet:
            boxes = await fleet.create_many(5, memory_mb=64, host_view=True)
            # A background process inside must not keep anything alive.
            await boxes[0].exec(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"])
            assert Snapshot.take().added_since(before)  # the platform does hold resources now
    finally:
        stop_platform(p)
    deadline = time.monotonic() + 10
    while (left := Snapshot.take().added_since(before)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not left, left
    assert not (tmp_path / "data" / "supervisor.json").exists()

"""`sandfleet down` destroys every sandbox and leaves nothing behind on the machine."""

from __future__ import annotations

import sandfleet
from tests.conftest import NODE_ID, assert_nothing_left, left_behind, start_platform, stop_platform
from tests.leaks import Snapshot


async def test_down_destroys_sandboxes_and_leaves_no_process_cgroup_netns_or_mount(tmp_path):
    before = Snapshot.take()
    node = f"{NODE_ID}-down"
    p = start_platform(tmp_path / "data", node)
    try:
        async with sandfleet.connect(p.url) as fleet:
            boxes = await fleet.create_many(5, memory_mb=64, host_view=True)
            # A background process inside must not keep anything alive.
            await boxes[0].exec(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"])
            held = left_behind(before, tmp_path / "data", [node])
            # The platform does hold resources now: its processes, the sandboxes' cgroups and namespaces.
            assert {"processes", "cgroups", "netns"} <= set(held), held
    finally:
        stop_platform(p)
    assert_nothing_left(before, tmp_path / "data", [node])
    assert not (tmp_path / "data" / "supervisor.json").exists()

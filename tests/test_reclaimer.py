"""The memory reclamation service on a real platform: an idle sandbox holding duplicate pages is
merged by KSM and paged out to the node's zram swap, each action an event on the bus with the
bytes it reclaimed; the node's savings show in `sandfleet status`; the zram swap of a crashed
reclaimer is taken down by its successor, and none is left after the platform stops.

The platform here is its own (short idle and merge windows, a small zram device), so the
session's platform keeps its defaults.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import nats.js.api
import pytest

import sandfleet
from sandfleet.bus import decode
from schemas import events, reclaim
from schemas.reclaim import NodeSavings, ReclaimAction
from services.reclaimer.ksm import REGISTRY
from services.reclaimer.zram import REGISTRY as ZRAM_REGISTRY
from services.reclaimer.zram import ZramSwap, active_swaps, swap_uuid
from tests.conftest import NODE_ID, start_platform, stop_platform
from tests.kernel import require

RC_NODE = f"{NODE_ID}-rc"
FAST = {
    "SANDFLEET_RECLAIM_IDLE_S": "3",
    "SANDFLEET_RECLAIM_MERGE_S": "8",
    "SANDFLEET_RECLAIM_MERGE_MAX_S": "60",
    "SANDFLEET_RECLAIM_INTERVAL_S": "1",
    "SANDFLEET_ZRAM_MB": "256",
    # This test is about reclamation, not placement's pressure feedback: a machine shared with
    # other work must not keep it from placing its one sandbox.
    "SANDFLEET_CPU_PSI_LIMIT": "0",
    "SANDFLEET_MEMORY_PSI_LIMIT": "0",
}
# An agent at rest: 32 MiB of identical pages, a heap of small private objects, then sleep.
AGENT = """
import collections, json, re, time
same = bytearray(b"Z") * (32 << 20)
heap = [{"step": i, "text": "observation %d" % i} for i in range(100_000)]
time.sleep(3600)
"""


def _zram_swap_uuids() -> set[str]:
    """The swap UUIDs of the zram swaps on now (other nodes on this machine have theirs)."""
    return {swap_uuid(d) for d in active_swaps() if d.startswith("/dev/zram")}


@pytest.fixture(scope="module")
def rc_platform(leak_check, tmp_path_factory):
    require(Path("/sys/kernel/mm/ksm/run").exists(), "KSM (CONFIG_KSM) for page merging")
    require(Path("/sys/class/zram-control/hot_add").exists(), "the zram module for compressed swap")
    p = start_platform(tmp_path_factory.mktemp("reclaim"), RC_NODE, env=FAST)
    yield p
    if (p.data_dir / "supervisor.json").exists():  # the shutdown test stops it itself
        stop_platform(p)


@pytest.fixture(scope="module")
async def rc_fleet(rc_platform):
    async with sandfleet.connect(rc_platform.url) as f:
        yield f


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _record(p) -> Path:
    return p.data_dir / "reclaimer" / RC_NODE / "zram.json"


async def _next_action(sub, timeout: float) -> ReclaimAction:
    msg = await sub.next_msg(timeout=timeout)
    return decode(msg.data, ReclaimAction)


async def test_an_idle_sandbox_with_duplicate_pages_is_merged_and_paged_out_with_events(rc_platform, rc_fleet):
    sb = await rc_fleet.create(memory_mb=256, host_view=True, labels={"task": "reclaim"})
    sub = await rc_fleet.bus.js.subscribe(reclaim.sandbox_filter(RC_NODE, sb.id), stream=events.STREAM,
                                         ordered_consumer=True, deliver_policy=nats.js.api.DeliverPolicy.ALL)
    try:
        await sb.write_file("/workspace/agent.py", AGENT.encode())
        r = await sb.exec(["sh", "-c", "python3 /workspace/agent.py >/dev/null 2>&1 &"])
        assert r.exit_code == 0, r.stderr
        # Idle window (3 s after the agent settles) + merging (8 to 60 s) + a pass or two.
        merged = await _next_action(sub, timeout=120)
        paged = await _next_action(sub, timeout=30)
    finally:
        await sub.unsubscribe()
    assert (merged.action, merged.sandbox_id, merged.node) == ("merge", sb.id, RC_NODE)
    assert merged.bytes_reclaimed >= 16 << 20  # most of the 32 MiB of identical pages share one copy
    assert paged.action == "page_out" and paged.outcome == "done"
    assert paged.bytes_reclaimed > 0  # the private heap went to zram

    savings = await rc_fleet.bus.request(reclaim.savings_subject(RC_NODE), reclaim.SavingsRequest(), NodeSavings)
    assert savings.enabled and savings.zram.startswith("on: /dev/zram")
    assert savings.actions.get("merge", 0) >= 1 and savings.actions.get("page_out", 0) >= 1
    assert savings.swapped_bytes > 0 and savings.merged_bytes > 0 and savings.saved_bytes > 0
    status = rc_platform.cli("status", check=False).stdout.decode()
    assert "reclaim" in status and "saved" in status and "zram on: /dev/zram" in status
    await sb.destroy()


async def test_a_restarted_reclaimer_takes_down_the_zram_swap_its_predecessor_left(rc_platform, rc_fleet, tmp_path):
    old = json.loads(_record(rc_platform).read_text())["uuid"]
    assert old in _zram_swap_uuids()
    # And a device whose reclaimer died for good (another node, its data dir deleted): only the
    # machine's registry knows it, naming a pid that is gone.
    orphan = ZramSwap(tmp_path / "gone.json", f"{RC_NODE}-gone")
    orphan.set_up(16)
    dead = _dead_pid()
    entry = ZRAM_REGISTRY / f"{RC_NODE}-gone.json"
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "pid": dead}))
    assert orphan.uuid in _zram_swap_uuids()
    pid = rc_platform.service_pid("reclaimer")
    os.kill(pid, signal.SIGKILL)  # no shutdown: the device stays behind, on record
    await rc_platform.restarted(rc_fleet, "reclaimer", pid)
    new = json.loads(_record(rc_platform).read_text())["uuid"]
    on = _zram_swap_uuids()
    assert new in on and new != old
    assert old not in on  # swapped off and removed (its device number may serve another node now)
    assert orphan.uuid not in on and not entry.exists()


async def test_no_zram_swap_is_left_after_the_platform_stops(rc_platform, rc_fleet):
    record = json.loads(_record(rc_platform).read_text())
    assert record["uuid"] in _zram_swap_uuids()
    await rc_fleet.close()
    await asyncio.to_thread(stop_platform, rc_platform)
    assert record["uuid"] not in _zram_swap_uuids()
    assert not _record(rc_platform).exists()
    assert not (REGISTRY / f"{RC_NODE}.json").exists()  # it left the machine's KSM registry too

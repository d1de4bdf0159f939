"""A sandbox's lifetime and health against the real platform, for `process` and `container`:
`set_timeout` moves its deadline (later: it outlives the first one; sooner: it ends `expired`),
bad values are typed errors, and `metrics()` follows real work done inside it (memory, CPU,
disk of its writable layer, processes, loopback bytes), every figure read by the node from
outside the sandbox. Bounds are lower bounds, so a reading that does not move fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.health import SetTimeoutRequest
from schemas.sandbox import Reason, State
from services.launcher import health
from services.launcher.settings import LauncherSettings
from tests.conftest import CLI, ROOT
from tests.kernel import require
from tests.layer_trees import APPLETS, make_busybox_base
from tests.test_sandbox_lifecycle import _collect

BASE = "health-base"
MiB = 1 << 20
# `nc` for loopback traffic, `setsid` for processes that outlive the exec starting them.
HEALTH_APPLETS = (*APPLETS, "nc", "setsid", "wc")


@pytest.fixture(scope="module")
async def health_base(fleet, platform, tmp_path_factory):
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("health-src") / "base"
    make_busybox_base(src, hostname="health", applets=HEALTH_APPLETS)
    await Layers(fleet.bus).build_dir(BASE, src)
    return BASE


@pytest.fixture(params=["process", "container"])
async def make(request, fleet, platform, health_base):
    """Creates sandboxes of the level (`process` on the host view, `container` on a busybox
    base); destroys what is left of them at the end."""
    level = request.param
    if level == "container":
        require(os.geteuid() == 0, "containers need root")
        require(shutil.which("crun") is not None, "crun is installed")
    made = []

    async def create(**kw):
        kw.setdefault("memory_mb", 256)
        if level == "process":
            sb = await fleet.create(isolation="process", host_view=True, **kw)
        else:
            sb = await fleet.create(isolation="container", layers=[health_base], **kw)
        made.append(sb)
        return sb

    create.level = level
    yield create
    for sb in made:
        try:
            await sb.destroy()
        except errors.NotFound:
            pass


def _sh(script: str) -> list[str]:
    return ["busybox", "sh", "-c", script]


async def _ok(sb, script: str, timeout_s: float = 60):
    r = await sb.exec(_sh(script), timeout_s=timeout_s)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r


# -- set_timeout ------------------------------------------------------------------------------------

async def test_set_timeout_extends_life_past_the_original_deadline(make, fleet):
    sb = await make(timeout_s=2)
    first = (await sb.info()).deadline
    record = await sb.set_timeout(30)
    assert record.deadline >= first + 20
    assert (await sb.info()).deadline == record.deadline
    while time.time() < first + 1.5:  # past the first deadline and then some expiry passes
        await asyncio.sleep(0.2)
    assert (await sb.info()).state is State.RUNNING
    assert (await sb.exec(["busybox", "true"])).exit_code == 0


async def test_set_timeout_shorter_ends_it_as_expired_with_its_event(make, fleet):
    sb = await make(timeout_s=600)
    await sb.set_timeout(0.5)
    got = await _collect(fleet, sb.id, "stopped", timeout=30)
    assert got[-1].reason is Reason.EXPIRED
    assert [e.name for e in got][-2:] == ["stopping", "stopped"]
    with pytest.raises(errors.NotFound):
        await sb.metrics()


@pytest.mark.parametrize("seconds", [0, -5, 10**9, float("inf")])
async def test_set_timeout_refuses_bad_values_and_changes_nothing(make, seconds):
    sb = await make(timeout_s=600)
    before = (await sb.info()).deadline
    with pytest.raises(errors.InvalidRequest):
        await sb.set_timeout(seconds)
    assert (await sb.info()).deadline == before


async def test_set_timeout_and_metrics_of_a_destroyed_sandbox_are_not_found(make):
    sb = await make()
    await sb.destroy()
    with pytest.raises(errors.NotFound):
        await sb.set_timeout(60)
    with pytest.raises(errors.NotFound):
        await sb.metrics()


async def test_an_ending_sandbox_refuses_a_new_timeout():
    """The launcher's refusal itself, before any write: a sandbox being destroyed keeps its end."""
    live = SimpleNamespace(id="sb-ending", ending=True)
    launcher = SimpleNamespace(node_id="n", live={"sb-ending": live}, settings=LauncherSettings(), store=None)
    with pytest.raises(ServiceError) as raised:
        await health.set_timeout(launcher, SetTimeoutRequest(sandbox_id="sb-ending", timeout_s=60))
    assert raised.value.code is ErrorCode.CONFLICT


async def test_a_timeout_past_the_configured_maximum_is_refused():
    launcher = SimpleNamespace(node_id="n", live={}, settings=LauncherSettings(max_timeout_s=100), store=None)
    with pytest.raises(ServiceError) as raised:
        await health.set_timeout(launcher, SetTimeoutRequest(sandbox_id="sb-any", timeout_s=101))
    assert raised.value.code is ErrorCode.INVALID_REQUEST


# -- metrics -----------------------------------------------------------------------------------------

async def test_memory_grows_when_the_sandbox_holds_64_mib(make):
    sb = await make(memory_mb=256)
    before = await sb.metrics()
    assert before.memory_bytes > 0 and before.memory_limit_bytes == 256 * MiB
    # tmpfs pages are charged to the sandbox's memory cgroup and stay (no swap for it)
    await _ok(sb, "busybox dd if=/dev/zero of=/tmp/hold bs=1048576 count=64 2>/dev/null")
    after = await sb.metrics()
    assert after.memory_bytes >= before.memory_bytes + 60 * MiB
    assert after.memory_peak_bytes >= after.memory_bytes


async def test_cpu_time_grows_after_a_busy_loop(make):
    sb = await make()
    before = await sb.metrics()
    await _ok(sb, "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done")
    after = await sb.metrics()
    assert after.cpu_s >= before.cpu_s + 0.05  # the loop is ~0.5 s of CPU; an unread figure stays put


async def test_disk_grows_by_a_file_written_in_the_writable_layer(make):
    sb = await make()
    before = await sb.metrics()
    await _ok(sb, "busybox dd if=/dev/zero of=/workspace/big bs=1048576 count=32 2>/dev/null")
    after = await sb.metrics()
    assert before.disk_bytes >= 0
    assert after.disk_bytes >= before.disk_bytes + 31 * MiB


async def test_process_count_follows_the_processes_started(make):
    sb = await make()
    before = await sb.metrics()
    assert before.processes >= 1  # its init
    await _ok(sb, "for i in 1 2 3; do busybox setsid busybox sleep 600 </dev/null >/dev/null 2>&1 & done")
    deadline = time.monotonic() + 10
    # The background starts may still be forking when the shell is gone: wait for the count to settle.
    while (after := await sb.metrics()).processes != before.processes + 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert after.processes == before.processes + 3


async def test_network_bytes_grow_after_loopback_traffic(make):
    sb = await make()
    before = await sb.metrics()
    assert "lo" in {i.name for i in before.interfaces}
    # busybox nc ends when its stdin does: the listener's stays open long enough for the sender's
    # MiB (a loopback transfer of milliseconds), and no longer, for the test's sake
    await _ok(sb, "busybox sleep 3 2>/dev/null | busybox nc -l -p 9000 > /dev/null & s=$!; busybox sleep 0.3; "
                  "busybox dd if=/dev/zero bs=1024 count=1024 2>/dev/null | busybox nc 127.0.0.1 9000; wait $s")
    after = await sb.metrics()
    lo_before = next(i for i in before.interfaces if i.name == "lo")
    lo_after = next(i for i in after.interfaces if i.name == "lo")
    assert lo_after.rx_bytes >= lo_before.rx_bytes + MiB and lo_after.tx_bytes >= lo_before.tx_bytes + MiB
    assert after.rx_bytes >= before.rx_bytes + MiB and after.tx_bytes >= before.tx_bytes + MiB


async def test_node_metrics_lists_the_nodes_live_sandboxes(make, fleet):
    from sandfleet import _health

    sb = await make()
    found = dict((m.sandbox_id, (node, m)) for node, m in await _health.fleet_metrics(fleet, sb.node))
    assert sb.id in found and found[sb.id][0] == sb.node and found[sb.id][1].memory_bytes > 0


# -- CLI ---------------------------------------------------------------------------------------------

async def test_top_shows_the_sandbox_and_ends_quietly_on_a_closed_pipe(fleet, platform):
    sb = await fleet.create(memory_mb=128, host_view=True)
    try:
        out = await asyncio.to_thread(platform.cli, "top", "--count", "2", "--interval", "0.2", "--node",
                                      platform.node_id)
        text = out.stdout.decode()
        assert sb.id in text and "CPU%" in text and out.stderr == b""
        command = " ".join([*CLI, "top", "--interval", "0.1"]) + " | head -n 1"
        piped = await asyncio.to_thread(
            subprocess.run, ["bash", "-o", "pipefail", "-c", command], capture_output=True, timeout=60, cwd=ROOT,
            env={**platform.env, "SANDFLEET_NATS_URL": platform.url})
        assert piped.returncode == 0 and piped.stderr == b"" and len(piped.stdout.splitlines()) == 1
        interrupted = await asyncio.to_thread(_interrupted_top, platform)
        assert interrupted.returncode == 0 and interrupted.stderr == b""
        moved = await asyncio.to_thread(platform.cli, "set-timeout", sb.id, "900")
        assert sb.id.encode() in moved.stdout
        assert (await sb.info()).deadline >= time.time() + 800
    finally:
        await sb.destroy()


def test_net_dev_lines_give_each_interfaces_receive_and_transmit_bytes():
    from linuxnode.procfs import parse_net_dev

    text = (b"Inter-|   Receive                                                |  Transmit\n"
            b" face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls\n"
            b"    lo:    1234      10    0    0    0     0          0         0     1234      10    0    0    0     0"
            b"       0          0\n"
            b"  eth0:99 1 0 0 0 0 0 0 77 1 0 0 0 0 0 0\n"
            b"broken: x\n")
    assert [(i.name, i.rx_bytes, i.tx_bytes) for i in parse_net_dev(text)] == [("lo", 1234, 1234), ("eth0", 99, 77)]


def _interrupted_top(platform) -> subprocess.CompletedProcess:
    """`sandfleet top` sent SIGINT (Ctrl-C) once it has drawn its first frame."""
    proc = subprocess.Popen([*CLI, "top", "--interval", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**platform.env, "SANDFLEET_NATS_URL": platform.url})
    try:
        assert proc.stdout.readline()  # the frame's first line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

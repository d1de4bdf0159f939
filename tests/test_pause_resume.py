"""Pause, resume, CPU hints, rollout pauses and checkpoint → restore, against the real platform.

A ticker (a shell loop counting into a file) shows a paused sandbox makes no progress and a
resumed one does; the kernel's own files show the freeze (v2 cgroup.freeze, cgroup.events)
and the CPU weight (v1 cpu.shares here, v2 cpu.weight where v2 has the cpu controller).
A checkpoint is a real layer built by the layer-cache from the sandbox's upper dir; the
sandbox restored from it reads the files written before the checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers
from schemas import node as node_schema
from schemas.node import QuarantineReply, QuarantineRequest
from schemas.sandbox import Reason, State
from tests.kernel import require
from tests.layer_trees import APPLETS, BUSYBOX, make_busybox_base

TICKER = "i=0; while true; do i=$((i+1)); echo $i > /workspace/tick; sleep 0.05; done >/dev/null 2>&1 &"


def cgroup_dir(pid: int, controller: str) -> str:
    """The directory of `pid` in a v1 controller's hierarchy, or in v2 for controller ''."""
    mounts = {}
    with open("/proc/mounts") as f:
        for line in f:
            _, where, kind, opts, *_ = line.split()
            if kind == "cgroup2":
                mounts[""] = where
            elif kind == "cgroup":
                for opt in opts.split(","):
                    mounts.setdefault(opt, where)
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == controller or controller in controllers.split(","):
                return mounts[controller] + path
    raise AssertionError(f"pid {pid} has no {controller or 'v2'} cgroup")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


async def ticks(sb) -> int:
    return int((await sb.read_file("/workspace/tick")).decode().strip() or 0)


async def ticking(sb) -> None:
    await sb.exec(["sh", "-c", TICKER])
    for _ in range(100):
        try:
            if await ticks(sb) > 0:
                return
        except errors.NotFound:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the ticker never ticked")


@pytest.fixture(autouse=True)
def _root():
    require(os.geteuid() == 0, "cgroups and mounts need root")


@pytest.fixture(scope="module")
async def busybox_layer(fleet, tmp_path_factory) -> str:
    """One busybox base layer for the tests here that need any: layers are immutable, and a
    checkpoint is a layer of its own on top, so sharing it lets no test see another's files."""
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    root = tmp_path_factory.mktemp("pr-base") / "base"
    make_busybox_base(root)
    name = "prs-" + secrets.token_hex(3)
    await Layers(fleet.bus).build_dir(name, root)
    return name


async def test_pause_stops_progress_and_resume_restarts_it(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True, labels={"task": "pr-" + secrets.token_hex(3)})
    try:
        await ticking(sb)
        record = await sb.pause()
        assert (record.state, record.reason) == (State.PAUSED, Reason.REQUESTED)
        v2 = cgroup_dir(record.init_pid, "")
        assert read(f"{v2}/cgroup.freeze").strip() == "1"
        assert "frozen 1" in read(f"{v2}/cgroup.events")
        before = await ticks(sb)
        await asyncio.sleep(0.5)  # ten ticks' worth of time
        assert await ticks(sb) == before
        with pytest.raises(errors.Conflict, match="paused"):
            await sb.exec(["true"])
        assert (await sb.pause()).state is State.PAUSED  # idempotent

        record = await sb.resume()
        assert record.state is State.RUNNING
        assert read(f"{v2}/cgroup.freeze").strip() == "0"
        await asyncio.sleep(0.5)
        assert await ticks(sb) > before
        assert (await sb.exec(["true"])).exit_code == 0
        names = [e.name for e in await fleet.history(sb.id)]
        assert names[names.index("started"):] == ["started", "paused", "resumed"]
    finally:
        await sb.destroy()


async def test_a_quarantined_sandbox_is_not_resumed(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        await sb.pause()
        req = QuarantineRequest(sandbox_id=sb.id, detail="test: caught cheating")
        reply = await fleet.bus.request(node_schema.subject(sb.node, node_schema.QUARANTINE), req, QuarantineReply)
        assert (reply.record.state, reply.record.reason) == (State.PAUSED, Reason.VIOLATION)
        with pytest.raises(errors.Conflict, match="quarantined"):
            await sb.resume()
        record = await sb.info()
        assert (record.state, record.reason) == (State.PAUSED, Reason.VIOLATION)
        assert read(f"{cgroup_dir(record.init_pid, '')}/cgroup.freeze").strip() == "1"
    finally:
        await sb.destroy()


async def test_a_paused_sandbox_still_expires(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True, timeout_s=2)
    await sb.pause()
    async for event in fleet.events(sb.id, replay=True):
        if event.name in ("stopped", "failed"):
            assert (event.state, event.reason) == (State.STOPPED, Reason.EXPIRED)
            break


async def test_the_reclaimers_pause_subject_freezes_with_reason_memory_pressure(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        req = node_schema.PauseRequest(sandbox_id=sb.id, reason="memory_pressure", detail="test")
        reply = await fleet.bus.request(node_schema.subject(sb.node, node_schema.PAUSE), req, node_schema.PauseReply)
        assert (reply.record.state, reply.record.reason) == (State.PAUSED, Reason.MEMORY_PRESSURE)
        assert (await sb.resume()).state is State.RUNNING
    finally:
        await sb.destroy()


async def test_hint_idle_lowers_the_cpu_weight_and_active_restores_it(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        pid = (await sb.info()).init_pid
        v2 = cgroup_dir(pid, "")
        if os.path.exists(f"{v2}/cpu.weight"):
            path, idle, active = f"{v2}/cpu.weight", "1", "100"
        else:
            path, idle, active = f"{cgroup_dir(pid, 'cpu')}/cpu.shares", "2", "1024"
        assert read(path).strip() == active
        reply = await sb.hint("idle")
        assert (reply.file, read(path).strip()) == (path, idle)
        await sb.hint("active")
        assert read(path).strip() == active
        with pytest.raises(errors.InvalidRequest):
            await sb.hint("sleepy")
    finally:
        await sb.destroy()


async def test_fleet_pause_pauses_exactly_that_tasks_sandboxes(fleet):
    task, other = "roll-" + secrets.token_hex(3), "keep-" + secrets.token_hex(3)
    mine = [await fleet.create(memory_mb=64, host_view=True, labels={"task": task}) for _ in range(3)]
    theirs = await fleet.create(memory_mb=64, host_view=True, labels={"task": other})
    try:
        change = await fleet.pause(task=task)
        assert (change.matched, change.changed, change.failed, change.errors) == (3, 3, 0, [])
        assert [(await sb.info()).state for sb in mine] == [State.PAUSED] * 3
        assert (await theirs.info()).state is State.RUNNING
        assert (await fleet.pause(task=task)).unchanged == 3

        change = await fleet.resume(task=task)
        assert (change.matched, change.changed, change.failed) == (3, 3, 0)
        assert [(await sb.info()).state for sb in mine] == [State.RUNNING] * 3
    finally:
        for sb in [*mine, theirs]:
            await sb.destroy()


async def test_node_reports_whether_criu_can_checkpoint_processes(fleet, platform):
    for _ in range(50):
        info = {n.id: n for n in await fleet.nodes()}.get(platform.node_id)
        if info is not None and info.criu:
            break
        await asyncio.sleep(0.2)
    assert info is not None and info.criu.split(":")[0] in ("on", "off")
    print(f"node {platform.node_id} CRIU: {info.criu}")


async def test_checkpoint_then_restore_keeps_the_files(fleet, tmp_path):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    make_busybox_base(tmp_path / "base", applets=(*APPLETS, "mkdir"))
    (tmp_path / "base" / "workspace" / "old.txt").write_text("from the base layer\n")
    base = "prb-" + secrets.token_hex(3)
    await Layers(fleet.bus).build_dir(base, tmp_path / "base")
    sb = await fleet.create(memory_mb=64, layers=[base], labels={"task": "ckpt"})
    restored = None
    try:
        await sb.write_file("/workspace/answer.txt", b"42\n")
        assert (await sb.exec(["sh", "-c", "mkdir -p /workspace/d && echo made > /workspace/d/f && rm /workspace/old.txt"])).exit_code == 0
        handle = await sb.checkpoint()
        assert handle.digest.startswith("sha256:") and len(handle.base) == 1 and not handle.processes
        assert (await sb.info()).state is State.RUNNING  # thawed after packing
        assert (await sb.exec(["true"])).exit_code == 0

        restored = await fleet.restore(handle)
        assert restored.id != sb.id
        assert await restored.read_file("/workspace/answer.txt") == b"42\n"
        r = await restored.exec(["sh", "-c", "cat /workspace/d/f; test -e /workspace/old.txt || echo gone"])
        assert (r.exit_code, r.stdout) == (0, b"made\ngone\n")  # a deletion survives as a whiteout
        assert (await restored.info()).spec.labels == {"task": "ckpt"}
    finally:
        await sb.destroy()
        if restored is not None:
            await restored.destroy()


async def test_restore_onto_a_named_node_runs_there_and_an_unknown_node_is_not_found(fleet, platform, busybox_layer):
    sb = await fleet.create(memory_mb=64, layers=[busybox_layer])
    restored = None
    try:
        await sb.write_file("/workspace/where.txt", b"before the move\n")
        handle = await sb.checkpoint()
        restored = await fleet.restore(handle, node=platform.node_id)
        assert restored.node == (await restored.info()).node == platform.node_id
        assert await restored.read_file("/workspace/where.txt") == b"before the move\n"
        with pytest.raises(errors.NotFound, match="'no-such-node' is not registered"):
            await fleet.restore(handle, node="no-such-node")
        with pytest.raises(errors.InvalidRequest):
            await fleet.restore(handle, node="../etc")
        assert [r.id for r in await fleet.list() if handle.digest in r.spec.layers] == [restored.id]  # the refused made none
    finally:
        await sb.destroy()
        if restored is not None:
            await restored.destroy()


async def test_checkpoint_of_a_sandbox_without_layers_is_refused(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        with pytest.raises(errors.InvalidRequest, match="no layers"):
            await sb.checkpoint()
        assert (await sb.info()).state is State.RUNNING
    finally:
        await sb.destroy()


async def test_cli_pauses_a_task_and_migrates_a_sandbox_through_a_checkpoint_handle(fleet, platform, busybox_layer,
                                                                                     tmp_path):
    task = "cli-" + secrets.token_hex(3)
    sb = await fleet.create(memory_mb=64, layers=[busybox_layer], labels={"task": task})
    restored_id = ""
    try:
        out = (await asyncio.to_thread(platform.cli, "pause", "--task", task)).stdout.decode()
        assert f"task {task}: matched 1, paused 1" in out
        assert (await sb.info()).state is State.PAUSED
        await asyncio.to_thread(platform.cli, "resume", sb.id)
        assert (await sb.info()).state is State.RUNNING
        hinted = (await asyncio.to_thread(platform.cli, "hint", sb.id, "idle")).stdout.decode()
        assert hinted.split("\t")[1] == "idle"

        await sb.write_file("/workspace/notes.txt", b"step 7\n")
        handle = tmp_path / "ckpt.json"
        await asyncio.to_thread(platform.cli, "checkpoint", sb.id, "--out", str(handle), timeout=300)
        restored_id, _ = (await asyncio.to_thread(platform.cli, "restore", str(handle), timeout=180)).stdout.decode().split()
        assert await (await fleet.sandbox(restored_id)).read_file("/workspace/notes.txt") == b"step 7\n"
        refused = await asyncio.to_thread(platform.cli, "pause", check=False)
        assert refused.returncode == 2 and b"give sandbox ids or --task" in refused.stderr
    finally:
        await sb.destroy()
        if restored_id:
            await (await fleet.sandbox(restored_id)).destroy()


async def test_a_container_sandbox_pauses_and_resumes(fleet, busybox_layer):
    require(shutil.which("crun") is not None, "crun is installed")
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[busybox_layer])
    try:
        await ticking(sb)
        record = await sb.pause()
        assert read(f"{cgroup_dir(record.init_pid, '')}/cgroup.freeze").strip() == "1"
        before = await ticks(sb)
        await asyncio.sleep(0.5)
        assert await ticks(sb) == before
        await sb.resume()
        await asyncio.sleep(0.5)
        assert await ticks(sb) > before
    finally:
        await sb.destroy()

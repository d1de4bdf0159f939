"""A node that placement gave up as lost, and that then comes back, tears down what it still ran."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from unittest import mock

import pytest

import sandfleet
from sandfleet import errors
from linuxnode.process import InitProcess, is_alive
from sandfleet.layers_client import Layers
from schemas.sandbox import Reason, State
from tests.conftest import NODE_ID, start_platform, stop_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base


@pytest.fixture(scope="module")
def fenced(leak_check, tmp_path_factory):
    # Lost after 4 s without a heartbeat, and a fencing pass every second, so the test is short.
    with mock.patch.dict(os.environ, {"SANDFLEET_NODE_LOST_S": "4", "SANDFLEET_FENCE_S": "1"}):
        p = start_platform(tmp_path_factory.mktemp("fencing"), f"{NODE_ID}-fence")
    yield p
    stop_platform(p)


def _cgroup_dirs(node_id: str, sandbox_id: str) -> list[str]:
    return [d for h in os.listdir("/sys/fs/cgroup")
            for d in [f"/sys/fs/cgroup/{h}/sandfleet/{node_id}/{sandbox_id}"] if os.path.isdir(d)]


async def test_a_node_back_from_lost_tears_down_the_sandboxes_placement_failed(fenced):
    async with sandfleet.connect(fenced.url) as fleet:
        sb = await fleet.create(memory_mb=64, host_view=True)
        record = await fleet.get(sb.id)
        init = InitProcess(record.init_pid, record.init_start_time)
        assert _cgroup_dirs(fenced.node_id, sb.id)
        launcher = fenced.service_pid("launcher")
        os.kill(launcher, signal.SIGSTOP)  # hung: no heartbeats, but everything it started still runs
        try:
            deadline = time.monotonic() + 60
            while (record := await fleet.get(sb.id)).state is not State.FAILED:
                assert time.monotonic() < deadline, f"placement never gave the node up: {record.state}"
                await asyncio.sleep(0.5)
            assert record.reason is Reason.NODE_LOST
            assert is_alive(init)  # what fencing is for: a failed sandbox still running on its node
        finally:
            os.kill(launcher, signal.SIGCONT)

        deadline = time.monotonic() + 30
        while is_alive(init) or _cgroup_dirs(fenced.node_id, sb.id):
            assert time.monotonic() < deadline, "the node kept running a sandbox placement had failed"
            await asyncio.sleep(0.2)
        record = await fleet.get(sb.id)  # the trainer was told `failed`, and the record says so still
        assert record.state is State.FAILED and record.reason is Reason.NODE_LOST
        # The node itself is back in service.
        again = await fleet.create(memory_mb=64, host_view=True)
        assert (await again.exec(["true"])).exit_code == 0
        await again.destroy()


@pytest.fixture(scope="module")
def fenced_pair(leak_check, tmp_path_factory):
    # Two nodes: placement needs another to restore a lost one's sandboxes on.
    env = {"SANDFLEET_NODE_LOST_S": "4", "SANDFLEET_FENCE_S": "1", "SANDFLEET_PLACEMENT_MIN_SHARE": "1",
           "SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101"}  # this machine is shared
    p = start_platform(tmp_path_factory.mktemp("fencing-pair"), f"{NODE_ID}-fp", extra=("--nodes", "2"), env=env)
    yield p
    stop_platform(p)


async def test_a_lost_nodes_checkpointed_sandbox_is_restored_on_another_node(fenced_pair, tmp_path):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    make_busybox_base(tmp_path / "base")
    base = "fpb-" + secrets.token_hex(3)
    async with sandfleet.connect(fenced_pair.url) as fleet:
        await Layers(fleet.bus).build_dir(base, tmp_path / "base")
        boxes = await fleet.create_many(4, memory_mb=64, layers=[base])
        sb = boxes[0]
        plain = next(b for b in boxes[1:] if b.node == sb.node)  # no checkpoint: only failed
        await sb.write_file("/workspace/answer.txt", b"42\n")
        await sb.checkpoint()
        await sb.write_file("/workspace/later.txt", b"after the checkpoint\n")
        launcher = fenced_pair.service_pid(f"launcher@{sb.node}")
        os.kill(launcher, signal.SIGSTOP)  # the node is lost to placement
        try:
            deadline = time.monotonic() + 90
            while (record := await fleet.get(sb.id)).state is not State.FAILED:
                assert time.monotonic() < deadline, f"placement never gave the node up: {record.state}"
                await asyncio.sleep(0.5)
            assert record.reason is Reason.NODE_LOST and "restored from its checkpoint as " in record.detail, record
            restored = await fleet.sandbox(record.detail.split(" as ")[1].split()[0])
            info = await restored.info()
            assert info.state is State.RUNNING and info.node != sb.node and info.restored_from == sb.id
            assert await restored.read_file("/workspace/answer.txt") == b"42\n"
            with pytest.raises(errors.NotFound):  # written after the checkpoint: lost with the node
                await restored.read_file("/workspace/later.txt")
            lost = await fleet.get(plain.id)
            assert lost.state is State.FAILED and lost.reason is Reason.NODE_LOST and "restored" not in lost.detail
        finally:
            os.kill(launcher, signal.SIGCONT)
        await restored.destroy()
        for b in boxes:
            if b.node != sb.node:
                await b.destroy()

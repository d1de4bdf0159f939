"""Process sandboxes on composed layers, against the real platform: real EROFS images in the
Object Store, real overlays from the node's layer-cache, real sandboxes on them.

Three small layers are built from busybox-static (base, tools over it, a task workspace);
a sandbox on all three sees the top layer's files over the lower ones, its writes stay in
its own upper dir, a launcher crash keeps the roots of live sandboxes and gives back the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers
from schemas.sandbox import Reason, State
from linuxnode import netns, roots_ns
from tests.conftest import NODE_ID
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_layer_sources

LAYERS = ["lsb-base", "lsb-tools", "lsb-task"]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def overlay_of(sandbox_id: str) -> list[str]:
    """The sandbox's overlay in the session platform's roots namespace (linuxnode.roots_ns)."""
    text = roots_ns.read_mountinfo(NODE_ID) or ""
    return [line for line in text.splitlines() if " - overlay " in line and f"/sandboxes/{sandbox_id}/rootfs " in line]


@pytest.fixture(scope="module")
async def layers(fleet, platform, tmp_path_factory):
    require(os.geteuid() == 0, "mounting needs root")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    src = make_layer_sources(tmp_path_factory.mktemp("layer-src"))
    client = Layers(fleet.bus)
    for name, path in zip(LAYERS, ("base", "tools", "task")):
        await client.build_dir(name, src / path, on="lsb-base" if name == "lsb-tools" else None)
    return client


async def test_a_process_sandbox_on_three_layers_sees_their_files(fleet, layers, platform):
    sb = await fleet.create(memory_mb=128, layers=LAYERS)
    try:
        r = await sb.exec(["cat", "/etc/hostname", "/etc/base-only", "/etc/tools", "/workspace/task.txt"])
        assert (r.exit_code, r.stdout) == (0, b"tools\nfrom base\na tool\nsolve it\n")
        assert await sb.read_file("/workspace/task.txt") == b"solve it\n"
        top = (await sb.exec(["ls", "/"])).stdout.decode().split()
        assert {"bin", "etc", "workspace", "dev", "proc", "tmp"} <= set(top)
        assert "lib" not in top and (await sb.exec(["test", "-e", "/usr/lib"])).exit_code != 0  # no host system
        assert (await sb.exec(["cat", "/proc/1/cmdline"])).stdout == b"catatonit\0-P\0"
        listing = await layers.cache(platform.node_id)
        mine = [r for r in listing.rootfs if r.sandbox_id == sb.id]
        assert len(mine) == 1 and mine[0].layers == [(await layers.get(n)).digest for n in LAYERS]
        assert overlay_of(sb.id)
    finally:
        await sb.destroy()
    assert sb.id not in {r.sandbox_id for r in (await layers.cache(platform.node_id)).rootfs}
    assert not overlay_of(sb.id)


async def test_writes_stay_in_their_sandbox_and_never_change_a_layer(fleet, layers, platform):
    a, b = await asyncio.gather(*(fleet.create(memory_mb=128, layers=LAYERS) for _ in range(2)))
    try:
        base_digest = (await layers.get("lsb-base")).digest.removeprefix("sha256:")
        base_mount = platform.roots_path(platform.data_dir / "layer-cache" / "mnt" / base_digest)
        original = sha256(base_mount / "bin" / "busybox")
        # The sandbox's own processes may not touch system content (Landlock); the file API may.
        assert (await a.exec(["rm", "/bin/sh"])).exit_code != 0
        await a.write_file("/bin/evil", b"#!/bin/busybox sh\necho evil\n", mode=0o755)
        await a.write_file("/workspace/task.txt", b"changed\n")
        await a.write_file("/new", b"x")
        assert (await a.exec(["/bin/evil"])).stdout == b"evil\n"

        r = await b.exec(["sh", "-c", "echo fine; cat /workspace/task.txt; test -e /new -o -e /bin/evil || echo no"])
        assert r.stdout == b"fine\nsolve it\nno\n"
        assert os.readlink(base_mount / "bin" / "sh") == "busybox"  # the layer is untouched
        assert sha256(base_mount / "bin" / "busybox") == original
        roots = {r.sandbox_id: r for r in (await layers.cache(platform.node_id)).rootfs}
        upper_a, upper_b = platform.roots_path(roots[a.id].upper), platform.roots_path(roots[b.id].upper)
        assert (upper_a / "bin" / "evil").read_bytes() == b"#!/bin/busybox sh\necho evil\n"
        assert not (upper_b / "bin" / "evil").exists() and not (upper_b / "new").exists()
    finally:
        await asyncio.gather(a.destroy(), b.destroy())


async def test_a_launch_on_an_unknown_layer_fails_and_leaves_nothing(fleet, layers, platform):
    with pytest.raises(errors.NotFound, match="no-such-layer"):
        await fleet.create(memory_mb=64, layers=["lsb-base", "no-such-layer"])
    failed = [r for r in await fleet.list(include_ended=True) if "no-such-layer" in r.spec.layers]
    assert failed and all(r.state is State.FAILED and r.reason is Reason.LAUNCH_FAILED for r in failed)
    for record in failed:
        assert not netns.exists(platform.node_id, record.id)
        assert not os.path.exists(f"/sys/fs/cgroup/memory/sandfleet/{platform.node_id}/{record.id}")
        assert not overlay_of(record.id)
    assert not {r.id for r in failed} & {r.sandbox_id for r in (await layers.cache(platform.node_id)).rootfs}


async def test_a_restarted_launcher_keeps_live_roots_and_gives_back_the_rest(fleet, layers, platform):
    keep = await fleet.create(memory_mb=64, layers=LAYERS)
    lose = await fleet.create(memory_mb=64, layers=["lsb-base"])
    await keep.write_file("/workspace/state", b"before")
    # A root nobody's sandbox owns, as a launch interrupted between compose and record would leave.
    await layers.compose(platform.node_id, "sb-orphanroot", ["lsb-base"])
    lose_init = (await fleet.get(lose.id)).init_pid
    old = platform.service_pid("launcher")
    os.kill(old, signal.SIGKILL)
    os.kill(lose_init, signal.SIGKILL)  # dies while nobody watches
    await platform.restarted(fleet, "launcher", old)

    assert (await keep.exec(["cat", "/workspace/state", "/etc/tools"])).stdout == b"beforea tool\n"
    record = await fleet.get(lose.id)
    assert record.state is State.FAILED and record.reason is Reason.LOST_ON_RESTART
    roots = {r.sandbox_id for r in (await layers.cache(platform.node_id)).rootfs}
    assert keep.id in roots and lose.id not in roots and "sb-orphanroot" not in roots
    assert not overlay_of(lose.id) and not overlay_of("sb-orphanroot")
    await keep.destroy()
    assert not overlay_of(keep.id)

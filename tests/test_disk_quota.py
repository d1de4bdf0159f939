"""Per-sandbox disk quota (`disk_mb`) against the real platform: the writable upper dir of a
layered root is a tmpfs of that size, so a write beyond it fails with ENOSPC inside that
sandbox only; the host view's /workspace has the same limit. The limit's mount goes with the
sandbox, and survives (re-adopted) a layer-cache restart while the sandbox runs.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from sandfleet.layers_client import Layers
from linuxnode import roots_ns
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

BASE = "dq-base"


def upper_mount(platform, sandbox_id: str) -> list[str]:
    """The mountinfo lines of the sandbox's upper-dir tmpfs."""
    point = f"{platform.data_dir}/layer-cache/sandboxes/{sandbox_id} "
    text = roots_ns.read_mountinfo(platform.node_id) or ""  # where roots are composed (linuxnode.roots_ns)
    return [line for line in text.splitlines() if f" {point}" in line and " - tmpfs " in line]


@pytest.fixture(scope="module")
async def base(fleet, platform, tmp_path_factory):
    require(os.geteuid() == 0, "mounting needs root")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("dq-src")
    make_busybox_base(src / "base")
    await Layers(fleet.bus).build_dir(BASE, src / "base")
    return BASE


async def _write_mb(sb, path: str, mb: int):
    return await sb.exec(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}"], timeout_s=60)


async def test_a_write_beyond_disk_mb_fails_with_enospc_in_that_sandbox_only(fleet, platform, base):
    small, roomy = await asyncio.gather(
        fleet.create(memory_mb=256, disk_mb=16, layers=[base]),
        fleet.create(memory_mb=256, layers=[base]),  # default disk_mb: 1024
    )
    try:
        too_big = await _write_mb(small, "/workspace/big", 32)
        assert too_big.exit_code != 0 and b"No space left on device" in too_big.stderr
        assert (await small.exec(["rm", "/workspace/big"])).exit_code == 0
        assert (await _write_mb(small, "/workspace/fits", 8)).exit_code == 0  # space comes back
        assert (await _write_mb(roomy, "/workspace/big", 32)).exit_code == 0  # the neighbour is not limited by it
        (line,) = upper_mount(platform, small.id)
        assert "size=16384k" in line
        assert "size=1048576k" in upper_mount(platform, roomy.id)[0]
    finally:
        await asyncio.gather(small.destroy(), roomy.destroy())
    assert not upper_mount(platform, small.id) and not upper_mount(platform, roomy.id)


async def test_the_host_view_workspace_has_the_same_limit(fleet):
    sb = await fleet.create(memory_mb=256, disk_mb=16, host_view=True)
    try:
        r = await sb.exec(["dd", "if=/dev/zero", "of=/workspace/big", "bs=1M", "count=32"], timeout_s=60)
        assert r.exit_code != 0 and b"No space left on device" in r.stderr
    finally:
        await sb.destroy()


async def test_a_restarted_layer_cache_keeps_the_limit_of_a_running_sandbox(fleet, platform, base):
    sb = await fleet.create(memory_mb=256, disk_mb=16, layers=[base])
    try:
        assert (await _write_mb(sb, "/workspace/before", 4)).exit_code == 0
        old = platform.service_pid("layer-cache")
        os.kill(old, signal.SIGKILL)
        await platform.restarted(fleet, "layer-cache", old)
        assert len(upper_mount(platform, sb.id)) == 1  # re-adopted, not unmounted under the sandbox
        assert await sb.read_file("/workspace/before") == b"\0" * (4 << 20)
        too_big = await _write_mb(sb, "/workspace/big", 32)
        assert too_big.exit_code != 0 and b"No space left on device" in too_big.stderr
        listing = await Layers(fleet.bus).cache(platform.node_id)
        assert sb.id in {r.sandbox_id for r in listing.rootfs}
    finally:
        await sb.destroy()
    assert not upper_mount(platform, sb.id)

"""The host's mount table stays flat however many sandboxes run: roots are composed in the
node's roots namespace (linuxnode.roots_ns), process inits and crun take a detached clone of
theirs, and nothing of a root is ever mounted in the host's table; each sandbox's network
namespace name is bound in the node's holder (linuxnode.netns). Proven against a platform of
its own: N sandboxes of both namespace levels really running (each answers an exec over its
own root), the host's table holding no mount of the platform's but the holder's pin, the
holder every name, the roots namespace every root; after a restart of the layer-cache, the
launcher and the agent the roots and names are found again there and still serve; after
destroy no name is left, and after `down` nothing in any table, and no pin.
"""

from __future__ import annotations

import asyncio
import os

import pytest

import sandfleet
from linuxnode import netns, roots_ns
from sandfleet.layers_client import Layers
from tests.conftest import NODE_ID, own_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

N = 6  # sandboxes of each level
NODE = f"{NODE_ID}-fm"
QUIET = {"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101"}


def host_mounts_of(plat) -> list[str]:
    """Mount points of the host's table that are the platform's (its data dir, its node's names, pins)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    pins = (roots_ns.pin_path(NODE), netns.holder_pin(NODE))
    return [p for p in points if str(plat.data_dir) in p or f"sf-{NODE}." in p or p in pins]


def roots_mounts_of(plat) -> list[str]:
    text = roots_ns.read_mountinfo(NODE) or ""
    return [line.split()[4] for line in text.splitlines() if str(plat.data_dir) in line.split()[4]]


def runtime_tables(plat) -> dict[str, int]:
    """Sizes of the mount tables every new sandbox namespace is copied from, by `kind:pid`: the
    spawner's (each `process` init unshares from it) and crun's (each container's: the launcher's
    threads in a namespace that is neither the launcher's nor the roots namespace), found by
    the platform's data dir in their environment. By pid: a spawner made later (by another
    service, or again) copied the host as it was then, which others' work on this machine changes."""
    found = {}
    roots = os.stat(roots_ns.pin_path(NODE)).st_ino
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SANDFLEET_DATA_DIR={plat.data_dir}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if any(b"linuxnode.process.spawner" in a for a in argv):
                found[f"spawner:{pid}"] = sum(1 for _ in open(f"/proc/{pid}/mountinfo"))
            elif b"services.launcher" in argv:
                own = os.stat(f"/proc/{pid}/ns/mnt").st_ino
                for tid in os.listdir(f"/proc/{pid}/task"):
                    if os.stat(f"/proc/{pid}/task/{tid}/ns/mnt").st_ino not in (own, roots):
                        found[f"crun:{pid}"] = sum(1 for _ in open(f"/proc/{pid}/task/{tid}/mountinfo"))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def plat(leak_check, tmp_path_factory):
    require(os.geteuid() == 0, "mounting needs root")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    with own_platform(tmp_path_factory.mktemp("flat"), NODE, env=QUIET) as p:
        yield p
    assert roots_ns.open_pinned(NODE) is None, "the roots namespace is still pinned after down"
    assert NODE not in netns.holders() and netns.list_sandboxes(NODE) == [], "netns names left after down"


@pytest.fixture
async def fleet(plat):
    async with sandfleet.connect(plat.url) as f:
        yield f


async def _answers(sb, word: str) -> None:
    r = await sb.exec(["sh", "-c", f"echo {word} > /workspace/w && cat /workspace/w /etc/hostname"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == [word, "flat"]


async def _make(fleet, layer: str) -> list:
    # Each with a disk limit, so its upper dir is a tmpfs of its own: three mounts a sandbox before.
    made = []
    for _ in range(N):
        for level in ("process", "container"):
            made.append(await fleet.create(isolation=level, layers=[layer], memory_mb=64, disk_mb=16))
    return made


async def test_host_table_stays_flat_with_sandboxes_of_both_levels_and_after_restarts(fleet, plat, tmp_path):
    make_busybox_base(tmp_path / "base", hostname="flat")
    layer = "flat-base"
    await Layers(fleet.bus).build_dir(layer, tmp_path / "base")
    require("container" in next(n for n in await fleet.nodes() if n.id == NODE).isolation,
            "the node offers the container level (crun runs here)")
    empty_host = host_mounts_of(plat)
    await (await fleet.create(isolation="container", layers=[layer], memory_mb=64)).destroy()  # crun's pool is up
    copied_from = runtime_tables(plat)
    assert {k.partition(":")[0] for k in copied_from} == {"spawner", "crun"}
    boxes = await _make(fleet, layer)
    try:
        await asyncio.gather(*(_answers(b, f"w{i}") for i, b in enumerate(boxes)))
        now = runtime_tables(plat)  # what each new sandbox namespace copies: constant
        assert {k: now.get(k) for k in copied_from} == copied_from
        host = host_mounts_of(plat)
        # The only mount of the platform's the sandboxes added to the host's table: the pin of the
        # holder of their network namespace names, where every name is (and opens).
        assert sorted(set(host) - set(empty_host)) == [netns.holder_pin(NODE)]
        assert netns.list_sandboxes(NODE) == sorted(b.id for b in boxes)
        assert all(netns.exists(NODE, b.id) for b in boxes)
        inside = roots_mounts_of(plat)
        for b in boxes:
            assert f"{plat.data_dir}/layer-cache/sandboxes/{b.id}/rootfs" in inside
        assert sum(p.endswith(f"/sandboxes/{b.id}") for b in boxes for p in inside) == 2 * N  # the disk limits

        for service in ("layer-cache", "launcher", "agent"):
            old = plat.service_pid(service)
            os.kill(old, 9)
            await plat.restarted(fleet, service, old)
        assert roots_mounts_of(plat) == inside  # the same namespace, found by its pin and re-adopted
        assert netns.list_sandboxes(NODE) == sorted(b.id for b in boxes)  # the agent kept every name
        await asyncio.gather(*(_answers(b, f"again{i}") for i, b in enumerate(boxes)))
        assert sorted(set(host_mounts_of(plat)) - set(empty_host)) == sorted(set(host) - set(empty_host))
    finally:
        await asyncio.gather(*(b.destroy() for b in boxes))
    kept = {netns.holder_pin(NODE)}  # the agent keeps the holder until the node stops (the fixture's check)
    deadline = asyncio.get_running_loop().time() + 30
    while (roots_mounts_of(plat) or set(host_mounts_of(plat)) - set(empty_host) - kept or netns.list_sandboxes(NODE)) \
            and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    # Only the layer's own mount is left in the roots namespace (kept while the image is cached).
    assert [p for p in roots_mounts_of(plat) if "/layer-cache/mnt/" not in p] == []
    assert set(host_mounts_of(plat)) - set(empty_host) <= kept and netns.list_sandboxes(NODE) == []

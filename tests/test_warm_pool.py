"""Warm pools against the real platform: spares built by the node's launcher through the launch
path (real confinement, real overlays, real inits and containers), claimed by creates of their
shape, refilled, cleared, and gone when the node stops.

A spare is told apart from a cold sandbox by what the node agent holds: a spare's confinement
exists before any record names it, so a create that took one gets an id the agent held before
the create was sent. Every pool here has a shape no other test asks for (memory sizes of their
own), so the session's other creates never take one of these spares.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest

import sandfleet
from sandfleet import errors
from sandfleet.layers_client import Layers
from schemas import node as node_schema
from schemas import pools as pools_schema
from schemas.node import ConfinedList, Empty, ExecRequest
from schemas.sandbox import DesktopSpec, SandboxSpec, State
from tests.conftest import NODE_ID, own_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

PROCESS = dict(isolation="process", host_view=True, memory_mb=96, cpu=0.1)
WAIT_S = 90.0  # only so a pool that never fills fails the test instead of hanging it


async def confined(fleet: sandfleet.Fleet, node_id: str) -> set[str]:
    reply = await fleet.bus.request(node_schema.subject(node_id, node_schema.AGENT_LIST), Empty(), ConfinedList,
                                    timeout=30)
    return set(reply.sandbox_ids)


async def recorded(fleet: sandfleet.Fleet) -> set[str]:
    return {r.id for r in await fleet.list()}


async def spares(fleet: sandfleet.Fleet, node_id: str) -> set[str]:
    """Ids the agent holds that no record names: the node's spares (and launches just begun)."""
    return await confined(fleet, node_id) - await recorded(fleet)


async def warm(fleet: sandfleet.Fleet, key: str, node_id: str, n: int) -> None:
    """Until a heartbeat of the node made after this call began shows `n` spares of the pool: an
    older one may still count a spare a create just took (placement then builds the next cold)."""
    since, deadline = time.time(), time.monotonic() + WAIT_S
    while True:
        info = next((i for i in await fleet.nodes() if i.id == node_id), None)
        if info is not None and info.at > since and info.warm.get(key, 0) >= n:
            await asyncio.sleep(0.1)  # placement's view of the nodes follows the same KV watch
            return
        assert time.monotonic() < deadline, f"pool {key} never had {n} spares on {node_id}: {info}"
        await asyncio.sleep(0.2)


async def nothing_of_pools_left(fleet: sandfleet.Fleet, node_id: str) -> None:
    """Once every pool is gone: the agent holds, and the layer-cache roots, only recorded sandboxes."""
    deadline = time.monotonic() + WAIT_S
    while True:
        live = await recorded(fleet)
        extra = await confined(fleet, node_id) - live
        roots = {r.sandbox_id for r in (await Layers(fleet.bus).cache(node_id)).rootfs} - live
        if not extra and not roots:
            return
        assert time.monotonic() < deadline, f"left after the pools went: confinements {extra}, roots {roots}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def process_pool(fleet, platform):
    require(os.geteuid() == 0, "sandboxes need root")
    state = await fleet.set_pool(size=2, **PROCESS)
    yield state.key
    await fleet.clear_pool(**PROCESS)
    await nothing_of_pools_left(fleet, platform.node_id)


@pytest.fixture(scope="module")
async def base(fleet, tmp_path_factory):
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("wp-base") / "base"
    make_busybox_base(src)
    await Layers(fleet.bus).build_dir("wp-base", src)
    return "wp-base"


async def test_a_claim_gives_a_working_sandbox_with_the_requests_id_labels_egress_and_timeout(
        fleet, platform, process_pool):
    await warm(fleet, process_pool, platform.node_id, 2)
    ready = await spares(fleet, platform.node_id)
    sent = time.time()
    sb = await fleet.create(**PROCESS, labels={"task": "wp-claim", "who": "me"}, allow=["192.0.2.1:80"], timeout_s=45)
    try:
        assert sb.id in ready, "the create was built cold, not claimed"
        record = await fleet.get(sb.id)
        assert record.state is State.RUNNING and record.node == platform.node_id
        assert record.spec.labels == {"task": "wp-claim", "who": "me"} and record.spec.allow == ["192.0.2.1:80"]
        assert sent + 45 - 1 <= record.deadline <= time.time() + 45 + 1
        assert record.init_pid and record.started_at >= sent
        r = await sb.exec(["sh", "-c", "echo hi; cat /proc/net/route"])
        assert r.exit_code == 0 and r.stdout.startswith(b"hi\n")
        # The egress rule was applied at claim: the spare had no veth; now a default route leads out.
        routes = [line.split() for line in r.stdout.decode().splitlines()[2:]]
        assert any(f[1] == "00000000" for f in routes), r.stdout
        states = []
        async for event in fleet.events(sb.id, replay=True):
            states.append(event.state)
            if event.state is State.RUNNING:
                break
        assert states == [State.SCHEDULED, State.RUNNING]  # as a create built within the grace
    finally:
        await sb.destroy()


async def test_a_spare_cannot_be_reached_before_it_is_claimed(fleet, platform, process_pool):
    await warm(fleet, process_pool, platform.node_id, 2)
    for spare in await spares(fleet, platform.node_id):
        with pytest.raises(errors.NotFound):
            await fleet.bus.request(node_schema.subject(platform.node_id, node_schema.EXEC),
                                    ExecRequest(sandbox_id=spare, argv=["true"]), node_schema.ExecReply, timeout=30)
        with pytest.raises(errors.NotFound):
            await fleet.sandbox(spare)


async def test_concurrent_creates_never_get_the_same_spare(fleet, platform, process_pool):
    await warm(fleet, process_pool, platform.node_id, 2)
    ready = await spares(fleet, platform.node_id)
    made = await asyncio.gather(*(fleet.create(**PROCESS, labels={"task": "wp-race"}) for _ in range(5)))
    try:
        ids = [sb.id for sb in made]
        assert len(set(ids)) == 5
        assert len(set(ids) & ready) >= 2, (ids, ready)  # both spares went (a refill may be claimed too)
        inits = {(await fleet.get(i)).init_pid for i in ids}
        assert len(inits) == 5  # five sandboxes, not one spare handed out twice under two ids
        for sb in made:
            assert (await sb.exec(["echo", sb.id])).stdout == sb.id.encode() + b"\n"
    finally:
        await asyncio.gather(*(sb.destroy() for sb in made))


async def test_a_batch_takes_the_spares_of_its_shape_and_builds_the_rest_cold(fleet, platform, process_pool):
    await warm(fleet, process_pool, platform.node_id, 2)
    ready = await spares(fleet, platform.node_id)
    made = await fleet.create_many(4, **PROCESS, labels={"task": "wp-batch"})
    try:
        ids = {sb.id for sb in made}
        assert len(ids) == 4 and len(ids & ready) >= 2, (ids, ready)  # both spares, then two built cold
        assert len({(await fleet.get(i)).init_pid for i in ids}) == 4
        for sb in made:
            record = await fleet.get(sb.id)
            assert record.state is State.RUNNING and record.spec.labels == {"task": "wp-batch"}
            assert (await sb.exec(["echo", sb.id])).stdout == sb.id.encode() + b"\n"
    finally:
        await asyncio.gather(*(sb.destroy() for sb in made))


async def test_the_pool_refills_and_a_mismatch_is_built_cold(fleet, platform, process_pool):
    await warm(fleet, process_pool, platform.node_id, 2)
    ready = await spares(fleet, platform.node_id)
    other = await fleet.create(**{**PROCESS, "memory_mb": 97})
    taken = await fleet.create(**PROCESS)
    try:
        assert other.id not in ready and taken.id in ready
        await warm(fleet, process_pool, platform.node_id, 2)  # the one taken is built again
        now = await spares(fleet, platform.node_id)
        assert len(now - ready) >= 1 and taken.id not in now
    finally:
        await asyncio.gather(other.destroy(), taken.destroy())


@pytest.mark.parametrize("isolation", ["process", "container"])
async def test_a_claimed_sandbox_carries_nothing_from_before(fleet, platform, base, isolation):
    require(os.geteuid() == 0, "sandboxes need root")
    if isolation == "container":
        require(shutil.which("crun") is not None, "crun is installed")
        require("container" in (await fleet.nodes())[0].isolation, "the node runs containers")
    shape = dict(isolation=isolation, layers=[base], memory_mb=112, cpu=0.1)
    state = await fleet.set_pool(size=1, **shape)
    try:
        await warm(fleet, state.key, platform.node_id, 1)
        first = await fleet.create(**shape)
        await first.write_file("/workspace/mark", b"from the first")
        assert (await first.exec(["sh", "-c", "echo x > /tmp/mark2 && ls /workspace"])).stdout == b"mark\n"
        await first.destroy()
        await warm(fleet, state.key, platform.node_id, 1)
        ready = await spares(fleet, platform.node_id)
        second = await fleet.create(**shape)
        try:
            assert second.id in ready and second.id != first.id
            r = await second.exec(["sh", "-c", "ls -A /workspace; test -e /tmp/mark2 && echo there; echo end"])
            assert r.stdout == b"end\n", r.stdout  # a fresh writable layer: nothing of the first
        finally:
            await second.destroy()
    finally:
        await fleet.clear_pool(**shape)
        await nothing_of_pools_left(fleet, platform.node_id)


async def test_clearing_a_pool_destroys_its_spares_and_leaves_nothing(fleet, platform):
    require(os.geteuid() == 0, "sandboxes need root")
    shape = {**PROCESS, "memory_mb": 98}
    state = await fleet.set_pool(size=3, **shape)
    await warm(fleet, state.key, platform.node_id, 3)
    assert len(await spares(fleet, platform.node_id)) >= 3
    assert await fleet.clear_pool(**shape) == [state.key]
    assert state.key not in {s.key for s in await fleet.pools()}
    await nothing_of_pools_left(fleet, platform.node_id)
    assert await fleet.clear_pool(**shape) == []  # gone already: nothing cleared


async def test_bad_pool_specs_get_typed_errors(fleet, platform):
    for bad in (dict(labels={"task": "x"}), dict(allow=["192.0.2.1:80"]),
                dict(layers=["wp-base"], desktop=DesktopSpec()), dict(isolation="microvm", layers=["wp-base"]),
                dict(layers=["wp-base"], build=True)):
        with pytest.raises(errors.InvalidRequest):
            await fleet.set_pool(size=1, **bad)
    for size in (-1, pools_schema.MAX_POOL_SIZE + 1):
        with pytest.raises(errors.InvalidRequest):
            await fleet.set_pool(size=size, **PROCESS)
    with pytest.raises(errors.InvalidRequest):
        await fleet.set_pool(size=1, memory_mb=1)
    with pytest.raises(errors.InvalidRequest):
        await fleet.clear_pool(isolation="nope")
    # Past the SDK's checks, the service refuses alike (any NATS client may ask).
    raw = {"spec": {"host_view": True, "labels": {"task": "x"}}, "size": 1}
    with pytest.raises(errors.InvalidRequest):
        await fleet.bus.request(pools_schema.POOL_SET, raw, pools_schema.PoolState)
    with pytest.raises(errors.InvalidRequest):
        await fleet.bus.request(pools_schema.POOL_CLEAR, pools_schema.PoolClearRequest(), pools_schema.PoolClearReply)
    assert not [s for s in await fleet.pools() if s.pool.spec.labels]


def test_pool_keys_are_by_shape_only():
    a = SandboxSpec(host_view=True, memory_mb=96)
    b = SandboxSpec(host_view=True, memory_mb=96, labels={"task": "t"}, allow=["192.0.2.1:80"], timeout_s=5)
    assert pools_schema.pool_key(a) == pools_schema.pool_key(b)
    assert pools_schema.pool_key(a) != pools_schema.pool_key(SandboxSpec(host_view=True, memory_mb=97))
    assert pools_schema.pool_key(SandboxSpec(layers=["x", "y"])) != pools_schema.pool_key(SandboxSpec(layers=["y", "x"]))
    assert pools_schema.shape_of(b) == a


async def test_a_node_stopping_with_spares_leaves_nothing(tmp_path_factory):
    require(os.geteuid() == 0, "sandboxes need root")
    quiet = {"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101"}
    with own_platform(tmp_path_factory.mktemp("warm-stop"), f"{NODE_ID}-wp", env=quiet) as p:
        async with sandfleet.connect(p.url) as fleet:
            state = await fleet.set_pool(size=3, **PROCESS)
            await warm(fleet, state.key, p.node_id, 3)
            sb = await fleet.create(**PROCESS)  # one claimed and live, the rest spares, at shutdown
            assert (await sb.exec(["true"])).exit_code == 0
    # own_platform: `down`, then nothing of the node (cgroups, netns, mounts, processes) is left


async def test_spares_a_crashed_launcher_left_are_given_back_and_built_again(fleet, platform, process_pool):
    await warm(fleet, process_pool, platform.node_id, 2)
    before = await spares(fleet, platform.node_id)
    assert len(before) >= 2
    old = platform.service_pid("launcher")
    os.kill(old, 9)
    await platform.restarted(fleet, "launcher", old)
    deadline = time.monotonic() + WAIT_S
    while (await confined(fleet, platform.node_id)) & before:  # their cgroups, netns and inits: gone
        assert time.monotonic() < deadline, "the spares of the killed launcher were never given back"
        await asyncio.sleep(0.2)
    await warm(fleet, process_pool, platform.node_id, 2)
    assert not (await spares(fleet, platform.node_id)) & before  # new ones, never the old


# -- the logic alone: no bus, no kernel -------------------------------------------------------


def test_placement_offers_a_create_to_the_node_with_most_spares_left():
    from schemas.node import NodeInfo, NodePressure
    from services.placement.policy import NodeView
    from services.placement.pools import warm_order

    now, key = time.time(), "pkey"
    view = NodeView()
    for n, warm_n, levels, mem in (("a", 1, ["process"], 0.0), ("b", 3, ["process"], 0.0),
                                   ("c", 5, ["container"], 0.0), ("d", 9, ["process"], 90.0), ("e", 0, ["process"], 0.0)):
        view.heartbeat(NodeInfo(id=n, isolation=levels, capacity=10, running=0, cpus=2, memory_mb=1024, at=now,
                                warm={key: warm_n}, pressure=NodePressure(memory=mem)))
    view.heartbeat(NodeInfo(id="stale", isolation=["process"], capacity=10, running=0, cpus=2, memory_mb=1024,
                            at=now - 60, warm={key: 9}))
    assert warm_order(view, {}, key, "process", now) == ["b", "a"]  # not: another level, pressured, none, stale
    taken = {("b", key): (view.nodes["b"], 3)}  # three claims sent since b's heartbeat: none left there
    assert warm_order(view, taken, key, "process", now) == ["a"]
    view.heartbeat(NodeInfo(id="b", isolation=["process"], capacity=10, running=0, cpus=2, memory_mb=1024, at=now,
                            warm={key: 2}))
    assert warm_order(view, taken, key, "process", now) == ["b", "a"]  # a new heartbeat counts afresh
    assert warm_order(view, {}, key, "process", now, node="a") == ["a"]


async def test_memory_pressure_destroys_the_spares_and_builds_none():
    from types import SimpleNamespace

    from services.launcher.pool import WarmPools
    from services.launcher.settings import LauncherSettings

    given_back: list[str] = []

    async def discard(live):
        given_back.append(live.id)

    launcher = SimpleNamespace(settings=LauncherSettings(pool_memory_psi=10.0), launching=set(), live={},
                               isolation=["process"], discard=discard)
    psi = [0.0]
    pools = WarmPools(launcher, bus=None, capacity=10, pressure=lambda: psi[0])  # type: ignore[arg-type]
    spec = SandboxSpec(host_view=True, memory_mb=96)
    key = pools_schema.pool_key(spec)
    pools.pools = {key: pools_schema.Pool(spec=spec, size=2)}
    pools.spares = {key: [SimpleNamespace(id=f"sb-{i}", spec=spec, unwatch=lambda: None) for i in range(2)]}
    pools._trim()
    assert len(pools.spares[key]) == 2 and not pools._tasks  # calm: kept
    psi[0] = 12.0
    pools._trim()
    pools._fill()
    await asyncio.gather(*list(pools._tasks))
    assert pools.spares[key] == [] and sorted(given_back) == ["sb-0", "sb-1"] and pools.building == {}
    assert pools.warm() == {} and pools.changed.is_set()


def test_the_cli_sets_lists_and_clears_a_pool(platform):
    shape = ["--host-view", "--memory-mb", "99", "--cpu", "0.1"]
    key = pools_schema.pool_key(SandboxSpec(host_view=True, memory_mb=99, cpu=0.1))
    out = platform.cli("pool", "set", "--size", "1", *shape).stdout.decode()
    assert out.startswith(f"{key}  size 1  process") and "host view" in out
    assert key in platform.cli("pool", "list").stdout.decode()
    assert platform.cli("pool", "clear", *shape).stdout.decode().strip() == f"cleared 1 pool(s): {key}"
    assert key not in platform.cli("pool", "list").stdout.decode()
    bad = platform.cli("pool", "set", "--size", "1", "--isolation", "microvm", "--layers", "x", check=False)
    assert bad.returncode == 2 and b"InvalidRequest" in bad.stderr


async def test_a_tenants_create_takes_a_spare_as_its_own_within_its_quota(fleet, platform, process_pool, tmp_path):
    creds = tmp_path / "wp-carol.creds"
    platform.cli("tenant", "add", "wp-carol", "--data-dir", str(platform.data_dir), "--out", str(creds))
    await fleet.set_quota(tenant="wp-carol", max_concurrent=1)
    await warm(fleet, process_pool, platform.node_id, 2)
    ready = await spares(fleet, platform.node_id)
    async with sandfleet.connect(platform.url, creds=creds) as carol:
        sb = await carol.create(**PROCESS, labels={"tenant": "someone-else"})
        try:
            assert sb.id in ready
            record = await fleet.get(sb.id)
            assert record.tenant == "wp-carol" and record.spec.labels["tenant"] == "wp-carol"  # the server's word
            assert (await sb.exec(["echo", "mine"])).stdout == b"mine\n"
            assert (await fleet.quota(tenant="wp-carol")).active == 1  # a claimed create counts
            with pytest.raises(errors.Capacity, match="quota:"):
                await carol.create(**PROCESS)
            with pytest.raises(errors.Forbidden):  # pools are the operator's
                await carol.bus.request(pools_schema.POOL_SET, {"spec": {"host_view": True}, "size": 1},
                                        pools_schema.PoolState, timeout=2)
        finally:
            await sb.destroy()
    deadline = time.monotonic() + WAIT_S
    while (await fleet.quota(tenant="wp-carol")).active:  # its slot comes back with its end
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    await fleet.set_quota(tenant="wp-carol")


def test_a_build_create_never_takes_an_ordinary_spare():
    """A build sandbox's root and capabilities are made at its launch: a create asking for one
    of a pool's shape is built cold, and no pool can be of build sandboxes."""
    shape = dict(isolation="process", layers=["wp-base"], memory_mb=96)
    assert pools_schema.poolable(SandboxSpec(**shape))
    assert pools_schema.pool_key(SandboxSpec(**shape, build=True)) == pools_schema.pool_key(SandboxSpec(**shape))
    assert not pools_schema.poolable(SandboxSpec(**shape, build=True))
    assert "build" in pools_schema.refusal(SandboxSpec(**shape, build=True))

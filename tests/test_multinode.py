"""Several nodes on one machine, and a clustered bus, each on a platform of its own.

`sandfleet up --nodes 2` runs two complete nodes (own node id, data dir, cgroup root, egress
subnet) against one bus; the tests on it share it (module scope), in file order: a batch spread
over both, a third node joining the bus and leaving, then one node killed. Each ends with no
sandbox left, so none sees another's. `sandfleet up --nats-cluster 3` runs three clustered
nats-servers with every stream and bucket replicated on all three. After each platform is
brought down nothing of it may be left on the machine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import nats
import pytest

import sandfleet
from sandfleet import errors
from schemas import events
from schemas import node as node_schema
from schemas.node import ConfinedList, Empty
from schemas.sandbox import ENDED, Reason, State
from sandfleet.config import DEFAULT_EGRESS_SUBNET
from sandfleet.credentials import connect_options
from sandfleet.supervisor import nats_server_binary, plan_nats, plan_nodes, write_nats_config
from tests.conftest import CLI, NODE_ID, ROOT, Platform, assert_nothing_left, platform_env, stop_platform
from tests.kernel import require
from tests.leaks import Snapshot


def _up(data_dir: Path, node_id: str, *args: str) -> Platform:
    # This machine is shared (parallel test sessions): its CPU pressure says nothing about these nodes.
    # A small batch would go to one node whole (at least 16 a node): spread it to see both at work.
    env = platform_env(None, node_id) | {"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101",
                                         "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}
    out = subprocess.run(
        [*CLI, "up", "--detach", "--port", "0", "--data-dir", str(data_dir), "--node-id", node_id, *args],
        env=env, capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    if out.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((data_dir / "logs").glob("*.log")))
        raise RuntimeError(f"sandfleet up {' '.join(args)} failed: {out.stderr}\n{logs}")
    return Platform(url=out.stdout.strip(), data_dir=data_dir, node_id=node_id, env=env)


async def _confined(fleet: sandfleet.Fleet, node_id: str) -> set[str]:
    """What the node agent holds (cgroups, netns), asked of the node itself."""
    reply = await fleet.bus.request(node_schema.subject(node_id, node_schema.AGENT_LIST), Empty(), ConfinedList,
                                    timeout=30)
    return set(reply.sandbox_ids)


def _default_gateway(route_table: bytes) -> ipaddress.IPv4Address:
    """The default route's gateway from /proc/net/route (hex, little-endian)."""
    for line in route_table.decode().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            return ipaddress.IPv4Address(socket.inet_ntoa(struct.pack("<I", int(fields[2], 16))))
    raise AssertionError(f"no default route in {route_table!r}")


async def _records(fleet: sandfleet.Fleet, batch: str) -> dict:
    return {r.id: r for r in await fleet.list(include_ended=True) if r.spec.labels.get("batch") == batch}


def test_nodes_on_one_host_get_their_own_ids_dirs_and_egress_subnets(tmp_path):
    plan = plan_nodes(tmp_path, 3, "g")
    assert [n.id for n in plan] == ["g-1", "g-2", "g-3"]
    assert len({n.data_dir for n in plan}) == 3 and all(n.data_dir.parent == tmp_path / "nodes" for n in plan)
    subnets = [ipaddress.IPv4Network(n.egress_subnet) for n in plan]
    assert all(a.subnet_of(ipaddress.IPv4Network(DEFAULT_EGRESS_SUBNET)) for a in subnets)
    assert not any(a.overlaps(b) for i, a in enumerate(subnets) for b in subnets[i + 1:])
    (one,) = plan_nodes(tmp_path, 1, None)  # one node: as before, the data dir itself and the agent's default
    assert one.env() == {"SANDFLEET_DATA_DIR": str(tmp_path)}


@pytest.mark.parametrize("conf", sorted((ROOT / "infra" / "nats-cluster").glob("*.conf")), ids=lambda p: p.name)
def test_the_cluster_example_is_a_valid_three_server_config(conf):
    # Checked by nats-server itself beside the accounts and certificates it includes in
    # tests/test_auth_tls.py (test_the_infra_cluster_configs_take_credentials_and_tls).
    text = conf.read_text()
    assert text.count("nats-route://") == 3 and "jetstream" in text


def test_the_loopback_cluster_configs_route_to_all_three(tmp_path):
    servers = plan_nats(0, 3)
    assert len({p for s in servers for p in (s.port, s.cluster_port, s.http_port)}) == 9
    for s in servers:
        conf = write_nats_config(tmp_path, s.port, s, servers)
        text = conf.read_text()
        assert all(f"nats-route://127.0.0.1:{o.cluster_port}" in text for o in servers)
        out = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    before = Snapshot.take()
    base = f"{NODE_ID}m"
    nodes = [f"{base}-1", f"{base}-2"]
    data = tmp_path_factory.mktemp("two-nodes") / "data"
    # A subnet of its own: the session platform (same host) may have its DNS stub up on the default one.
    p = _up(data, base, "--nodes", "2", "--egress-subnet", "10.202.0.0/16")
    try:
        yield p, nodes
    finally:
        stop_platform(p)
        assert_nothing_left(before, data, nodes)


async def test_two_nodes_share_a_batch_and_each_runs_its_share(two_nodes):
    p, nodes = two_nodes
    async with sandfleet.connect(p.url) as fleet:
        assert {n.id for n in await fleet.nodes()} == set(nodes)
        boxes = await fleet.create_many(8, isolation="process", host_view=True, memory_mb=64,
                                        labels={"batch": "spread"})
        by_node = Counter(b.node for b in boxes)
        assert set(by_node) == set(nodes), f"placement did not use both nodes: {by_node}"
        for n in nodes:  # each node's own agent holds exactly the sandboxes placed on it
            assert await _confined(fleet, n) == {b.id for b in boxes if b.node == n}
        results = await asyncio.gather(*(b.exec(["sh", "-c", "echo $((6*7))"]) for b in boxes))
        assert [r.stdout for r in results] == [b"42\n"] * len(boxes)
        for b in boxes:
            await b.destroy()
        # Node-wide resources are the node's own: its data dir, its share of the egress subnet
        # (its veths, /30s, DNS stub address and nft table), all in use on both nodes at once.
        shares = {}
        for n in nodes:
            assert (p.data_dir / "nodes" / n / "layer-cache").is_dir()
            network = (await fleet.security(n)).mechanisms["egress-network"]
            require(network.startswith("on:"), f"sandbox egress is off on this machine: {network}")
            shares[n] = ipaddress.IPv4Network(re.search(r"subnet (\S+),", network).group(1))
        assert not shares[nodes[0]].overlaps(shares[nodes[1]])
        egress = await fleet.create_many(4, isolation="process", host_view=True, memory_mb=64,
                                         allow=["192.0.2.1:80"], labels={"batch": "egress"})
        assert {b.node for b in egress} == set(nodes)
        for b in egress:
            gateway = _default_gateway((await b.exec(["cat", "/proc/net/route"])).stdout)
            assert gateway in shares[b.node], (b.node, gateway)
        for b in egress:
            await b.destroy()
        for n in nodes:
            assert await _confined(fleet, n) == set()


async def test_a_node_joins_a_running_bus(two_nodes, tmp_path):
    """`sandfleet node --nats URL`: how a node on another machine joins (here: the same machine,
    so its own data dir and egress subnet), and leaves again with `down`."""
    p, nodes = two_nodes
    before = Snapshot.take()
    joined = f"{NODE_ID}j2"
    out = subprocess.run(
        [*CLI, "node", "--detach", "--nats", p.url, "--node-id", joined, "--data-dir", str(tmp_path / "node"),
         "--egress-subnet", "10.201.0.0/16"],
        env=p.env, capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    try:
        async with sandfleet.connect(p.url) as fleet:
            assert {n.id for n in await fleet.nodes()} == {*nodes, joined}
            boxes = await fleet.create_many(6, isolation="process", host_view=True, memory_mb=64,
                                            labels={"batch": "join"})
            on_joined = [b for b in boxes if b.node == joined]
            assert on_joined, f"placement did not use the joined node: {Counter(b.node for b in boxes)}"
            assert await _confined(fleet, joined) == {b.id for b in on_joined}
            assert (await on_joined[0].exec(["echo", "joined"])).stdout == b"joined\n"
            for b in boxes:
                if b.node != joined:
                    await b.destroy()
    finally:
        node_state = json.loads((tmp_path / "node" / "supervisor.json").read_text())
        assert "placement" not in node_state["services"] and node_state["url"] == p.url
        subprocess.run([*CLI, "down", "--data-dir", str(tmp_path / "node")], env=p.env, timeout=150, check=True,
                       cwd=ROOT)
        try:
            os.waitpid(node_state["pid"], 0)
        except ChildProcessError:
            pass
    async with sandfleet.connect(p.url) as fleet:  # the node went down cleanly: its sandboxes ended
        records = await _records(fleet, "join")
        assert all(r.state in ENDED for r in records.values())
        assert {n.id for n in await fleet.nodes()} == set(nodes)
        for n in nodes:
            assert await _confined(fleet, n) == set()
    assert_nothing_left(before, tmp_path / "node", [joined])


async def test_a_killed_node_does_not_disturb_the_other(two_nodes):
    p, (lost, other) = two_nodes
    async with sandfleet.connect(p.url) as fleet:
        boxes = await fleet.create_many(6, isolation="process", host_view=True, memory_mb=64,
                                        labels={"batch": "kill"})
        survivors = [b for b in boxes if b.node == other]
        assert survivors and len(survivors) < len(boxes)
        before = {b.id: await b.info() for b in survivors}
        state = p.state()
        victims = {name: pid for name, pid in state["services"].items() if name.endswith(f"@{lost}")}
        assert {"agent", "launcher", "layer-cache"} <= {name.split("@")[0] for name in victims}
        for pid in victims.values():  # the whole node at once, no chance to clean up
            os.kill(pid, signal.SIGKILL)
        # While it is down, the other node serves: its sandboxes run, and it takes new ones.
        for b in survivors:
            assert (await b.exec(["echo", "still here"])).stdout == b"still here\n"
        try:  # until its heartbeat expires placement may still pick the lost node: then the create says so
            extra = await fleet.create(isolation="process", host_view=True, memory_mb=64, labels={"batch": "kill"})
        except errors.ServiceFailure as exc:
            assert lost in exc.message, exc.message
        else:
            assert extra.node == other and (await extra.exec(["true"])).exit_code == 0
        deadline = time.monotonic() + 60  # the supervisor restarts the lost node's services
        while time.monotonic() < deadline:
            if all(p.state()["services"][n] not in (0, victims[n]) for n in victims) and await _answers(fleet, lost):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"node {lost} did not come back")
        # Nothing of the other node's sandboxes changed: no event, no state change.
        for b in survivors:
            assert await b.info() == before[b.id]
        # The lost node's sandboxes were either taken back or ended with a reason: none is left unknown.
        for r in (await _records(fleet, "kill")).values():
            if r.node == lost:
                assert r.state in (State.RUNNING, State.FAILED), r
        for r in (await _records(fleet, "kill")).values():
            if r.state is State.RUNNING:
                await (await fleet.sandbox(r.id)).destroy()
        for n in (lost, other):
            assert await _confined(fleet, n) == set()


async def _answers(fleet: sandfleet.Fleet, node_id: str) -> bool:
    """Do the node's agent and launcher answer (the launcher: 'no such sandbox')?"""
    try:
        await _confined(fleet, node_id)
        await fleet.bus.request(node_schema.subject(node_id, node_schema.EXEC),
                                node_schema.ExecRequest(sandbox_id="sb-none", argv=["true"]), node_schema.ExecReply,
                                timeout=2)
    except errors.NotFound:
        return True
    except errors.SandfleetError:
        return False
    return True


# -- a clustered bus ----------------------------------------------------------------------------


def _jsz(state: dict, server: str) -> dict:
    port = next(s["http_port"] for s in state["nats"] if s["name"] == server)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/jsz", timeout=2) as resp:
        return json.load(resp)


def _meta_leader(state: dict) -> str:
    for s in state["nats"]:
        try:
            return _jsz(state, s["name"])["meta_cluster"]["leader"]
        except (OSError, KeyError):
            continue
    raise AssertionError("no nats-server reports a JetStream meta leader")


async def _lead_on(url: str, stream: str, server: str) -> str:
    """Ask `stream`'s leader to step down in favour of `server`; returns the leader after."""
    nc = await nats.connect(url.split(","), **connect_options(url))
    try:
        js = nc.jetstream()
        for attempt in range(40):
            leader = (await js.stream_info(stream)).cluster.leader
            if leader == server:
                return leader
            if attempt % 4 == 0:  # a step-down, then a second to elect the new leader
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                 json.dumps({"placement": {"preferred": server}}).encode(), timeout=5)
            await asyncio.sleep(0.25)
        return (await js.stream_info(stream)).cluster.leader
    finally:
        await nc.close()


async def _replicas_current(url: str, stream: str) -> bool:
    nc = await nats.connect(url.split(","), **connect_options(url))
    try:
        info = await nc.jetstream().stream_info(stream)
        return info.config.num_replicas == 3 and len(info.cluster.replicas) == 2 \
            and all(r.current for r in info.cluster.replicas)
    finally:
        await nc.close()


@pytest.fixture
def nats_cluster(tmp_path):
    before = Snapshot.take()
    node_id = f"{NODE_ID}c"
    p = _up(tmp_path / "data", node_id, "--nats-cluster", "3")
    try:
        yield p
    finally:
        stop_platform(p)
        assert_nothing_left(before, tmp_path / "data", [node_id])


async def test_losing_a_nats_server_mid_batch_loses_no_request(nats_cluster):
    p = nats_cluster
    state = p.state()
    assert len(state["nats"]) == 3 and len(p.url.split(",")) == 3
    count = 24
    async with sandfleet.connect(p.url) as fleet:
        victim = _meta_leader(state)
        # The victim also leads the sandbox records, so losing it loses the leader that writes them.
        assert await _lead_on(p.url, "KV_sandboxes", victim) == victim
        first = asyncio.Event()
        started_ids: set[str] = set()

        async def started(msg) -> None:  # type: ignore[no-untyped-def]
            started_ids.add(events.sandbox_id_of(msg.subject))
            first.set()

        sub = await fleet.bus.nc.subscribe(events.sandbox_subject("*", "started"), cb=started)
        batch = asyncio.create_task(fleet.create_many(count, isolation="process", host_view=True, memory_mb=64,
                                                      labels={"batch": "failover"}, request_timeout_s=180))
        await asyncio.wait_for(first.wait(), 120)  # mid-batch: the first sandbox has just started
        os.kill(state["services"][victim], signal.SIGKILL)
        ran_before_the_kill = set(started_ids)
        await sub.unsubscribe()
        try:
            created = {b.id for b in await batch}
            reported_failed = 0
        except errors.SandfleetError as exc:  # an explicit failure is an allowed end, a lost request is not
            created = {b.id for b in getattr(exc, "created", [])}
            reported = re.match(r"(\d+) of \d+ sandboxes failed", exc.message)
            assert reported, exc.message  # the batch had been placed: only its launches can have failed
            reported_failed = int(reported[1])
        # Every sandbox of the batch ends running or failed, none stays in between.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            records = await _records(fleet, "failover")
            if records and all(r.state is State.RUNNING or r.state in ENDED for r in records.values()):
                break
            await asyncio.sleep(0.25)
        states = Counter(r.state for r in records.values())
        failed = {i: r for i, r in records.items() if r.state is State.FAILED}
        why = Counter(f"{r.reason.value}: {r.detail[:80]}" for r in failed.values())
        print(f"killed {victim} (meta and KV_sandboxes leader) mid-batch: {len(created)} of {count} created, "
              f"records {dict(Counter(s.value for s in states.elements()))}; failures: {dict(why)}")
        # Placement had answered (a sandbox had started), so every one of the batch has its record.
        assert len(records) == count and set(states) <= {State.RUNNING, State.FAILED}, states
        running = {i for i, r in records.items() if r.state is State.RUNNING}
        # What had started before the kill still runs; the SDK's account is the records' own.
        assert ran_before_the_kill and ran_before_the_kill <= running, (ran_before_the_kill, running)
        assert created == running and reported_failed == len(failed) == count - len(running)
        # A sandbox the kill made fail failed to launch (its node's bus connection was on the lost server).
        assert all(r.reason is Reason.LAUNCH_FAILED and r.detail for r in failed.values()), why
        # The records agree with the node: it holds exactly the running ones, and each answers.
        assert await _confined(fleet, p.node_id) == running
        for sandbox_id in running:
            assert (await (await fleet.sandbox(sandbox_id)).exec(["true"])).exit_code == 0
        # The killed server came back (supervised) and caught up: all three replicas current.
        deadline = time.monotonic() + 60
        while not await _replicas_current(p.url, "KV_sandboxes") and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        assert await _replicas_current(p.url, "KV_sandboxes")
        for sandbox_id in running:
            await (await fleet.sandbox(sandbox_id)).destroy()
        assert await _confined(fleet, p.node_id) == set()

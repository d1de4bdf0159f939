"""Egress allowlists on the real kernel: bcc programs on real v2 cgroups, sandboxes in real
network namespaces, a fake internet in another, the DNS stub in the router between them.

Each attempt runs as a sandbox process (placed in the cgroup, then the netns, CAP_NET_RAW
dropped as the runtime does) and must fail with EPERM (refused, not left to time out) *and* leave a denial record on the
ring buffer (how soon: loadtest/connect_rate's violation latency).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from agents.node.allow_rules import AllowList, parse_allow
from linuxnode import cgroups
from tests.conftest import EVENT_DEADLINE_S
from tests.kernel import require
from tests.security.netlab import NODE, STUB_ADDRESS, DNS_UPSTREAM, DenialCollector, Lab, NetnsLoop, Sandbox

pytestmark = pytest.mark.kernel
TRACEFS = "/sys/kernel/tracing"
EPERM = errno.EPERM
AF_INET, AF_INET6, AF_PACKET = 2, 10, 17


def _bpf_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable (apt python3-bpfcc; bash infra/bcc-in-venv.sh)"
    from linuxnode.bpf.build import BpfUnavailable, kernel_headers

    try:
        kernel_headers()
    except BpfUnavailable as exc:
        return str(exc)
    if not os.path.isdir("/sys/fs/cgroup/unified") and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "no cgroup v2 hierarchy"
    return None


@dataclass
class World:
    lab: Lab
    policy: object
    denials: DenialCollector
    stub: object
    stub_loop: NetnsLoop
    violations: list

    @property
    def a(self) -> Sandbox:
        return self.lab.sandboxes["sbx-a"]

    @property
    def b(self) -> Sandbox:
        return self.lab.sandboxes["sbx-b"]

    def serve(self, sb: Sandbox, allow: list[str]) -> AllowList:
        """What the agent does for a sandbox's allow=[...]: addresses to the map, names to the stub."""
        from agents.node.dns_stub import DnsClient

        rules = parse_allow(allow)
        self.policy.allow_networks(sb.cgroup_id, rules.networks)
        client = DnsClient(sb.name, sb.cgroup_id, (sb.address, sb.address6), rules.domains)
        self.stub_loop.call(self.stub.register, client)
        return rules

    def denial(self, result: dict, kind: str, address: str | None, port: int, **fields):
        """The record of the probe step's refusal, waited for up to EVENT_DEADLINE_S."""
        found = self.denials.wait_for(
            lambda d: d.pid == result["pid"] and d.kind.value == kind and d.address == address and d.port == port
            and all(getattr(d, k) == v for k, v in fields.items()),
            timeout=EVENT_DEADLINE_S,
        )
        assert found is not None, f"no {kind} denial for {address}:{port} from pid {result['pid']}"
        return found[0]


@pytest.fixture(scope="module")
def world(leak_check):
    missing = _bpf_missing()
    require(missing is None, missing or "")
    from linuxnode.bpf import EgressPolicy
    from agents.node.dns_stub import DnsStub

    tracefs_was_mounted = os.path.ismount(TRACEFS)
    lab = Lab()
    policy = collector = stub_loop = stub = None
    left: dict = {}
    try:
        lab.up()
        policy = EgressPolicy()
        for name in ("sbx-a", "sbx-b"):
            lab.sandboxes[name].cgroup_id = policy.attach(lab.sandboxes[name].cgroups.v2_dir)
        collector = DenialCollector(policy)
        violations: list = []
        stub_loop = NetnsLoop(lab.router)
        stub = DnsStub(policy, DNS_UPSTREAM, violations.append, timeout_s=1.0)
        stub_loop.run(stub.start(STUB_ADDRESS, 53))
        yield World(lab, policy, collector, stub, stub_loop, violations)
        assert policy.lost() == 0
    finally:
        if stub_loop is not None:
            stub_loop.run(stub.close())
            stub_loop.stop()
        if collector is not None:
            collector.stop()
        if policy is not None:
            policy.detach_all()
            policy.close()
            left = {sb.name: _attached(sb.cgroups.v2_dir) for sb in lab.sandboxes.values()}
        lab.down()
        if not tracefs_was_mounted and os.path.ismount(TRACEFS):
            subprocess.run(["umount", TRACEFS], check=False)
    assert all(ids == [] for hooks in left.values() for ids in hooks.values()), f"programs left attached: {left}"


@pytest.fixture(autouse=True)
def fresh_rules(request):
    if "world" not in request.fixturenames:
        yield
        return
    world = request.getfixturevalue("world")
    yield
    for sb in (world.a, world.b):
        world.stub_loop.call(world.stub.unregister, sb.name)
        world.policy.clear(sb.cgroup_id)


def test_allowed_address_and_port_connects_and_anything_else_is_refused_at_once(world):
    world.serve(world.a, ["10.77.100.1:80"])
    ok, other_port, other_host = world.a.run([
        {"op": "tcp", "host": "10.77.100.1", "port": 80},
        {"op": "tcp", "host": "10.77.100.1", "port": 443},
        {"op": "tcp", "host": "10.77.100.2", "port": 80},
    ])
    assert ok["ok"] and ok["data"] == "hello 10.77.100.1:80"
    for refused, host, port in ((other_port, "10.77.100.1", 443), (other_host, "10.77.100.2", 80)):
        assert refused["errno"] == EPERM, refused  # refused, not hanging on a timeout
        d = world.denial(refused, "connect", host, port)
        assert (d.cgroup_id, d.family, d.protocol, d.socket_type) == (world.a.cgroup_id, AF_INET, 6, 1)
        assert d.comm.startswith("python") and d.tid == d.pid


def test_cidr_with_port(world):
    world.serve(world.a, ["10.77.100.0/24:80"])
    r = world.a.run([
        {"op": "tcp", "host": "10.77.100.2", "port": 80},
        {"op": "tcp", "host": "10.77.100.3", "port": 80},
        {"op": "tcp", "host": "10.77.100.1", "port": 443},
    ])
    assert [x["ok"] for x in r] == [True, True, False]
    world.denial(r[2], "connect", "10.77.100.1", 443)


def test_ipv6_and_ipv4_mapped_addresses(world):
    world.serve(world.a, ["10.77.100.1:80", "[fd77:100::1]:80"])
    v6_ok, v6_other, mapped_other, mapped_ok = world.a.run([
        {"op": "tcp", "host": "fd77:100::1", "port": 80},
        {"op": "tcp", "host": "fd77:100::2", "port": 80},
        {"op": "tcp", "host": "::ffff:10.77.100.2", "port": 80},
        {"op": "tcp", "host": "::ffff:10.77.100.1", "port": 80},
    ])
    assert v6_ok["ok"] and v6_ok["data"] == "hello fd77:100::1:80", v6_ok
    assert mapped_ok["ok"], "an allowed IPv4 address is allowed through a dual-stack socket too"
    assert v6_other["errno"] == EPERM and mapped_other["errno"] == EPERM
    assert world.denial(v6_other, "connect", "fd77:100::2", 80).family == AF_INET6
    assert world.denial(mapped_other, "connect", "10.77.100.2", 80).family == AF_INET6


def test_udp_sendto_and_connect(world):
    world.serve(world.a, ["10.77.100.1:5353/udp"])
    ok, other_port, connected, mapped, tcp_same_port = world.a.run([
        {"op": "udp", "host": "10.77.100.1", "port": 5353},
        {"op": "udp", "host": "10.77.100.1", "port": 5354},
        {"op": "udp", "host": "10.77.100.2", "port": 5353, "connect": True},
        {"op": "udp", "host": "::ffff:10.77.100.2", "port": 5353},
        {"op": "tcp", "host": "10.77.100.1", "port": 5353},
    ])
    assert ok["ok"] and ok["data"] == "echo ping"
    assert all(r["errno"] == EPERM for r in (other_port, connected, mapped, tcp_same_port))
    assert world.denial(other_port, "sendmsg", "10.77.100.1", 5354).protocol == 17
    world.denial(connected, "connect", "10.77.100.2", 5353)
    world.denial(mapped, "sendmsg", "10.77.100.2", 5353)
    world.denial(tcp_same_port, "connect", "10.77.100.1", 5353)


def test_tcp_fast_open_cannot_bypass_connect(world):
    world.serve(world.a, [])
    (r,) = world.a.run([{"op": "tfo", "host": "10.77.100.2", "port": 80}])
    assert r["errno"] == EPERM, r
    world.denial(r, "connect", "10.77.100.2", 80)


def test_raw_packet_and_icmp_sockets_are_refused(world):
    require(world.policy.socket_tracepoints, "socket() tracepoints (tracefs) report what the kernel refuses first")
    world.serve(world.a, ["10.77.100.0/24"])
    steps = [
        {"op": "socket", "family": AF_INET, "type": socket.SOCK_RAW, "proto": socket.IPPROTO_ICMP},
        {"op": "socket", "family": AF_INET6, "type": socket.SOCK_RAW, "proto": socket.IPPROTO_ICMPV6},
        {"op": "socket", "family": AF_PACKET, "type": socket.SOCK_RAW, "proto": socket.htons(0x0003)},
        {"op": "socket", "family": AF_INET, "type": socket.SOCK_DGRAM, "proto": socket.IPPROTO_ICMP},
    ]
    dropped = world.a.run(steps)  # as sandboxes run: without CAP_NET_RAW
    kept = world.a.run(steps[:2] + steps[3:], keep_net_raw=True)  # our sock_create program alone
    for r in dropped + kept:
        assert not r["ok"] and r["errno"] in (EPERM, errno.EACCES), r
    for r, step in zip(dropped + kept, steps + steps[:2] + steps[3:]):
        world.denial(r, "socket", None, 0, family=step["family"], socket_type=step["type"])


def test_loopback_of_the_sandbox_netns_stays_allowed(world):
    world.serve(world.a, [])
    r = world.a.run([{"op": "loopback", "host": "127.0.0.1"}, {"op": "loopback", "host": "::1"}])
    assert all(x["ok"] and x["data"] == "x" for x in r), r


def test_host_loopback_is_refused_to_a_sandbox_process_in_the_host_netns(world):
    """A sandbox process that somehow runs in the node's own netns still cannot reach the bus."""
    world.serve(world.a, [])
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (r,) = world.a.run([{"op": "tcp", "host": "127.0.0.1", "port": port}], host_network=True)
    assert r["errno"] == EPERM, r
    world.denial(r, "connect", "127.0.0.1", port)


def test_node_wide_block_wins_over_a_sandbox_allow(world):
    world.serve(world.a, ["10.77.100.0/24"])
    world.policy.block("10.77.100.1", 8080, 6)
    try:
        blocked, other = world.a.run([
            {"op": "tcp", "host": "10.77.100.1", "port": 8080},
            {"op": "tcp", "host": "10.77.100.1", "port": 80},
        ])
    finally:
        world.policy.unblock("10.77.100.1", 8080, 6)
    assert blocked["errno"] == EPERM and other["ok"]
    world.denial(blocked, "connect", "10.77.100.1", 8080)


def test_allowed_names_resolve_through_the_stub_and_then_connect(world):
    world.serve(world.a, ["allowed.test", "api.test:443", "*.mirror.test", "cdn.test:80", "v6.test"])
    world.violations.clear()
    s = STUB_ADDRESS
    before, allowed, api_443, api_80, mirror, cname, v6, over_tcp = world.a.run([
        {"op": "tcp", "host": "10.77.100.1", "port": 80},
        {"op": "resolve_connect", "server": s, "name": "allowed.test", "port": 80},
        {"op": "resolve_connect", "server": s, "name": "api.test", "port": 443},
        {"op": "tcp", "host": "10.77.100.4", "port": 80},
        {"op": "resolve_connect", "server": s, "name": "pkg.mirror.test", "port": 80},
        {"op": "resolve_connect", "server": s, "name": "cdn.test", "port": 80},
        {"op": "resolve_connect", "server": s, "name": "v6.test", "qtype": "AAAA", "port": 80},
        {"op": "resolve", "server": s, "name": "allowed.test", "tcp": True},
    ])
    assert before["errno"] == EPERM, "an address is allowed only once its name was resolved"
    assert allowed["data"] == "hello 10.77.100.1:80"
    assert api_443["data"] == "hello 10.77.100.4:443"
    assert api_80["errno"] == EPERM, "api.test:443 allows port 443 only"
    world.denial(api_80, "connect", "10.77.100.4", 80)
    assert mirror["data"] == "hello 10.77.100.5:80"
    assert cname["data"] == "hello 10.77.100.6:80", "addresses behind a CNAME are learned too"
    assert v6["data"] == "hello fd77:100::6:80"
    assert json.loads(over_tcp["data"]) == {"rcode": "NOERROR", "addresses": ["10.77.100.1"]}
    assert world.violations == []


def test_a_refused_name_is_a_violation_and_the_upstream_cannot_be_asked_directly(world):
    world.serve(world.a, ["*.mirror.test"])
    world.violations.clear()
    evil, apex, direct = world.a.run([
        {"op": "resolve", "server": STUB_ADDRESS, "name": "evil.test"},
        {"op": "resolve", "server": STUB_ADDRESS, "name": "mirror.test"},
        {"op": "resolve", "server": DNS_UPSTREAM[0], "name": "evil.test"},
    ])
    assert json.loads(evil["data"]) == {"rcode": "NXDOMAIN", "addresses": []}
    assert json.loads(apex["data"])["rcode"] == "NXDOMAIN", "*.mirror.test does not cover mirror.test"
    assert direct["errno"] == EPERM
    world.denial(direct, "sendmsg", DNS_UPSTREAM[0], 53)
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while len(world.violations) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(v.sandbox_id, v.cgroup_id, v.name, v.qtype) for v in world.violations] == [
        ("sbx-a", world.a.cgroup_id, "evil.test", "A"), ("sbx-a", world.a.cgroup_id, "mirror.test", "A"),
    ]


def test_a_learned_address_stays_denied_to_a_sandbox_that_may_not_use_it(world):
    world.serve(world.a, ["allowed.test"])
    world.serve(world.b, ["api.test"])
    (a,) = world.a.run([{"op": "resolve_connect", "server": STUB_ADDRESS, "name": "allowed.test", "port": 80}])
    assert a["ok"], a
    world.violations.clear()
    direct, via_stub = world.b.run([
        {"op": "tcp", "host": "10.77.100.1", "port": 80},
        {"op": "resolve", "server": STUB_ADDRESS, "name": "allowed.test"},
    ])
    assert direct["errno"] == EPERM
    assert world.denial(direct, "connect", "10.77.100.1", 80).cgroup_id == world.b.cgroup_id
    assert json.loads(via_stub["data"])["rcode"] == "NXDOMAIN"
    deadline = time.monotonic() + EVENT_DEADLINE_S
    while not world.violations and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(v.sandbox_id, v.name) for v in world.violations] == [("sbx-b", "allowed.test")]


def test_dns_to_any_address_is_redirected_to_the_stub_and_answered_as_from_that_address(world):
    world.serve(world.a, ["allowed.test"])
    world.policy.redirect_dns(world.a.cgroup_id, STUB_ADDRESS, 53)
    world.violations.clear()
    try:
        upstream, loopback, someone = world.a.run([
            {"op": "dns_from", "server": DNS_UPSTREAM[0], "name": "evil.test"},
            {"op": "dns_from", "server": "127.0.0.1", "name": "allowed.test"},
            {"op": "dns_from", "server": "10.77.100.99", "name": "allowed.test"},
        ])
    finally:
        world.policy.stop_redirect_dns(world.a.cgroup_id)
    # The upstream itself would answer evil.test; only the stub refuses it.
    assert json.loads(upstream["data"]) == {"rcode": 3, "addresses": [], "from": [DNS_UPSTREAM[0], 53]}
    assert json.loads(loopback["data"]) == {"rcode": 0, "addresses": ["10.77.100.1"], "from": ["127.0.0.1", 53]}
    assert json.loads(someone["data"])["from"] == ["10.77.100.99", 53]
    assert [(v.sandbox_id, v.name) for v in world.violations] == [("sbx-a", "evil.test")]
    (after,) = world.a.run([{"op": "dns_from", "server": DNS_UPSTREAM[0], "name": "evil.test"}])
    assert after["errno"] == EPERM, "without the redirect the upstream is just a denied address"


def test_a_query_from_an_unknown_source_is_refused(world):
    world.serve(world.a, ["allowed.test"])
    world.stub_loop.call(world.stub.unregister, "sbx-a")  # the map still lets it reach the stub
    (r,) = world.a.run([{"op": "resolve", "server": STUB_ADDRESS, "name": "allowed.test"}])
    assert json.loads(r["data"])["rcode"] == "REFUSED"


def _make_cgroup(lab: Lab, name: str) -> cgroups.SandboxCgroups:
    group = cgroups.SandboxCgroups(lab.layout, NODE, name)
    group.create(cpu=1, memory_mb=256, pids=64)
    return group


def _attached(cgroup_dir: str) -> dict[int, list[int]]:
    from linuxnode.bpf import cgroup_progs
    from linuxnode.bpf.loader import HOOKS

    with cgroup_progs.open_cgroup(cgroup_dir) as fd:
        return {atype: cgroup_progs.attached_ids(fd, atype) for _, _, atype in HOOKS}


def test_detach_leaves_no_program(world):
    group = _make_cgroup(world.lab, "detach")
    try:
        cg = world.policy.attach(group.v2_dir)
        assert world.policy.attach(group.v2_dir) == cg, "attach is idempotent"
        from linuxnode.bpf import cgroup_progs
        from linuxnode.bpf.loader import HOOKS

        expected = {atype: [cgroup_progs.program_id(world.policy.programs()[name])] for name, _, atype in HOOKS}
        assert _attached(group.v2_dir) == expected
        world.policy.allow(cg, "10.77.100.0/24")
        world.policy.detach(cg)
        world.policy.detach(cg)
        assert all(ids == [] for ids in _attached(group.v2_dir).values())
        assert cg not in world.policy.attached() and world.policy.rules(cg) == set()
    finally:
        group.remove()


def test_programs_left_by_a_dead_agent_keep_denying_until_a_new_one_detaches_them(world):
    group = _make_cgroup(world.lab, "stale")
    stale_sb = Sandbox(name="stale", index=9, cgroups=group, netns="")
    code = (
        "import json, os, sys\n"
        "from linuxnode.bpf import EgressPolicy\n"
        "p = EgressPolicy()\n"
        "p.attach(sys.argv[1])\n"
        "print(json.dumps(sorted(p.program_ids)), flush=True)\n"
        "os._exit(0)  # dies without detaching, as a crashed agent does\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code, group.v2_dir], capture_output=True, text=True,
                             timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert out.returncode == 0, out.stderr
        dead_ids = json.loads(out.stdout)
        assert sorted(i for ids in _attached(group.v2_dir).values() for i in ids) == dead_ids
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            step = [{"op": "tcp", "host": "127.0.0.1", "port": port, "read": False}]
            (while_stale,) = stale_sb.run(step, host_network=True)
            assert while_stale["errno"] == EPERM, "the dead agent's programs still protect the sandbox"

            ours_before = {sb.name: _attached(sb.cgroups.v2_dir) for sb in (world.a, world.b)}
            found = world.policy.detach_stale(world.lab.node_v2_dir)
            assert sorted(s.program_id for s in found) == dead_ids
            assert {s.cgroup for s in found} == {group.v2_dir}
            assert {s.program for s in found} == {"sf_connect4", "sf_connect6", "sf_sendmsg4", "sf_sendmsg6",
                                                  "sf_sock_create", "sf_recvmsg4"}
            assert all(ids == [] for ids in _attached(group.v2_dir).values())
            assert {sb.name: _attached(sb.cgroups.v2_dir) for sb in (world.a, world.b)} == ours_before
            assert world.policy.detach_stale(world.lab.node_v2_dir) == []
            (after,) = stale_sb.run(step, host_network=True)
            assert after["ok"], after
    finally:
        group.remove()


def test_sock_create_reports_itself_without_tracepoints_and_the_asyncio_reader(world):
    from linuxnode.bpf import DenialKind, EgressPolicy

    group = _make_cgroup(world.lab, "notrace")
    sb = Sandbox(name="notrace", index=8, cgroups=group, netns="")
    policy = EgressPolicy(socket_tracepoints=False)
    try:
        cg = policy.attach(group.v2_dir)

        async def scenario():
            reader = policy.denials()
            first = asyncio.ensure_future(reader.__anext__())
            await asyncio.sleep(0)
            results = await asyncio.to_thread(sb.run, [
                {"op": "socket", "family": AF_INET, "type": socket.SOCK_RAW, "proto": socket.IPPROTO_ICMP},
                {"op": "tcp", "host": "10.77.100.9", "port": 7},
            ], keep_net_raw=True, host_network=True)
            got = [await asyncio.wait_for(first, 2)]
            got.append(await asyncio.wait_for(reader.__anext__(), 2))
            await reader.aclose()
            return results, got

        results, got = asyncio.run(scenario())
        assert [r["errno"] for r in results] == [EPERM, EPERM]
        assert [(d.kind, d.cgroup_id, d.address, d.port) for d in got] == [
            (DenialKind.SOCKET, cg, None, 0), (DenialKind.CONNECT, cg, "10.77.100.9", 7),
        ]
        assert got[0].socket_type == socket.SOCK_RAW and got[0].protocol == socket.IPPROTO_ICMP
        policy.detach(cg)
    finally:
        policy.close()
        group.remove()

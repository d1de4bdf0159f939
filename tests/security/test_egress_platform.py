"""Sandbox egress end to end on a real platform: `create(allow=[...])` → launcher → node agent
(veth, address, NAT in its own nft table, rules in the BPF map, DNS redirected to its stub)
→ a fake internet in a namespace beside the node. Nothing leaves the machine.

One test per attack: each runs inside a real sandbox, asserts that the attempt fails and
that its violation event arrives on the bus (how soon: loadtest/violation_latency), plus the positive path: an allowed name resolves and an HTTP
fetch works through veth and NAT.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

import sandfleet
from sandfleet import errors
from linuxnode import veth
from sandfleet.config import free_port
from tests.conftest import CLI, EVENT_DEADLINE_S, NODE_ID, ROOT, Platform, stop_platform
from tests.kernel import require
from tests.security.netlab import NodeInternet

pytestmark = pytest.mark.kernel
PROBE = (Path(__file__).parent / "probe.py").read_bytes()
EPERM = errno.EPERM
UPSTREAM = ("10.77.100.53", 53)
ZONE = {
    "allowed.test": {"A": ["10.77.100.1"]},
    "api.test": {"A": ["10.77.100.4"]},
    "mirror.test": {"A": ["10.77.100.5"]},
    "proxy.golang.test": {"A": ["10.77.100.7"]},
    "evil.test": {"A": ["10.77.100.2"]},
}
INTERNET = {
    "http": [("10.77.100.1", 80), ("10.77.100.2", 80), ("10.77.100.4", 80), ("10.77.100.4", 443),
             ("10.77.100.5", 80), ("10.77.100.7", 80)],
    "dns": [UPSTREAM],
    "zone": ZONE,
}
GATEWAY = ("import socket, struct\n"
           "for line in open('/proc/net/route').readlines()[1:]:\n"
           "    f = line.split()\n"
           "    if f[1] == '00000000': print(socket.inet_ntoa(struct.pack('<I', int(f[2], 16))))\n")
EGRESS_NODE = f"{NODE_ID}-egress"
# Its own /16, clear of the session platforms' default 10.200/16 (split per xdist worker) and of
# the fixed ones other modules take (10.201-10.203), which may run beside it in the other worker.
SUBNET = f"10.{204 + os.getpid() % 12}.0.0/16"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable (apt python3-bpfcc; bash infra/bcc-in-venv.sh)"
    if subprocess.run(["which", "nft"], capture_output=True).returncode != 0:
        return "nft is not installed (Debian package nftables)"
    return None


@pytest.fixture(scope="module")
def internet(leak_check):
    missing = _missing()
    require(missing is None, missing or "")
    net = NodeInternet(INTERNET)
    net.up()
    yield net
    net.down()


@pytest.fixture(scope="module")
def egress_platform(internet, tmp_path_factory):
    """A platform of its own: its agent's DNS upstream is the fake internet's resolver."""
    data_dir = tmp_path_factory.mktemp("egress-platform")
    env = {**os.environ, "SANDFLEET_NODE_ID": EGRESS_NODE, "PYTHONPATH": str(ROOT),
           "SANDFLEET_DNS_UPSTREAM": f"{UPSTREAM[0]}:{UPSTREAM[1]}", "SANDFLEET_EGRESS_SUBNET": SUBNET}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    out = subprocess.run([*CLI, "up", "--detach", "--port", str(free_port()), "--data-dir", str(data_dir),
                          "--node-id", EGRESS_NODE], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if out.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((data_dir / "logs").glob("*.log")))
        raise RuntimeError(f"sandfleet up failed: {out.stderr}\n{logs}")
    p = Platform(url=out.stdout.strip(), data_dir=data_dir, node_id=EGRESS_NODE, env=env)
    yield p
    stop_platform(p)


@pytest.fixture(scope="module")
async def efleet(egress_platform):
    async with sandfleet.connect(egress_platform.url) as f:
        yield f


class Watch:
    """Every violation event of one sandbox, with the wall-clock time it reached this test."""

    def __init__(self, fleet, sandbox_id: str) -> None:
        self.seen: list[tuple[object, float]] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._run(fleet, sandbox_id))

    async def _run(self, fleet, sandbox_id: str) -> None:
        async for v in fleet.violations(sandbox_id, replay=True):
            async with self._changed:
                self.seen.append((v, time.time()))
                self._changed.notify_all()

    def matching(self, match) -> list[tuple[object, float]]:
        return [(v, at) for v, at in self.seen if match(v)]

    async def arrival(self, match, count: int = 1):
        """The first `count` matching events, waited for up to EVENT_DEADLINE_S."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: len(self.matching(match)) >= count),
                                       EVENT_DEADLINE_S)
            except asyncio.TimeoutError:
                raise AssertionError(f"{len(self.matching(match))} of {count} violation(s) came; "
                                     f"saw {[v for v, _ in self.seen]}") from None
        found = self.matching(match)[:count]
        return [v for v, _ in found] if count > 1 else found[0][0]

    def close(self) -> None:
        self._task.cancel()


class Box:
    def __init__(self, sb, watch: Watch) -> None:
        self.sb, self.watch, self.id = sb, watch, sb.id

    async def run(self, steps: list[dict]) -> list[dict]:
        r = await self.sb.exec(["python3", "/workspace/probe.py", json.dumps(steps)], timeout_s=60)
        assert r.exit_code == 0, r.stderr.decode()[-2000:]
        return json.loads(r.stdout)


@pytest.fixture
async def box(efleet):
    made: list[Box] = []

    async def make(allow: list[str], **spec) -> Box:
        sb = await efleet.create(allow=allow, memory_mb=128, labels={"task": "egress-redteam"}, **{"host_view": True, **spec})
        watch = Watch(efleet, sb.id)
        made.append(Box(sb, watch))
        await sb.write_file("/workspace/probe.py", PROBE)
        await asyncio.sleep(0.2)  # the consumer subscribes (it replays anything earlier anyway)
        return made[-1]

    yield make
    for b in made:
        b.watch.close()
        try:
            await b.sb.destroy()
        except errors.SandfleetError:
            pass  # the test destroyed it itself


def _refused(result: dict) -> None:
    assert not result["ok"] and result["errno"] == EPERM, result


def _connect_from(box: Box, address: str, port: int):
    return lambda v: v.kind == "network.connect" and v.address == address and v.port == port and v.sandbox_id == box.id


async def test_an_allowed_name_resolves_and_an_http_fetch_works_through_veth_and_nat(box):
    b = await box(["allowed.test:80"])
    resolved, fetched, other_port = await b.run([
        {"op": "getaddrinfo", "name": "allowed.test"},
        {"op": "http", "url": "http://allowed.test/index.html"},
        {"op": "tcp", "host": "10.77.100.1", "port": 443},
    ])
    assert json.loads(resolved["data"]) == ["10.77.100.1"], resolved
    assert fetched["ok"] and fetched["data"] == "hello 10.77.100.1:80 /index.html\n", fetched
    _refused(other_port)
    await b.watch.arrival(_connect_from(b, "10.77.100.1", 443))
    assert [v for v, _ in b.watch.seen if v.kind == "network.dns"] == []


async def test_a_sandbox_without_allow_gets_no_veth_and_no_egress(box, egress_platform):
    b = await box([])
    r = await b.sb.exec(["python3", "-c", "import json, socket; print(json.dumps([n for _, n in socket.if_nameindex()]))"])
    assert json.loads(r.stdout) == ["lo"]
    (tcp,) = await b.run([{"op": "tcp", "host": "10.77.100.1", "port": 80}])
    _refused(tcp)
    await b.watch.arrival(_connect_from(b, "10.77.100.1", 80))
    assert not await asyncio.to_thread(veth.links, f"sandfleet:{EGRESS_NODE}:{b.id}")


async def test_connect_to_an_address_or_port_not_allowed_is_refused_and_reported(box):
    b = await box(["10.77.100.4:443", "allowed.test"])
    ok, other_port, other_host = await b.run([
        {"op": "http", "url": "https://10.77.100.4:443/".replace("https", "http")},
        {"op": "tcp", "host": "10.77.100.4", "port": 80},
        {"op": "tcp", "host": "10.77.100.2", "port": 80},
    ])
    assert ok["ok"] and ok["data"].startswith("hello 10.77.100.4:443"), ok
    for r, host in ((other_port, "10.77.100.4"), (other_host, "10.77.100.2")):
        _refused(r)
        v = await b.watch.arrival(_connect_from(b, host, 80))
        assert v.labels == {"task": "egress-redteam"} and v.command == "python3"


async def test_an_ipv4_mapped_ipv6_address_cannot_bypass_the_allowlist(box):
    b = await box(["allowed.test:80"])
    (r,) = await b.run([{"op": "tcp", "host": "::ffff:10.77.100.2", "port": 80}])
    _refused(r)
    await b.watch.arrival(_connect_from(b, "10.77.100.2", 80))


async def test_a_raw_socket_is_refused_and_reported(box):
    b = await box(["10.77.100.0/24"])
    (r,) = await b.run([{"op": "socket", "family": socket.AF_INET, "type": socket.SOCK_RAW,
                         "proto": socket.IPPROTO_ICMP}])
    assert not r["ok"] and r["errno"] in (EPERM, errno.EACCES), r
    v = await b.watch.arrival(lambda v: v.kind == "network.socket")
    assert "type=3" in v.attempted


async def test_a_dns_lookup_of_a_name_not_allowed_fails_and_is_reported(box):
    b = await box(["allowed.test"])
    refused, allowed = await b.run([
        {"op": "getaddrinfo", "name": "evil.test"},
        {"op": "getaddrinfo", "name": "allowed.test"},
    ])
    assert not refused["ok"] and refused["errno"] == socket.EAI_NONAME, refused
    assert allowed["ok"], allowed
    v = await b.watch.arrival(lambda v: v.kind == "network.dns" and "evil.test" in v.attempted)
    assert v.attempted in ("dns evil.test A", "dns evil.test AAAA") and v.labels == {"task": "egress-redteam"}
    assert not [x for x, _ in b.watch.seen if "allowed.test" in x.attempted]


async def test_an_allowed_names_address_stays_denied_to_a_sandbox_that_may_not_use_it(box):
    a = await box(["allowed.test"])
    b = await box(["api.test"])
    (fetched,) = await a.run([{"op": "http", "url": "http://allowed.test/"}])
    assert fetched["ok"], fetched
    direct, by_name = await b.run([
        {"op": "tcp", "host": "10.77.100.1", "port": 80},
        {"op": "getaddrinfo", "name": "allowed.test"},
    ])
    _refused(direct)
    await b.watch.arrival(_connect_from(b, "10.77.100.1", 80))
    assert not by_name["ok"]
    await b.watch.arrival(lambda v: v.kind == "network.dns" and "allowed.test" in v.attempted)


async def test_the_bus_the_node_and_cloud_metadata_are_blocked_whatever_the_allowlist(box, egress_platform):
    b = await box(["0.0.0.0/0"])
    nats_port = int(egress_platform.url.rsplit(":", 1)[1])
    node_addresses = sorted({str(a) for a in await asyncio.to_thread(veth.host_addresses)
                             if a.version == 4 and not a.is_loopback})
    route = await b.sb.exec(["python3", "-c", GATEWAY])
    gateway = route.stdout.decode().strip()  # the node's end of the sandbox's veth
    targets = [(a, nats_port) for a in node_addresses] + [("169.254.169.254", 80), (gateway, nats_port)]
    results = await b.run([{"op": "tcp", "host": h, "port": p, "read": False} for h, p in targets]
                          + [{"op": "http", "url": "http://10.77.100.2/"}])
    *refused, control = results
    assert control["ok"], "0.0.0.0/0 reaches the internet"
    for r, (host, port) in zip(refused, targets):
        _refused(r)
        await b.watch.arrival(_connect_from(b, host, port))


async def test_a_port_scan_for_a_package_mirror_is_refused_port_by_port(box):
    b = await box(["mirror.test:443"])
    resolved, scan, sweep = await b.run([
        {"op": "getaddrinfo", "name": "mirror.test"},
        {"op": "scan", "host": "10.77.100.5", "first": 3128, "last": 3191},
        {"op": "scan", "host": "10.77.100.6", "first": 80, "last": 80},
    ])
    assert resolved["ok"]
    ports = json.loads(scan["data"])
    assert set(ports.values()) == {EPERM}, ports
    got = await b.watch.arrival(lambda v: v.kind == "network.connect" and v.address == "10.77.100.5", count=64)
    assert sorted(v.port for v in got) == list(range(3128, 3192))
    assert json.loads(sweep["data"]) == {"80": EPERM}


async def test_fetching_code_through_a_module_proxy_that_is_not_allowed_fails_and_is_reported(box):
    b = await box(["allowed.test"])
    by_name, by_address = await b.run([
        {"op": "http", "url": "http://proxy.golang.test/github.com/answers/@v/list"},
        {"op": "http", "url": "http://10.77.100.7/github.com/answers/@v/list"},
    ])
    assert not by_name["ok"] and "Name or service not known" in by_name["data"], by_name
    await b.watch.arrival(lambda v: v.kind == "network.dns" and "proxy.golang.test" in v.attempted)
    assert not by_address["ok"] and "Errno 1" in by_address["data"], by_address
    await b.watch.arrival(_connect_from(b, "10.77.100.7", 80))


async def test_a_bad_allow_rule_is_refused_at_create_with_a_typed_error(efleet):
    with pytest.raises(errors.InvalidRequest, match="http://evil.test"):
        await efleet.create(allow=["http://evil.test"], memory_mb=64)


async def test_destroy_releases_the_veth_and_a_restarted_agent_refills_the_rules(efleet, egress_platform, box):
    b = await box(["allowed.test:80"])
    alias = f"sandfleet:{EGRESS_NODE}:{b.id}"
    assert [link.alias for link in await asyncio.to_thread(veth.links, alias)] == [alias]
    # A veth a crashed agent left for a sandbox that is gone: the next agent removes it.
    ghost = f"sandfleet:{EGRESS_NODE}:sb-ghost"
    links = await asyncio.to_thread(veth.links, f"sandfleet:{EGRESS_NODE}:")
    prefix = links[0].name.rstrip("0123456789")
    subprocess.run(["ip", "link", "add", f"{prefix}999", "type", "veth", "peer", "name", "sfghostpeer"], check=True)
    subprocess.run(["ip", "link", "set", f"{prefix}999", "alias", ghost], check=True)
    old = egress_platform.service_pid("agent")
    os.kill(old, 9)
    await egress_platform.restarted(efleet, "agent", old)
    assert await asyncio.to_thread(veth.links, ghost) == []
    fetched, refused = await b.run([
        {"op": "http", "url": "http://allowed.test/"},
        {"op": "tcp", "host": "10.77.100.2", "port": 80},
    ])
    assert fetched["ok"], fetched
    _refused(refused)
    await b.watch.arrival(_connect_from(b, "10.77.100.2", 80))
    assert [link.alias for link in await asyncio.to_thread(veth.links, alias)] == [alias]
    await b.sb.destroy()
    assert await asyncio.to_thread(veth.links, alias) == []


async def test_the_node_reports_its_egress_network(efleet, box):
    await box(["allowed.test"])  # the network comes up with the first sandbox that has egress
    mechanisms = (await efleet.security(EGRESS_NODE)).mechanisms
    assert mechanisms["egress-ebpf"] == "on"
    assert mechanisms["egress-network"].startswith(f"on: subnet {SUBNET}, DNS stub "), mechanisms
    assert f"-> {UPSTREAM[0]}:{UPSTREAM[1]}" in mechanisms["egress-network"]

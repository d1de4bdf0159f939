"""A small network of namespaces for the egress tests, made and taken down by the tests.

    sbx-a (10.77.1.2, fd77:1::2) ─┐
                                   ├─ router (forwards; DNS stub on 10.77.53.53) ─ internet (10.77.100.0/24, fd77:100::/64)
    sbx-b (10.77.2.2, fd77:2::2) ─┘

Every address lives in a namespace made here; the host's own network is never touched
(the router forwards inside its own namespace). Sandboxes are real sandfleet cgroups (v2
directory = BPF attach point); their processes are placed in the cgroups before they exec.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from linuxnode import cgroups, netns
from linuxnode import syscalls as linux

NODE = f"sectest{os.getpid()}"  # concurrent test runs on one machine never share a name
HERE = Path(__file__).parent
PROBE = HERE / "probe.py"
STUB_ADDRESS = "10.77.53.53"
DNS_UPSTREAM = ("10.77.100.53", 53)

# The fake internet: hosts, services and names.
TCP = [(h, p) for h in ("10.77.100.1",) for p in (80, 443, 8080)] + [
    ("10.77.100.2", 80), ("10.77.100.3", 80), ("10.77.100.4", 80), ("10.77.100.4", 443),
    ("10.77.100.5", 80), ("10.77.100.6", 80), ("fd77:100::1", 80), ("fd77:100::2", 80), ("fd77:100::6", 80),
]
UDP = [("10.77.100.1", 5353), ("10.77.100.1", 5354), ("10.77.100.2", 5353), ("fd77:100::1", 5353)]
ZONE = {
    "allowed.test": {"A": ["10.77.100.1"]},
    "api.test": {"A": ["10.77.100.4"]},
    "b-only.test": {"A": ["10.77.100.3"]},
    "mirror.test": {"A": ["10.77.100.5"]},
    "pkg.mirror.test": {"A": ["10.77.100.5"]},
    "cdn.test": {"CNAME": "edge.cdn-provider.test"},
    "edge.cdn-provider.test": {"A": ["10.77.100.6"]},
    "v6.test": {"AAAA": ["fd77:100::6"]},
    "evil.test": {"A": ["10.77.100.2"]},
}
INTERNET_V4 = sorted({h for h, _ in TCP + UDP if ":" not in h} | {DNS_UPSTREAM[0]})
INTERNET_V6 = sorted({h for h, _ in TCP + UDP if ":" in h})


def inside(ns: str) -> list[str]:
    """The argv prefix that runs a command in the network namespace named `ns` (its name is in
    the node's holder, where `ip -n` and `ip netns exec` would not look)."""
    return ["nsenter", f"--net={netns.resolve(ns)}", "--"]


def ip(*args: str, ns: str | None = None) -> None:
    cmd = [*(inside(ns) if ns else []), "ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


def sysctl(ns: str, *settings: str) -> None:
    subprocess.run([*inside(ns), "sysctl", "-qw", *settings], check=True)


def wait_ipv6_ready(ns: str, timeout: float = 10) -> None:
    """Until no address is tentative (link-local ones go through DAD even with nodad on ours)."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run([*inside(ns), "ip", "-6", "addr", "show", "tentative"],
                             capture_output=True, text=True, check=True).stdout
        if not out.strip():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"IPv6 addresses still tentative in {ns}: {out}")
        time.sleep(0.05)


@dataclass
class Sandbox:
    name: str
    index: int
    cgroups: cgroups.SandboxCgroups
    netns: str
    cgroup_id: int = 0

    @property
    def address(self) -> str:
        return f"10.77.{self.index}.2"

    @property
    def address6(self) -> str:
        return f"fd77:{self.index}::2"

    def command(self, argv: list[str], *, keep_net_raw: bool = False, host_network: bool = False) -> list[str]:
        """argv run as a sandbox process: in the cgroups first, then the netns, CAP_NET_RAW dropped."""
        place = "".join(f'echo $$ > "{f}" || exit 97; ' for f in self.cgroups.procs_files)
        inner = [] if keep_net_raw else ["setpriv", "--bounding-set=-net_raw", "--inh-caps=-net_raw"]
        inner += argv
        if not host_network:
            inner = [*inside(self.netns), *inner]
        return ["sh", "-c", place + 'exec "$@"', "sh", *inner]

    def run(self, steps: list[dict], *, keep_net_raw: bool = False, host_network: bool = False,
            timeout: float = 60) -> list[dict]:
        out = subprocess.run(
            self.command([sys.executable, str(PROBE), json.dumps(steps)], keep_net_raw=keep_net_raw,
                         host_network=host_network),
            capture_output=True, text=True, timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"probe failed ({out.returncode}): {out.stderr[-2000:]}")
        return json.loads(out.stdout)


@dataclass
class Lab:
    layout: cgroups.CgroupLayout = field(default_factory=cgroups.CgroupLayout.detect)
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)
    router: str = ""
    internet: str = ""
    _internet_proc: subprocess.Popen | None = None

    @property
    def node_v2_dir(self) -> str:
        return self.layout.node_dirs(NODE)[-1]

    def up(self) -> None:
        self.router = netns.create(NODE, "router")
        self.internet = netns.create(NODE, "internet")
        r, i = self.router, self.internet
        ip("link", "add", "to-inet", "type", "veth", "peer", "name", "eth0", "netns", netns.resolve(i), ns=r)
        ip("addr", "add", "10.77.0.1/24", "dev", "to-inet", ns=r)
        ip("addr", "add", "fd77::1/64", "dev", "to-inet", "nodad", ns=r)
        ip("addr", "add", f"{STUB_ADDRESS}/32", "dev", "lo", ns=r)
        ip("link", "set", "to-inet", "up", ns=r)
        ip("route", "add", "10.77.100.0/24", "via", "10.77.0.2", ns=r)
        ip("route", "add", "fd77:100::/64", "via", "fd77::2", ns=r)
        sysctl(r, "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1")
        ip("addr", "add", "10.77.0.2/24", "dev", "eth0", ns=i)
        ip("addr", "add", "fd77::2/64", "dev", "eth0", "nodad", ns=i)
        ip("link", "set", "eth0", "up", ns=i)
        for host in INTERNET_V4:
            ip("addr", "add", f"{host}/32", "dev", "lo", ns=i)
        for host in INTERNET_V6:
            ip("addr", "add", f"{host}/128", "dev", "lo", "nodad", ns=i)
        ip("route", "add", "default", "via", "10.77.0.1", ns=i)
        ip("-6", "route", "add", "default", "via", "fd77::1", ns=i)
        for index, name in ((1, "sbx-a"), (2, "sbx-b")):
            self.sandboxes[name] = self._sandbox(name, index)
        for ns in (r, i, *(sb.netns for sb in self.sandboxes.values())):
            wait_ipv6_ready(ns)
        self._start_internet()

    def _sandbox(self, name: str, index: int) -> Sandbox:
        group = cgroups.SandboxCgroups(self.layout, NODE, name)
        group.create(cpu=1, memory_mb=512, pids=256)
        ns = netns.create(NODE, name)
        r, veth = self.router, f"to-{name}"
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns.resolve(ns), ns=r)
        ip("addr", "add", f"10.77.{index}.1/24", "dev", veth, ns=r)
        ip("addr", "add", f"fd77:{index}::1/64", "dev", veth, "nodad", ns=r)
        ip("link", "set", veth, "up", ns=r)
        ip("addr", "add", f"10.77.{index}.2/24", "dev", "eth0", ns=ns)
        ip("addr", "add", f"fd77:{index}::2/64", "dev", "eth0", "nodad", ns=ns)
        ip("link", "set", "eth0", "up", ns=ns)
        ip("route", "add", "default", "via", f"10.77.{index}.1", ns=ns)
        ip("-6", "route", "add", "default", "via", f"fd77:{index}::1", ns=ns)
        return Sandbox(name=name, index=index, cgroups=group, netns=ns)

    def _start_internet(self) -> None:
        self._internet_proc = start_fake_internet(self.internet, {"tcp": TCP, "udp": UDP, "dns": [DNS_UPSTREAM],
                                                                  "zone": ZONE})

    def down(self) -> None:
        if self._internet_proc is not None:
            self._internet_proc.kill()
            self._internet_proc.wait()
        for sb in self.sandboxes.values():
            sb.cgroups.remove()
            netns.remove(NODE, sb.name)
        for name in ("router", "internet"):
            netns.remove(NODE, name)
        cgroups.remove_node_root(self.layout, NODE)


def start_fake_internet(ns: str, config: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*inside(ns), sys.executable, str(HERE / "fake_internet.py"), json.dumps(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"fake internet did not start: {line} {proc.stderr.read()}")
    return proc


@dataclass
class NodeInternet:
    """The fake internet beside the node itself, for sandboxes of a real platform:

        node (host netns) ── sft<pid> 10.77.0.1 ── eth0 10.77.0.2 [internet netns: 10.77.100.0/24, DNS]

    The link, its route and its forwarding flag are the test's own and go with the link;
    nothing else of the host's network changes. Replies to the node's NAT come in on this
    link, so it forwards (the node's veths forward what comes from its sandboxes). A module
    that runs beside another one's internet gives its own link name, owner and addresses.
    """

    config: dict
    link: str = field(default_factory=lambda: f"sft{os.getpid() % 100000}")
    owner: str = NODE  # whose namespace it is (never a platform node's id)
    link_host: str = "10.77.0.1"
    link_peer: str = "10.77.0.2"
    internet_net: str = "10.77.100.0/24"
    netns: str = ""
    _proc: subprocess.Popen | None = None

    def up(self) -> None:
        self.netns = netns.create(self.owner, "node-internet")
        try:
            ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", netns.resolve(self.netns))
            ip("addr", "add", f"{self.link_host}/24", "dev", self.link)
            ip("link", "set", self.link, "up")
            with open(f"/proc/sys/net/ipv4/conf/{self.link}/forwarding", "w") as f:
                f.write("1")
            ip("route", "add", self.internet_net, "via", self.link_peer, "dev", self.link)
            ip("addr", "add", f"{self.link_peer}/24", "dev", "eth0", ns=self.netns)
            ip("link", "set", "eth0", "up", ns=self.netns)
            hosts = {h for key in ("tcp", "udp", "http", "dns") for h, _ in self.config.get(key, [])}
            for host in sorted(hosts):
                ip("addr", "add", f"{host}/32", "dev", "lo", ns=self.netns)
            ip("route", "add", "default", "via", self.link_host, ns=self.netns)
            self._proc = start_fake_internet(self.netns, self.config)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        netns.remove(self.owner, "node-internet")


class NetnsLoop:
    """An asyncio loop on a thread that lives in a network namespace (sockets are made there)."""

    def __init__(self, netns_path: str) -> None:
        self._netns_path = netns_path
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="netns-loop", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            fd = netns.open_ns(self._netns_path)
            try:
                linux.setns(fd, linux.CLONE_NEWNET)  # this thread only
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor
            self._error = exc
            self._ready.set()
            return
        asyncio.set_event_loop(self.loop)
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()  # the thread ends here, in the namespace it entered

    def run(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable, *args):
        async def call():
            return fn(*args)

        return self.run(call())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class DenialCollector:
    """Reads the policy's ring buffer on a thread; tests wait for the record they expect."""

    def __init__(self, policy) -> None:
        self._policy = policy
        self._cond = threading.Condition()
        self.seen: list[tuple[object, int]] = []  # (Denial, CLOCK_MONOTONIC when decoded)
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="denials", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        def sink(denial) -> None:
            with self._cond:
                self.seen.append((denial, time.monotonic_ns()))
                self._cond.notify_all()

        while not self._stop:
            self._policy.poll(sink, 50)

    def wait_for(self, match: Callable[[object], bool], timeout: float = 2.0):
        """The first denial matching, with its decode time; None if none came within timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for denial, at in self.seen:
                    if match(denial):
                        return denial, at
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def stop(self) -> None:
        self._stop = True
        self._thread.join(5)

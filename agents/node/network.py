"""The node's egress network: veths, addresses, NAT, the DNS stub and the node-wide block list.

A sandbox with an allowlist gets a veth into its namespace and a /30 of the node subnet
(default 10.200.0.0/16; the first /30 holds the DNS stub's address on a dummy link). The
node masquerades what leaves the subnet through its own nftables table (`sandfleet-<node>`,
never any other rule), drops sandbox-to-sandbox and spoofed traffic, and accepts nothing
from a sandbox on the host itself but DNS to the stub. The gate is the BPF allow map: a
connect() the map refuses never makes a packet. The sandbox's DNS (any port-53 address)
is redirected to the stub, which answers only its allowed names and opens their addresses
in that sandbox's map before replying.

The block list (the bus, the node's own addresses, the node subnet, link-local and cloud
metadata addresses, the telemetry collector) is refused to every sandbox whatever its
allowlist says. All of it is made lazily, at the first sandbox with egress, so a node
without one never touches host networking; a restarted agent finds its links by alias.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from agents.node.allow_rules import AllowList
from agents.node.dns_stub import DnsClient, DnsStub, DnsViolation
from linuxnode import veth

log = logging.getLogger("sandfleet.agent.network")
DEFAULT_SUBNET = "10.200.0.0/16"
DNS_PORT = 53
# Never reachable from a sandbox: link-local (cloud metadata 169.254.169.254 and the like).
ALWAYS_BLOCKED = ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")


@dataclass(frozen=True)
class NetworkConfig:
    subnet: ipaddress.IPv4Network
    upstream: tuple[str, int]  # where the stub forwards allowed names
    bus_urls: tuple[str, ...] = ()  # their hosts are blocked to every sandbox
    extra_blocked: tuple[str, ...] = ()  # more host:port or URLs (e.g. the OTLP collector)

    @classmethod
    def from_env(cls, nats_url: str) -> NetworkConfig:
        subnet = ipaddress.IPv4Network(os.environ.get("SANDFLEET_EGRESS_SUBNET") or DEFAULT_SUBNET)
        if subnet.prefixlen > 28:
            raise ValueError(f"egress subnet {subnet} is too small (at most /28)")
        upstream = host_port(os.environ.get("SANDFLEET_DNS_UPSTREAM") or _system_resolver(), DNS_PORT)
        extra = tuple(v for v in (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),) if v)
        return cls(subnet=subnet, upstream=upstream,
                   bus_urls=tuple(u.strip() for u in nats_url.split(",")), extra_blocked=extra)


def host_port(text: str, default_port: int) -> tuple[str, int]:
    """'1.2.3.4', '1.2.3.4:5353', 'fd00::1', '[fd00::1]:5353' -> (host, port)."""
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        return host, int(port.lstrip(":") or default_port)
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, int(port)
    return text, default_port


def _system_resolver() -> str:
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    return parts[1]
    except OSError:
        pass
    return "127.0.0.1"


@dataclass(frozen=True)
class Plumbing:
    sandbox_id: str
    index: int
    ifname: str
    address: ipaddress.IPv4Interface
    cgroup_id: int


def _hosts(url: str) -> list[str]:
    """Addresses of a URL's or host:port's host (resolved now)."""
    host = urlsplit(url if "://" in url else f"x://{url}").hostname
    if not host:
        return []
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except OSError:
        return []


class EgressNetwork:
    """Per-node egress plumbing; `policy` is the node's EgressPolicy (BPF maps)."""

    def __init__(self, node_id: str, config: NetworkConfig, policy,
                 on_dns_violation: Callable[[DnsViolation], object]) -> None:
        self.node_id, self.config, self._policy = node_id, config, policy
        self._on_dns_violation = on_dns_violation
        tag = hashlib.sha256(node_id.encode()).hexdigest()[:6]
        self._veth_prefix = f"sf{tag}h"  # + index: at most 15 characters
        self._dummy = f"sf{tag}dns"
        self._alias = f"sandfleet:{node_id}:"
        self._dummy_alias = f"sandfleet-dns:{node_id}"
        self.table = f"sandfleet-{node_id}"
        self.stub_address = ipaddress.IPv4Address(int(config.subnet.network_address) + 1)
        self._lock = threading.Lock()
        self._start_lock = asyncio.Lock()
        self._plumbed: dict[str, Plumbing] = {}
        self._blocked: set[str] = set()
        self._stub: DnsStub | None = None

    @property
    def started(self) -> bool:
        return self._stub is not None

    def describe(self) -> str:
        """For the node's security report (`sandfleet status`)."""
        text = f"on: subnet {self.config.subnet}, DNS stub {self.stub_address} -> {self.config.upstream[0]}:" \
               f"{self.config.upstream[1]}"
        if shutil.which("nft") is None:
            return "off: nft is not installed (Debian package nftables)"
        try:
            with open("/proc/sys/net/ipv4/ip_forward") as f:
                if f.read().strip() == "0":
                    text += " (net.ipv4.ip_forward=0: only hosts reachable through links that forward)"
        except OSError:
            pass
        return text

    # -- node-wide pieces --------------------------------------------------------------------

    async def ensure_started(self) -> None:
        """Dummy link with the stub's address, our nft table, the stub listening. Idempotent."""
        async with self._start_lock:
            if self._stub is not None:
                return
            await asyncio.to_thread(self._make_host_side)
            stub = DnsStub(self._policy, self.config.upstream, self._on_dns_violation)
            await stub.start(str(self.stub_address), DNS_PORT)
            self._stub = stub
            log.info("egress network up: subnet %s, DNS stub %s, upstream %s:%d", self.config.subnet,
                     self.stub_address, *self.config.upstream)

    def _make_host_side(self) -> None:
        veth.ensure_dummy(self._dummy, self._dummy_alias, ipaddress.IPv4Interface(f"{self.stub_address}/32"))
        subnet, pattern = self.config.subnet, f'"{self._veth_prefix}*"'
        ruleset = f"""
add table ip {self.table}
delete table ip {self.table}
table ip {self.table} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {subnet} oifname != {pattern} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname {pattern} ip saddr != {subnet} drop
    iifname {pattern} ip daddr {subnet} drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname {pattern} ip daddr {self.stub_address} meta l4proto {{ udp, tcp }} th dport {DNS_PORT} accept
    iifname {pattern} drop
  }}
}}
"""
        _nft(ruleset)
        self.refresh_block_list()

    def refresh_block_list(self) -> None:
        """Block the node's current addresses, the subnet, the bus and link-local (for all)."""
        want = {str(self.config.subnet), *ALWAYS_BLOCKED}
        for addr in veth.host_addresses():
            if addr not in self.config.subnet:  # the veths' own ends: the subnet entry covers them
                want.add(str(ipaddress.ip_network(addr)))
        for url in (*self.config.bus_urls, *self.config.extra_blocked):
            want.update(str(ipaddress.ip_network(a.split("%")[0])) for a in _hosts(url))
        with self._lock:
            for net in sorted(want - self._blocked):
                self._policy.block(net)
            for net in sorted(self._blocked - want):
                self._policy.unblock(net)
            self._blocked = want

    async def close(self) -> None:
        """Stop the stub, remove every link and the nft table (sandboxes are released by now)."""
        if self._stub is not None:
            await self._stub.close()
            self._stub = None
        await asyncio.to_thread(self._remove_host_side)

    def _remove_host_side(self) -> None:
        for link in veth.links(self._alias):
            veth.remove(link.name)
        veth.remove(self._dummy)
        if shutil.which("nft"):
            subprocess.run(["nft", "delete", "table", "ip", self.table], capture_output=True)
        with self._lock:
            self._plumbed.clear()
            for net in self._blocked:
                self._policy.unblock(net)
            self._blocked = set()

    # -- sandboxes ---------------------------------------------------------------------------

    def setup(self, sandbox_id: str, netns_path: str, cgroup_id: int, rules: AllowList) -> Plumbing:
        """Veth + address + route for a sandbox, its rules in the map, its DNS to the stub."""
        if self._stub is None:
            raise RuntimeError("ensure_started() first")
        with self._lock:
            plumbing = self._plumbed.get(sandbox_id)
            if plumbing is None:
                plumbing = self._plumb(sandbox_id, netns_path, cgroup_id)
            elif plumbing.cgroup_id != cgroup_id:
                plumbing = Plumbing(sandbox_id, plumbing.index, plumbing.ifname, plumbing.address, cgroup_id)
                self._plumbed[sandbox_id] = plumbing
        self.refresh_block_list()
        self._policy.allow_networks(cgroup_id, rules.networks)
        self._register(plumbing, rules)
        return plumbing

    def _plumb(self, sandbox_id: str, netns_path: str, cgroup_id: int) -> Plumbing:
        used = {p.index for p in self._plumbed.values()}
        last = self.config.subnet.num_addresses // 4 - 1
        index = next((i for i in range(1, last + 1) if i not in used), None)
        if index is None:
            raise RuntimeError(f"egress subnet {self.config.subnet} is full")
        base = int(self.config.subnet.network_address) + 4 * index
        gateway = ipaddress.IPv4Interface((base + 1, 30))
        address = ipaddress.IPv4Interface((base + 2, 30))
        ifname = f"{self._veth_prefix}{index}"
        veth.remove(ifname)  # a leftover of a crash with our name cannot be anyone's
        veth.plumb(netns_path, ifname, self._alias + sandbox_id, gateway, address)
        plumbing = Plumbing(sandbox_id, index, ifname, address, cgroup_id)
        self._plumbed[sandbox_id] = plumbing
        return plumbing

    def _register(self, p: Plumbing, rules: AllowList) -> None:
        self._policy.redirect_dns(p.cgroup_id, self.stub_address, DNS_PORT)
        if self._stub is not None:
            self._stub.register(DnsClient(p.sandbox_id, p.cgroup_id, (str(p.address.ip),), rules.domains))

    def teardown(self, sandbox_id: str) -> None:
        """Remove the sandbox's veth and its stub registration (its BPF rules go with detach)."""
        with self._lock:
            plumbing = self._plumbed.pop(sandbox_id, None)
        if self._stub is not None:
            self._stub.unregister(sandbox_id)
        if plumbing is not None:  # links of sandboxes from before a restart: adopt() saw them
            veth.remove(plumbing.ifname)

    def holds(self, sandbox_id: str) -> bool:
        return sandbox_id in self._plumbed

    def adopt(self, live: dict[str, tuple[int, AllowList]]) -> list[str]:
        """After a restart: keep the veths of live sandboxes (sandbox id -> cgroup id, rules),
        remove the rest; returns the ids whose veth was removed."""
        removed = []
        for link in veth.links(self._alias):
            sandbox_id = link.alias[len(self._alias):]
            index = link.name[len(self._veth_prefix):]
            if sandbox_id not in live or not link.name.startswith(self._veth_prefix) or not index.isdigit() \
                    or not link.addresses:
                veth.remove(link.name)
                removed.append(sandbox_id)
                continue
            gateway = ipaddress.IPv4Interface(link.addresses[0])
            address = ipaddress.IPv4Interface((int(gateway.ip) + 1, gateway.network.prefixlen))
            with self._lock:
                self._plumbed[sandbox_id] = Plumbing(sandbox_id, int(index), link.name, address, live[sandbox_id][0])
        return removed

    def reapply(self, sandbox_id: str, rules: AllowList) -> None:
        """Refill a re-adopted sandbox's rules in this agent's maps and stub."""
        plumbing = self._plumbed[sandbox_id]
        self._policy.allow_networks(plumbing.cgroup_id, rules.networks)
        self._register(plumbing, rules)

    def leftovers(self) -> bool:
        """Does the host hold node-wide pieces a previous agent of this node left?"""
        return bool(veth.links(self._dummy_alias)) or _nft_has_table(self.table)

    def remove_leftovers(self) -> None:
        self._remove_host_side()


def _nft(ruleset: str) -> None:
    if shutil.which("nft") is None:
        raise RuntimeError("nft is not installed (Debian package nftables): no NAT for sandbox egress")
    out = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"nft: {out.stderr.strip()}")


def _nft_has_table(table: str) -> bool:
    if shutil.which("nft") is None:
        return False
    return subprocess.run(["nft", "list", "table", "ip", table], capture_output=True).returncode == 0

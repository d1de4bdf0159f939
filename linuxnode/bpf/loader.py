"""The node's egress policy: allowlist.bpf.c compiled once, attached per sandbox cgroup.

One EgressPolicy per agent process compiles the programs (~1 s and ~150 MB with bcc), attaches them
to each sandbox's v2 cgroup and keeps the policy in maps keyed by cgroup id, so allowing
an address is a map update, never a recompile. Denials arrive on a ring buffer and are
decoded into `Denial` records, by `poll()` from a thread or `denials()` in asyncio.

Attachments outlive this process on purpose: a restarting agent leaves its sandboxes
protected by the old programs (and their old maps) until the new agent has attached its
own and refilled their rules; `detach_stale()` then removes the old ones. Deny always wins
when both run, so that order never opens a gap.
"""

from __future__ import annotations

import asyncio
import ctypes as ct
import ipaddress
import logging
import os
import socket
import threading
import typing
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from linuxnode.bpf import build, cgroup_progs
from linuxnode.bpf.build import BpfUnavailable
from linuxnode.bpf.denials import Denial, decode

log = logging.getLogger("sandfleet.agent.bpf")
SOURCE = Path(__file__).with_name("allowlist.bpf.c")
SO_NETNS_COOKIE = 71
_PROG_CGROUP_SOCK, _PROG_CGROUP_SOCK_ADDR = 9, 18
# (function, program type, attach type): every hook a sandbox cgroup gets.
HOOKS = (
    ("sf_connect4", _PROG_CGROUP_SOCK_ADDR, 10),  # BPF_CGROUP_INET4_CONNECT
    ("sf_connect6", _PROG_CGROUP_SOCK_ADDR, 11),  # BPF_CGROUP_INET6_CONNECT (also ::ffff:a.b.c.d)
    ("sf_sendmsg4", _PROG_CGROUP_SOCK_ADDR, 14),  # BPF_CGROUP_UDP4_SENDMSG
    ("sf_sendmsg6", _PROG_CGROUP_SOCK_ADDR, 15),  # BPF_CGROUP_UDP6_SENDMSG
    ("sf_sock_create", _PROG_CGROUP_SOCK, 2),  # BPF_CGROUP_INET_SOCK_CREATE
    ("sf_recvmsg4", _PROG_CGROUP_SOCK_ADDR, 19),  # BPF_CGROUP_UDP4_RECVMSG (DNS replies)
)
PROGRAM_NAMES = frozenset(name for name, _, _ in HOOKS)
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Destination = str | IPNetwork | ipaddress.IPv4Address | ipaddress.IPv6Address


class Protocol(IntEnum):
    """IP protocol numbers as the kernel and the BPF maps spell them; ANY matches both."""

    ANY = 0
    TCP = socket.IPPROTO_TCP
    UDP = socket.IPPROTO_UDP


class NetworkRule(typing.Protocol):
    """What `allow_networks` reads of a parsed rule (sandfleet.allow_rules.NetworkRule has it)."""

    network: IPNetwork
    port: int | None
    protocol: int


class UnknownCgroup(LookupError):
    """The cgroup id is not attached by this EgressPolicy."""


class _RuleKey(ct.Structure):  # struct sf_rule_key
    _fields_ = [
        ("prefixlen", ct.c_uint32),
        ("proto", ct.c_uint8),
        ("pad", ct.c_uint8),
        ("port", ct.c_uint16),  # network byte order
        ("cgroup_id", ct.c_uint64),
        ("addr", ct.c_ubyte * 16),
    ]


class _Flags(ct.Structure):  # struct sf_rule_val, struct sf_sandbox
    _fields_ = [("flags", ct.c_uint32)]


class _DnsRedirect(ct.Structure):  # struct sf_dns_redirect
    _fields_ = [("addr", ct.c_ubyte * 4), ("port", ct.c_uint16), ("pad", ct.c_uint16)]


class _Config(ct.Structure):  # struct sf_config
    _fields_ = [("host_netns_cookie", ct.c_uint64), ("blocked_rules", ct.c_uint32), ("pad", ct.c_uint32)]


@dataclass(frozen=True)
class Rule:
    network: IPNetwork
    port: int | None
    protocol: Protocol


@dataclass(frozen=True)
class StaleAttachment:
    cgroup: str
    attach_type: int
    program_id: int
    program: str


def cgroup_id(cgroup_dir: str) -> int:
    """The id bpf_get_current_cgroup_id() returns for members of a v2 cgroup: its inode."""
    return os.stat(cgroup_dir).st_ino


def _network(dest: Destination) -> IPNetwork:
    if isinstance(dest, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return dest
    return ipaddress.ip_network(dest, strict=True)


def _key(cgroup: int, rule: Rule) -> _RuleKey:
    net = rule.network
    if net.version == 4:  # stored IPv4-mapped, as the programs look it up
        addr, bits = b"\0" * 10 + b"\xff\xff" + net.network_address.packed, 96 + net.prefixlen
    else:
        addr, bits = net.network_address.packed, net.prefixlen
    key = _RuleKey(prefixlen=96 + bits, proto=int(rule.protocol), pad=0,
                   port=socket.htons(rule.port or 0), cgroup_id=cgroup)
    ct.memmove(key.addr, addr, 16)
    return key


def _rule(dest: Destination, port: int | None, proto: Protocol | int) -> Rule:
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port must be 1..65535 or None, not {port}")
    return Rule(_network(dest), port, Protocol(proto))


def _host_netns_cookie() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")


class EgressPolicy:
    """Per-sandbox egress allowlists enforced by cgroup BPF programs. Thread-safe."""

    def __init__(self, *, socket_tracepoints: bool | None = None) -> None:
        """Compile and load; socket_tracepoints=None uses them when tracefs is (or can be) mounted."""
        self.socket_tracepoints = build.tracefs_ready() if socket_tracepoints is None else socket_tracepoints
        self._bpf = build.compile_program(SOURCE, ["-DSF_SOCKET_TRACEPOINTS"] if self.socket_tracepoints else [])
        try:
            self._progs = {name: self._bpf.load_func(name.encode(), ptype, attach_type=atype) for name, ptype, atype in HOOKS}
        except Exception as exc:  # bcc raises bare Exception for load errors
            raise BpfUnavailable(f"cannot load the egress programs: {exc}") from exc
        self.program_ids = frozenset(cgroup_progs.program_id(fn.fd) for fn in self._progs.values())
        self._allow, self._blocked = self._bpf[b"allow"], self._bpf[b"blocked"]
        self._sandboxes, self._config = self._bpf[b"sandboxes"], self._bpf[b"config"]
        self._dns_redirect = self._bpf[b"dns_redirect"]
        self._lock = threading.Lock()
        self._attached: dict[int, str] = {}
        self._rules: dict[int, set[Rule]] = {}
        self._block_rules: set[Rule] = set()
        self._host_netns_cookie = _host_netns_cookie()  # of the thread constructing us: the node's netns
        self._write_config()
        self._sink: Callable[[Denial], object] = lambda d: None
        self._ring = self._bpf[b"denials"]
        self._ring.open_ring_buffer(self._on_record)

    # -- sandboxes ---------------------------------------------------------------------------

    def attach(self, cgroup_dir: str) -> int:
        """Police a sandbox's v2 cgroup (deny everything until allowed); returns its cgroup id."""
        cg = cgroup_id(cgroup_dir)
        with self._lock:
            if self._attached.get(cg) == cgroup_dir:
                return cg
            self._sandboxes[ct.c_uint64(cg)] = _Flags(0)  # lets the socket() tracepoints see it
            try:
                with cgroup_progs.open_cgroup(cgroup_dir) as fd:
                    done: list[tuple[int, int]] = []
                    try:
                        for name, _, atype in HOOKS:
                            cgroup_progs.attach(self._progs[name].fd, fd, atype)
                            done.append((self._progs[name].fd, atype))
                    except BaseException:
                        for prog_fd, atype in done:
                            cgroup_progs.detach(prog_fd, fd, atype)
                        raise
            except BaseException:
                if cg not in self._attached:
                    del self._sandboxes[ct.c_uint64(cg)]
                raise
            self._attached[cg] = cgroup_dir
            self._rules.setdefault(cg, set())
        return cg

    def detach(self, cgroup: int) -> None:
        """Remove the programs and every rule of a sandbox. Idempotent."""
        with self._lock:
            path = self._attached.pop(cgroup, None)
            if path is not None:
                try:
                    with cgroup_progs.open_cgroup(path) as fd:
                        for name, _, atype in HOOKS:
                            cgroup_progs.detach(self._progs[name].fd, fd, atype)
                except FileNotFoundError:
                    pass  # the cgroup is gone, and the kernel released its programs with it
            self._clear(cgroup)
            self._rules.pop(cgroup, None)
            for table in (self._sandboxes, self._dns_redirect):
                try:
                    del table[ct.c_uint64(cgroup)]
                except KeyError:
                    pass

    def detach_all(self) -> None:
        for cg in list(self._attached):
            self.detach(cg)

    def attached(self) -> dict[int, str]:
        """cgroup id -> v2 cgroup directory of every sandbox this policy attached."""
        with self._lock:
            return dict(self._attached)

    # -- rules -------------------------------------------------------------------------------

    def allow(self, cgroup: int, dest: Destination, port: int | None = None,
              proto: Protocol | int = Protocol.ANY) -> None:
        """Let the sandbox reach dest (an address or network) on port (None: any) over proto."""
        rule = _rule(dest, port, proto)
        with self._lock:
            if cgroup not in self._attached:
                raise UnknownCgroup(f"cgroup {cgroup} is not attached")
            if rule not in self._rules[cgroup]:
                self._allow[_key(cgroup, rule)] = _Flags(0)
                self._rules[cgroup].add(rule)

    def allow_networks(self, cgroup: int, rules: Iterable[NetworkRule]) -> None:
        """allow() every parsed network rule of a sandbox's allowlist (its names go to the DNS stub)."""
        for rule in rules:
            self.allow(cgroup, rule.network, rule.port, rule.protocol)

    def revoke(self, cgroup: int, dest: Destination, port: int | None = None,
               proto: Protocol | int = Protocol.ANY) -> bool:
        """Remove one rule exactly as it was allowed; False if there was none."""
        rule = _rule(dest, port, proto)
        with self._lock:
            if rule not in self._rules.get(cgroup, ()):
                return False
            self._rules[cgroup].discard(rule)
            del self._allow[_key(cgroup, rule)]
            return True

    def clear(self, cgroup: int) -> None:
        """Remove every rule of a sandbox (it stays attached: everything is denied)."""
        with self._lock:
            self._clear(cgroup)

    def _clear(self, cgroup: int) -> None:
        for rule in self._rules.get(cgroup, set()):
            try:
                del self._allow[_key(cgroup, rule)]
            except KeyError:
                pass
        if cgroup in self._rules:
            self._rules[cgroup] = set()

    def rules(self, cgroup: int) -> set[Rule]:
        with self._lock:
            return set(self._rules.get(cgroup, ()))

    def redirect_dns(self, cgroup: int, stub: ipaddress.IPv4Address | str, port: int = 53) -> None:
        """Send the sandbox's IPv4 DNS traffic (port 53, any address) to the stub instead."""
        stub = ipaddress.IPv4Address(stub)
        value = _DnsRedirect(port=socket.htons(port), pad=0)
        ct.memmove(value.addr, stub.packed, 4)
        with self._lock:
            if cgroup not in self._attached:
                raise UnknownCgroup(f"cgroup {cgroup} is not attached")
            self._dns_redirect[ct.c_uint64(cgroup)] = value

    def stop_redirect_dns(self, cgroup: int) -> None:
        with self._lock:
            try:
                del self._dns_redirect[ct.c_uint64(cgroup)]
            except KeyError:
                pass

    def block(self, dest: Destination, port: int | None = None, proto: Protocol | int = Protocol.ANY) -> None:
        """Deny dest to every sandbox whatever its allowlist says (the bus, platform services)."""
        rule = _rule(dest, port, proto)
        with self._lock:
            if rule not in self._block_rules:
                self._blocked[_key(0, rule)] = _Flags(0)
                self._block_rules.add(rule)
                self._write_config()

    def unblock(self, dest: Destination, port: int | None = None, proto: Protocol | int = Protocol.ANY) -> None:
        rule = _rule(dest, port, proto)
        with self._lock:
            if rule in self._block_rules:
                self._block_rules.discard(rule)
                del self._blocked[_key(0, rule)]
                self._write_config()

    def _write_config(self) -> None:
        self._config[ct.c_int(0)] = _Config(self._host_netns_cookie, len(self._block_rules), 0)

    # -- programs left by an earlier agent --------------------------------------------------

    def detach_stale(self, prefix: str) -> list[StaleAttachment]:
        """Detach our programs that another (dead) loader attached anywhere under prefix."""
        found: list[StaleAttachment] = []
        for root, _, _ in os.walk(prefix):
            try:
                with cgroup_progs.open_cgroup(root) as fd:
                    for _, _, atype in HOOKS:
                        for prog_id in cgroup_progs.attached_ids(fd, atype):
                            if prog_id in self.program_ids:
                                continue
                            ref = cgroup_progs.program_by_id(prog_id)
                            if ref is None:
                                continue
                            try:
                                if ref.name in PROGRAM_NAMES and cgroup_progs.detach(ref.fd, fd, atype):
                                    found.append(StaleAttachment(root, atype, prog_id, ref.name))
                            finally:
                                os.close(ref.fd)
            except FileNotFoundError:
                continue  # removed while we walked
        return found

    # -- denials -----------------------------------------------------------------------------

    def _on_record(self, _ctx: object, data: int, size: int) -> int:
        try:  # an exception must not unwind through libbcc's C callback
            self._sink(decode(data, size))
        except Exception:
            log.exception("denial record dropped")
        return 0

    def poll(self, callback: Callable[[Denial], object], timeout_ms: int = 100) -> None:
        """Wait up to timeout_ms for denials and hand each to callback. Use one reader at a
        time: this, or denials(), from one thread."""
        self._sink = callback
        self._bpf.ring_buffer_poll(timeout_ms)

    async def denials(self) -> AsyncIterator[Denial]:
        """Every denial from now on, read when the ring buffer's fd turns readable."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Denial] = asyncio.Queue()
        fd = self._ring.map_fd

        def readable() -> None:
            self._sink = queue.put_nowait
            self._bpf.ring_buffer_consume()

        loop.add_reader(fd, readable)
        try:
            readable()  # records that arrived before the reader was registered
            while True:
                yield await queue.get()
        finally:
            loop.remove_reader(fd)

    def programs(self) -> dict[str, int]:
        """Program name -> fd (for attachment queries and run-time statistics)."""
        return {name: fn.fd for name, fn in self._progs.items()}

    def lost(self) -> int:
        """Denials dropped because the ring buffer was full (the reader fell behind)."""
        return sum(int(v) for v in self._bpf[b"lost"][ct.c_int(0)])

    def close(self) -> None:
        """Free this process's handles; attachments stay (see the module doc)."""
        self._bpf.cleanup()

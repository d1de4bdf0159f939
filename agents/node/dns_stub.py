"""The node's DNS stub: the only resolver sandboxes can reach, answering only allowed names.

Each sandbox's resolv.conf names this stub. A query is tied to its sandbox by its source
address: the agent gives each sandbox its own veth address, and a sandbox cannot change it
(no CAP_NET_ADMIN, raw and packet sockets refused), so `register()` maps those addresses to
the sandbox's cgroup id and domain rules. A name no rule allows is answered NXDOMAIN (or
REFUSED) and reported as a violation; an allowed name is forwarded upstream, and every
A/AAAA address on the answer's CNAME chain is put into that sandbox's egress map, for the
ports the rules name, *before* the reply leaves, so the sandbox's connect() that follows
is already allowed, and the address stays denied to every other sandbox.

Learned addresses stay allowed for the sandbox's life (DNS TTLs are not tracked): a
long-lived connection or a resolver cache never outlives its permission that way.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol as Interface

from dnslib import QTYPE, RCODE, DNSError, DNSRecord

from agents.node.allow_rules import DomainRule, Protocol
from sandfleet.telemetry import SANDBOX_ID

log = logging.getLogger("sandfleet.agent.dns")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
DNS_PORT = 53
_TCP_IDLE_S = 10.0


class EgressMap(Interface):
    """What the stub needs of the egress policy (linuxnode.bpf.EgressPolicy has it)."""

    def allow(self, cgroup: int, dest: IPAddress, port: int | None = None, proto: Protocol | int = Protocol.ANY) -> None: ...


@dataclass(frozen=True)
class DnsClient:
    """One sandbox as the stub knows it."""

    sandbox_id: str
    cgroup_id: int
    sources: tuple[str, ...]  # the addresses its queries come from
    domains: tuple[DomainRule, ...]


@dataclass(frozen=True)
class DnsViolation:
    sandbox_id: str
    cgroup_id: int
    source: str
    name: str
    qtype: str
    monotonic_ns: int


def _address(text: str) -> IPAddress:
    ip = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # a dual-stack socket sees IPv4 sources as ::ffff:a.b.c.d
    return ip


def _name(label: object) -> str:
    return str(label).rstrip(".").lower()


def chain_addresses(qname: str, reply: DNSRecord) -> list[IPAddress]:
    """A/AAAA addresses of qname in reply's answers, following CNAMEs in any order."""
    names, found, rrs = {_name(qname)}, [], list(reply.rr)
    grew = True
    while grew:
        grew = False
        for rr in rrs:
            if _name(rr.rname) not in names:
                continue
            if rr.rtype == QTYPE.CNAME and _name(rr.rdata.label) not in names:
                names.add(_name(rr.rdata.label))
                grew = True
    for rr in rrs:
        if _name(rr.rname) in names and rr.rtype in (QTYPE.A, QTYPE.AAAA):
            found.append(ipaddress.ip_address(str(rr.rdata)))
    return found


class DnsStub:
    """UDP and TCP DNS on the addresses given to start(); forwards allowed names upstream."""

    def __init__(
        self,
        egress: EgressMap,
        upstream: tuple[str, int],
        on_violation: Callable[[DnsViolation], object],
        *,
        refuse_rcode: int = RCODE.NXDOMAIN,
        timeout_s: float = 2.0,
        attempts: int = 2,
    ) -> None:
        self._egress, self._upstream, self._on_violation = egress, upstream, on_violation
        self._refuse_rcode, self._timeout_s, self._attempts = refuse_rcode, timeout_s, attempts
        self._clients: dict[str, DnsClient] = {}
        self._by_source: dict[IPAddress, DnsClient] = {}
        self._listening: list[tuple[IPAddress, int]] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._transports: list[asyncio.DatagramTransport] = []
        self._tasks: set[asyncio.Task] = set()

    # -- sandboxes ---------------------------------------------------------------------------

    def register(self, client: DnsClient) -> None:
        """Serve a sandbox: map its sources to it and let it reach the stub's addresses."""
        sources = [_address(s) for s in client.sources]
        for ip in sources:
            owner = self._by_source.get(ip)
            if owner is not None and owner.sandbox_id != client.sandbox_id:
                raise ValueError(f"source {ip} already belongs to sandbox {owner.sandbox_id}")
        self.unregister(client.sandbox_id)
        for addr, port in self._listening:
            self._allow_stub(client, addr, port)
        self._clients[client.sandbox_id] = client
        for ip in sources:
            self._by_source[ip] = client

    def unregister(self, sandbox_id: str) -> None:
        client = self._clients.pop(sandbox_id, None)
        if client is not None:
            for s in client.sources:
                self._by_source.pop(_address(s), None)

    def _allow_stub(self, client: DnsClient, addr: IPAddress, port: int) -> None:
        self._egress.allow(client.cgroup_id, addr, port, Protocol.UDP)
        self._egress.allow(client.cgroup_id, addr, port, Protocol.TCP)

    # -- serving -----------------------------------------------------------------------------

    async def start(self, host: str, port: int = DNS_PORT) -> tuple[str, int]:
        """Listen on host:port (UDP and TCP, same port); returns the address bound."""
        loop = asyncio.get_running_loop()
        tries = 20 if port == 0 else 1  # port 0: until the UDP port's TCP twin is free too
        for attempt in range(tries):
            transport, _ = await loop.create_datagram_endpoint(lambda: _UdpServer(self), local_addr=(host, port))
            bound = transport.get_extra_info("sockname")[1]
            try:
                server = await asyncio.start_server(self._serve_tcp, host, bound)
                break
            except OSError:
                transport.close()
                if attempt == tries - 1:
                    raise
        self._transports.append(transport)
        self._servers.append(server)
        addr = _address(host)
        self._listening.append((addr, bound))
        for client in self._clients.values():
            self._allow_stub(client, addr, bound)
        return host, bound

    async def close(self) -> None:
        for transport in self._transports:
            transport.close()
        for server in self._servers:
            server.close()
            await server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._transports, self._servers, self._listening = [], [], []

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = writer.get_extra_info("peername")[0]
        try:
            while True:
                size = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), _TCP_IDLE_S), "big")
                query = await asyncio.wait_for(reader.readexactly(size), _TCP_IDLE_S)
                reply = await self.answer(query, source, tcp=True)
                if reply is None:
                    break
                writer.write(len(reply).to_bytes(2, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    # -- answering ---------------------------------------------------------------------------

    async def answer(self, query: bytes, source: str, *, tcp: bool = False) -> bytes | None:
        """The reply to one query from source (None: not DNS, dropped)."""
        try:
            request = DNSRecord.parse(query)
        except (DNSError, ValueError, IndexError):
            return None
        client = self._by_source.get(_address(source))
        if client is None:
            log.warning("DNS query from %s, which is no registered sandbox", source)
            return _reply(request, RCODE.REFUSED)
        if request.header.opcode != 0 or request.header.qr or len(request.questions) != 1:
            return _reply(request, RCODE.FORMERR)
        question = request.questions[0]
        qname, qtype = _name(question.qname), QTYPE.get(question.qtype, str(question.qtype))
        rules = [r for r in client.domains if r.matches(qname)]
        if not rules:
            self._report(DnsViolation(client.sandbox_id, client.cgroup_id, source, qname, qtype, time.monotonic_ns()))
            return _reply(request, self._refuse_rcode)
        reply = await self._forward(request, tcp)
        if reply is None:
            return _reply(request, RCODE.SERVFAIL)
        try:
            for ip in chain_addresses(qname, reply):
                for rule in rules:
                    self._egress.allow(client.cgroup_id, ip, rule.port, rule.protocol)
        except LookupError:  # the sandbox was detached meanwhile
            return _reply(request, RCODE.SERVFAIL)
        reply.header.id = request.header.id
        return reply.pack()

    def _report(self, violation: DnsViolation) -> None:
        log.info("refused DNS name %s (%s) for sandbox %s", violation.name, violation.qtype, violation.sandbox_id,
                 extra={SANDBOX_ID: violation.sandbox_id})
        try:
            result = self._on_violation(violation)
            if inspect.isawaitable(result):
                self._spawn(result)
        except Exception:
            log.exception("DNS violation callback failed")

    async def _forward(self, request: DNSRecord, tcp: bool) -> DNSRecord | None:
        """Ask upstream with a fresh id; None when it does not answer in time."""
        upstream_query = DNSRecord.parse(request.pack())
        upstream_query.header.id = secrets.randbits(16)
        packet = upstream_query.pack()
        for _ in range(self._attempts):
            try:
                raw = await asyncio.wait_for(
                    _ask_tcp(self._upstream, packet) if tcp else _ask_udp(self._upstream, packet), self._timeout_s
                )
                reply = DNSRecord.parse(raw)
            except (asyncio.TimeoutError, OSError, DNSError, ValueError, IndexError) as exc:
                log.debug("upstream %s: %s", self._upstream, exc)
                continue
            if reply.header.id == upstream_query.header.id and reply.q.qname == request.q.qname:
                return reply
        return None


def _reply(request: DNSRecord, rcode: int) -> bytes:
    reply = request.reply()
    reply.header.rcode = rcode
    reply.header.ra = 1
    return reply.pack()


class _UdpServer(asyncio.DatagramProtocol):
    def __init__(self, stub: DnsStub) -> None:
        self._stub = stub
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self._stub._spawn(self._answer(data, addr))

    async def _answer(self, data: bytes, addr) -> None:
        reply = await self._stub.answer(data, addr[0], tcp=False)
        if reply is not None and self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(reply, addr)


class _OneReply(asyncio.DatagramProtocol):
    def __init__(self, reply: asyncio.Future, query_id: bytes) -> None:
        self._reply, self._id = reply, query_id

    def datagram_received(self, data: bytes, addr) -> None:
        if data[:2] == self._id and not self._reply.done():
            self._reply.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self._reply.done():
            self._reply.set_exception(exc)


async def _ask_udp(upstream: tuple[str, int], packet: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()
    transport, _ = await loop.create_datagram_endpoint(lambda: _OneReply(reply, packet[:2]), remote_addr=upstream)
    try:
        transport.sendto(packet)
        return await reply
    finally:
        transport.close()


async def _ask_tcp(upstream: tuple[str, int], packet: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*upstream)
    try:
        writer.write(len(packet).to_bytes(2, "big") + packet)
        await writer.drain()
        size = int.from_bytes(await reader.readexactly(2), "big")
        return await reader.readexactly(size)
    finally:
        writer.close()

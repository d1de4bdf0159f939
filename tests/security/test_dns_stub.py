"""The DNS stub's logic on loopback: a fake egress map (recording what it is told to allow)
and a fake upstream resolver, both in this process. The real map and real namespaces are
exercised in test_allowlist.py."""

from __future__ import annotations

import asyncio
import ipaddress
import time

import pytest
from dnslib import QTYPE, RCODE, RR, A, AAAA, CNAME, DNSRecord

from agents.node.allow_rules import Protocol, parse_allow
from agents.node.dns_stub import DnsClient, DnsStub, chain_addresses
from tests.security.fake_internet import Dns, answer

ZONE = {
    "allowed.test": {"A": ["192.0.2.1", "192.0.2.2"]},
    "api.test": {"A": ["192.0.2.4"], "AAAA": ["2001:db8::4"]},
    "cdn.test": {"CNAME": "edge.provider.test"},
    "edge.provider.test": {"A": ["192.0.2.6"]},
}
ip = ipaddress.ip_address


class FakeEgress:
    def __init__(self) -> None:
        self.calls: list[tuple[int, object, int | None, int, int]] = []
        self.fail = False

    def allow(self, cgroup, dest, port=None, proto=Protocol.ANY) -> None:
        if self.fail:
            raise LookupError("cgroup is not attached")
        self.calls.append((cgroup, dest, port, int(proto), time.monotonic_ns()))

    def learned(self, cgroup: int) -> set[tuple]:
        return {(str(dest), port, proto) for cg, dest, port, proto, _ in self.calls if cg == cgroup}


@pytest.fixture
async def upstream():
    loop = asyncio.get_running_loop()

    async def over_tcp(reader, writer):
        size = int.from_bytes(await reader.readexactly(2), "big")
        reply = answer(ZONE, await reader.readexactly(size))
        writer.write(len(reply).to_bytes(2, "big") + reply)
        writer.close()

    for _ in range(20):  # a free UDP port whose TCP twin is free too
        transport, _ = await loop.create_datagram_endpoint(lambda: Dns(ZONE), local_addr=("127.0.0.1", 0))
        address = transport.get_extra_info("sockname")[:2]
        try:
            server = await asyncio.start_server(over_tcp, *address)
            break
        except OSError:
            transport.close()
    else:
        pytest.fail("no port free for both UDP and TCP")
    yield address
    transport.close()
    server.close()


@pytest.fixture
async def stub(upstream):
    violations: list = []
    egress = FakeEgress()
    stub = DnsStub(egress, upstream, violations.append, timeout_s=0.5)
    _, port = await stub.start("127.0.0.1", 0)
    stub.port, stub.egress, stub.violations = port, egress, violations
    yield stub
    await stub.close()


async def ask(port: int, name: str, qtype: str = "A", *, source: str = "127.0.0.2", tcp: bool = False) -> tuple[DNSRecord, int]:
    """Ask the stub from a given loopback source; returns the reply and when it arrived."""
    query = DNSRecord.question(name, qtype)
    if tcp:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        packet = query.pack()
        writer.write(len(packet).to_bytes(2, "big") + packet)
        size = int.from_bytes(await reader.readexactly(2), "big")
        raw = await reader.readexactly(size)
        writer.close()
    else:
        loop = asyncio.get_running_loop()
        got: asyncio.Future = loop.create_future()

        class Client(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                if not got.done():
                    got.set_result(data)

        transport, _ = await loop.create_datagram_endpoint(Client, local_addr=(source, 0), remote_addr=("127.0.0.1", port))
        transport.sendto(query.pack())
        try:
            raw = await asyncio.wait_for(got, 3)
        finally:
            transport.close()
    reply = DNSRecord.parse(raw)
    assert reply.header.id == query.header.id
    return reply, time.monotonic_ns()


def client(sandbox: str, cgroup: int, source: str, allow: list[str]) -> DnsClient:
    return DnsClient(sandbox, cgroup, (source,), parse_allow(allow).domains)


async def test_register_lets_the_sandbox_reach_the_stub(stub):
    stub.register(client("sb1", 11, "127.0.0.2", []))
    assert stub.egress.learned(11) == {("127.0.0.1", stub.port, 17), ("127.0.0.1", stub.port, 6)}


async def test_an_allowed_name_is_forwarded_and_its_addresses_allowed_before_the_reply(stub):
    stub.register(client("sb1", 11, "127.0.0.2", ["allowed.test", "api.test:443/tcp"]))
    reply, arrived = await ask(stub.port, "allowed.test")
    assert reply.header.rcode == RCODE.NOERROR
    assert sorted(str(rr.rdata) for rr in reply.rr) == ["192.0.2.1", "192.0.2.2"]
    learned = [c for c in stub.egress.calls if str(c[1]).startswith("192.0.2.")]
    assert {(str(d), p, pr) for _, d, p, pr, _ in learned} == {("192.0.2.1", None, 0), ("192.0.2.2", None, 0)}
    assert all(at < arrived for *_, at in learned)
    assert (await ask(stub.port, "api.test"))[0].header.rcode == RCODE.NOERROR
    assert (await ask(stub.port, "api.test", "AAAA", tcp=True))[0].header.rcode == RCODE.NOERROR
    assert {("192.0.2.4", 443, 6), ("2001:db8::4", 443, 6)} <= stub.egress.learned(11)
    assert stub.violations == []


async def test_addresses_behind_a_cname_are_learned(stub):
    stub.register(client("sb1", 11, "127.0.0.2", ["cdn.test:80"]))
    reply, _ = await ask(stub.port, "cdn.test")
    assert [rr.rtype for rr in reply.rr] == [QTYPE.CNAME, QTYPE.A]
    assert ("192.0.2.6", 80, 0) in stub.egress.learned(11)


async def test_a_refused_name_is_a_violation(stub, upstream):
    stub.register(client("sb1", 11, "127.0.0.2", ["*.test"]))
    stub.register(client("sb2", 12, "127.0.0.3", ["allowed.test"]))
    reply, _ = await ask(stub.port, "api.test", source="127.0.0.3")
    assert reply.header.rcode == RCODE.NXDOMAIN and not reply.rr
    assert [(v.sandbox_id, v.cgroup_id, v.source, v.name, v.qtype) for v in stub.violations] == [
        ("sb2", 12, "127.0.0.3", "api.test", "A")
    ]
    assert not any(str(d) == "192.0.2.4" for _, d, *_ in stub.egress.calls)
    reply, _ = await ask(stub.port, "api.test", source="127.0.0.2")
    assert reply.header.rcode == RCODE.NOERROR, "the other sandbox's rules are its own"

    async_seen: list = []

    async def record(v):
        async_seen.append(v)

    refusing = DnsStub(FakeEgress(), upstream, record, refuse_rcode=RCODE.REFUSED)
    _, port = await refusing.start("127.0.0.1", 0)
    try:
        refusing.register(client("sb3", 13, "127.0.0.4", []))
        reply, _ = await ask(port, "allowed.test", source="127.0.0.4", tcp=True)
        await asyncio.sleep(0.01)
        assert reply.header.rcode == RCODE.REFUSED
        assert [v.name for v in async_seen] == ["allowed.test"]
    finally:
        await refusing.close()


async def test_an_unknown_source_is_refused_without_a_violation(stub):
    stub.register(client("sb1", 11, "127.0.0.2", ["allowed.test"]))
    reply, _ = await ask(stub.port, "allowed.test", source="127.0.0.9")
    assert reply.header.rcode == RCODE.REFUSED
    assert stub.violations == []
    assert await stub.answer(DNSRecord.question("allowed.test").pack(), "::ffff:127.0.0.2") is not None
    assert ("192.0.2.1", None, 0) in stub.egress.learned(11), "an IPv4-mapped source is the IPv4 one"


async def test_upstream_silence_and_a_detached_sandbox_give_servfail(stub, upstream):
    stub.register(client("sb1", 11, "127.0.0.2", ["allowed.test", "nowhere.test"]))
    stub.egress.fail = True
    reply, _ = await ask(stub.port, "allowed.test")
    assert reply.header.rcode == RCODE.SERVFAIL
    dead = DnsStub(FakeEgress(), ("127.0.0.1", 9), [].append, timeout_s=0.2)
    _, port = await dead.start("127.0.0.1", 0)
    try:
        dead.register(client("sb1", 11, "127.0.0.2", ["allowed.test"]))
        reply, _ = await ask(port, "allowed.test")  # answered (SERVFAIL), not left to the client's timeout
        assert reply.header.rcode == RCODE.SERVFAIL
    finally:
        await dead.close()


async def test_malformed_and_multi_question_queries(stub):
    stub.register(client("sb1", 11, "127.0.0.2", ["allowed.test"]))
    assert await stub.answer(b"\x00\x01garbage", "127.0.0.2") is None
    two = DNSRecord.question("allowed.test")
    two.add_question(*DNSRecord.question("api.test").questions)
    reply = DNSRecord.parse(await stub.answer(two.pack(), "127.0.0.2"))
    assert reply.header.rcode == RCODE.FORMERR


def test_register_rejects_a_source_owned_by_another_sandbox():
    stub = DnsStub(FakeEgress(), ("127.0.0.1", 53), [].append)
    stub.register(client("sb1", 11, "10.0.0.2", []))
    with pytest.raises(ValueError, match="already belongs to sandbox sb1"):
        stub.register(client("sb2", 12, "10.0.0.2", []))
    stub.register(client("sb1", 11, "10.0.0.3", []))  # re-registering replaces its sources
    stub.register(client("sb2", 12, "10.0.0.2", []))
    stub.unregister("sb2")
    stub.unregister("sb2")


def test_chain_addresses_follows_cnames_in_any_order_and_ignores_the_rest():
    reply = DNSRecord.question("www.example.test").reply()
    reply.add_answer(RR("edge.cdn.test.", QTYPE.A, rdata=A("192.0.2.7")))
    reply.add_answer(RR("mid.example.test.", QTYPE.CNAME, rdata=CNAME("edge.cdn.test.")))
    reply.add_answer(RR("WWW.example.test.", QTYPE.CNAME, rdata=CNAME("mid.example.test.")))
    reply.add_answer(RR("edge.cdn.test.", QTYPE.AAAA, rdata=AAAA("2001:db8::7")))
    reply.add_answer(RR("unrelated.test.", QTYPE.A, rdata=A("198.51.100.1")))
    assert chain_addresses("www.example.test.", reply) == [ip("192.0.2.7"), ip("2001:db8::7")]
    assert chain_addresses("other.test", reply) == []

"""The tests' "internet": a host inside a network namespace the tests made.

    python fake_internet.py '{"tcp": [["10.77.100.1", 80]], "udp": [...], "dns": [["10.77.100.53", 53]],
                              "zone": {"allowed.test": {"A": ["10.77.100.1"]}, "alias.test": {"CNAME": "allowed.test"}}}'

TCP: greets with "hello <address>:<port>" and closes. HTTP (`"http": [[host, port]]`): answers
any request with 200 and the body "hello <address>:<port> <path>". UDP: echoes "echo <data>". DNS (UDP and
TCP): answers from the zone, NXDOMAIN otherwise. Prints "ready" once everything is bound;
runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, A, DNSRecord


def answer(zone: dict, query: bytes) -> bytes:
    request = DNSRecord.parse(query)
    reply = request.reply()
    name, qtype = str(request.q.qname).rstrip(".").lower(), QTYPE[request.q.qtype]
    seen = set()
    while name in zone and name not in seen:
        seen.add(name)
        entry = zone[name]
        if "CNAME" in entry:
            reply.add_answer(RR(name + ".", QTYPE.CNAME, rdata=CNAME(entry["CNAME"] + "."), ttl=60))
            name = entry["CNAME"]
            continue
        for ip in entry.get(qtype, []):
            reply.add_answer(RR(name + ".", getattr(QTYPE, qtype), rdata=(A if qtype == "A" else AAAA)(ip), ttl=60))
        break
    else:
        if not seen:
            reply.header.rcode = RCODE.NXDOMAIN
    return reply.pack()


class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.transport.sendto(b"echo " + data, addr)


class Dns(asyncio.DatagramProtocol):
    def __init__(self, zone: dict) -> None:
        self.zone = zone

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.transport.sendto(answer(self.zone, data), addr)


async def main(config: dict) -> None:
    loop = asyncio.get_running_loop()

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("sockname")[:2]
        writer.write(f"hello {host}:{port}\n".encode())
        await writer.drain()
        writer.close()

    async def dns_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            size = int.from_bytes(await reader.readexactly(2), "big")
            reply = answer(config["zone"], await reader.readexactly(size))
            writer.write(len(reply).to_bytes(2, "big") + reply)
            await writer.drain()
        finally:
            writer.close()

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("sockname")[:2]
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            path = request.split(b" ", 2)[1].decode(errors="replace")
            body = f"hello {host}:{port} {path}\n".encode()
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError, ConnectionError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(greet, host, port) for host, port in config.get("tcp", [])]
    servers += [await asyncio.start_server(http, host, port) for host, port in config.get("http", [])]
    for host, port in config.get("udp", []):
        await loop.create_datagram_endpoint(Echo, local_addr=(host, port))
    for host, port in config.get("dns", []):
        await loop.create_datagram_endpoint(lambda: Dns(config["zone"]), local_addr=(host, port))
        servers.append(await asyncio.start_server(dns_tcp, host, port))
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))

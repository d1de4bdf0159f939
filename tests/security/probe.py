"""What a sandboxed program tries, run inside a test sandbox's cgroup and network namespace.

    python probe.py '[{"op": "tcp", "host": "10.77.100.1", "port": 80}, ...]'

Prints one JSON list: for each step {"ok", "errno", "elapsed_ms", "t_ns", "t_wall", "data"},
where t_ns is CLOCK_MONOTONIC and t_wall the wall clock just before the syscall that matters
(to time the denial record and the violation event). Only the standard library, except
`resolve` (dnslib), so it also runs under a sandbox's system python3.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

TIMEOUT_S = 3.0


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tcp(step: dict, mark) -> str:
    with socket.socket(_family(step["host"]), socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT_S)
        mark()
        s.connect((step["host"], step["port"]))
        return s.makefile().readline().strip() if step.get("read", True) else "connected"


def udp(step: dict, mark) -> str:
    with socket.socket(_family(step["host"]), socket.SOCK_DGRAM) as s:
        s.settimeout(TIMEOUT_S)
        addr = (step["host"], step["port"])
        if step.get("connect"):
            mark()
            s.connect(addr)
            s.send(b"ping")
        else:
            mark()
            s.sendto(b"ping", addr)
        return s.recv(100).decode()


def tfo(step: dict, mark) -> str:
    with socket.socket(_family(step["host"]), socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT_S)
        mark()
        s.sendto(b"x", socket.MSG_FASTOPEN, (step["host"], step["port"]))
        return "sent"


def raw_socket(step: dict, mark) -> str:
    mark()
    socket.socket(step["family"], step["type"], step.get("proto", 0)).close()
    return "created"


def resolve(step: dict, mark) -> str:
    from dnslib import DNSRecord  # the venv's

    query = DNSRecord.question(step["name"], step.get("qtype", "A"))
    mark()
    raw = query.send(step["server"], 53, tcp=step.get("tcp", False), timeout=TIMEOUT_S)
    reply = DNSRecord.parse(raw)
    from dnslib import RCODE

    addresses = [str(rr.rdata) for rr in reply.rr if rr.rtype in (1, 28)]
    return json.dumps({"rcode": RCODE[reply.header.rcode], "addresses": addresses})


def resolve_connect(step: dict, mark) -> str:
    found = json.loads(resolve({**step}, lambda: None))
    if not found["addresses"]:
        raise RuntimeError(f"no address: {found}")
    return tcp({"host": found["addresses"][0], "port": step["port"]}, mark)


def loopback(step: dict, mark) -> str:
    host = step["host"]
    with socket.socket(_family(host), socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen()
        with socket.socket(_family(host), socket.SOCK_STREAM) as client:
            mark()
            client.connect(server.getsockname()[:2])
            conn, _ = server.accept()
            conn.close()
    with socket.socket(_family(host), socket.SOCK_DGRAM) as server, socket.socket(_family(host), socket.SOCK_DGRAM) as c:
        server.bind((host, 0))
        c.sendto(b"x", server.getsockname()[:2])
        server.settimeout(TIMEOUT_S)
        return server.recv(10).decode()


def getaddrinfo(step: dict, mark) -> str:
    mark()
    infos = socket.getaddrinfo(step["name"], step.get("port", 80), socket.AF_INET, socket.SOCK_STREAM)
    return json.dumps(sorted({i[4][0] for i in infos}))


def http(step: dict, mark) -> str:
    import urllib.request

    mark()
    with urllib.request.urlopen(step["url"], timeout=TIMEOUT_S) as reply:
        return reply.read().decode()


def scan(step: dict, mark) -> str:
    """connect() to every port in [first, last] (a scan for a package mirror): port -> "open" or errno."""
    found = {}
    for port in range(step["first"], step["last"] + 1):
        with socket.socket(_family(step["host"]), socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT_S)
            if port == step["first"]:
                mark()
            try:
                s.connect((step["host"], port))
                found[port] = "open"
            except OSError as exc:
                found[port] = exc.errno
    return json.dumps(found)


def dns_from(step: dict, mark) -> str:
    """One A query by sendto()/recvfrom() (no resolver library): the reply's rcode, addresses
    and the source address recvfrom() reports."""
    name = step["name"].encode()
    query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    query += b"".join(bytes([len(label)]) + label for label in name.split(b".")) + b"\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(TIMEOUT_S)
        mark()
        s.sendto(query, (step["server"], 53))
        reply, source = s.recvfrom(4096)
    answers = int.from_bytes(reply[6:8], "big")
    addresses = [socket.inet_ntoa(reply[i + 12:i + 16]) for i in range(len(query), len(reply) - 15)
                 if reply[i:i + 2] == b"\xc0\x0c" and reply[i + 2:i + 4] == b"\x00\x01"][:answers]
    return json.dumps({"rcode": reply[3] & 0xF, "addresses": addresses, "from": list(source)})


OPS = {"dns_from": dns_from, "getaddrinfo": getaddrinfo, "http": http, "scan": scan, "tcp": tcp, "udp": udp, "tfo": tfo, "socket": raw_socket, "resolve": resolve,
       "resolve_connect": resolve_connect, "loopback": loopback}


def run(step: dict) -> dict:
    marks: list[tuple[int, float]] = []
    start = time.perf_counter()
    try:
        data = OPS[step["op"]](step, lambda: marks.append((time.monotonic_ns(), time.time())))
        result = {"ok": True, "errno": None, "data": data}
    except OSError as exc:
        result = {"ok": False, "errno": exc.errno, "data": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        result = {"ok": False, "errno": None, "data": f"{type(exc).__name__}: {exc}"}
    result["elapsed_ms"] = (time.perf_counter() - start) * 1000
    result["t_ns"], result["t_wall"] = marks[-1] if marks else (None, None)
    result["pid"] = os.getpid()
    return result


if __name__ == "__main__":
    print(json.dumps([run(step) for step in json.loads(sys.argv[1])]))

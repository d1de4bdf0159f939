"""What a sandboxed program tries, run inside a test sandbox's cgroup and network namespace.

    python probe.py '[{"op": "tcp", "host": "10.77.100.1", "port": 80}, ...]'

Prints one JSON list: for each step {"ok", "errno", "elapsed_ms", "t_ns", "data"}, where t_ns
is CLOCK_MONOTONIC just before the syscall that matters (to time the denial record).
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


OPS = {"tcp": tcp, "udp": udp, "tfo": tfo, "socket": raw_socket, "resolve": resolve,
       "resolve_connect": resolve_connect, "loopback": loopback}


def run(step: dict) -> dict:
    marks: list[int] = []
    start = time.perf_counter()
    try:
        data = OPS[step["op"]](step, lambda: marks.append(time.monotonic_ns()))
        result = {"ok": True, "errno": None, "data": data}
    except OSError as exc:
        result = {"ok": False, "errno": exc.errno, "data": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        result = {"ok": False, "errno": None, "data": f"{type(exc).__name__}: {exc}"}
    result["elapsed_ms"] = (time.perf_counter() - start) * 1000
    result["t_ns"] = marks[-1] if marks else None
    result["pid"] = os.getpid()
    return result


if __name__ == "__main__":
    print(json.dumps([run(step) for step in json.loads(sys.argv[1])]))

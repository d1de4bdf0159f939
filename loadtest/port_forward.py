"""HTTP requests per second through a port forward, against the same client inside the sandbox's
network namespace (the baseline, in the same run).

    .venv/bin/python -m loadtest.port_forward [--seconds 5] [--rounds 3] [--concurrency 16]

One `process` sandbox (host view, one CPU) runs a small asyncio HTTP/1.1 server on port 8000
answering every request with a 2-byte body. The same asyncio client (`--concurrency` workers,
each request a GET and its whole response) runs in this process two ways, one after the other
in each round: through `sb.forward(8000)` on 127.0.0.1, and with its sockets made inside the
sandbox's namespace by the node library (`linuxnode.netns.connect_inside`, the socket a tunnel's
node end uses), so the difference is the tunnel: the SDK's listener, the bus, the launcher.
Two kinds of load: `keepalive` (each worker keeps one connection: the data path) and `connect`
(a new connection per request, as HTTP/1.0 clients do: a tunnel opened and closed per request).
Medians over rounds. Needs root (the baseline enters the namespace).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import sandfleet
from linuxnode import netns
from loadtest.platform import running_platform
from loadtest.report import print_table, write_json

PORT = 8000
SERVER = """
import asyncio
async def one(r, w):
    try:
        while True:
            head = await r.readuntil(b"\\r\\n\\r\\n")
            close = b"connection: close" in head.lower()
            w.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n" + (b"Connection: close\\r\\n" if close else b"")
                    + b"\\r\\nok")
            await w.drain()
            if close:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    w.close()
async def main():
    server = await asyncio.start_server(one, "127.0.0.1", 8000, backlog=1024)
    await server.serve_forever()
asyncio.run(main())
"""
ENV = {"SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0",
       "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}
Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _response(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected response {head[:60]!r}")
    await reader.readexactly(2)


async def load(connect: Connect, keepalive: bool, seconds: float, concurrency: int) -> float:
    """Requests per second the workers completed in `seconds`."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        conn = None
        while time.perf_counter() < stop_at:
            if conn is None:
                conn = await connect()
            reader, writer = conn
            writer.write(b"GET / HTTP/1.1\r\nHost: bench\r\n" + (b"" if keepalive else b"Connection: close\r\n")
                         + b"\r\n")
            await _response(reader)
            done += 1
            if not keepalive:
                writer.close()
                conn = None
        if conn is not None:
            conn[1].close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def run(url: str, node_id: str, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    rates: dict[str, dict[str, list[float]]] = {k: {"forward": [], "netns": []} for k in ("keepalive", "connect")}
    async with sandfleet.connect(url, name="bench") as fleet:
        sb = await fleet.create(host_view=True, cpu=1.0, memory_mb=256)
        try:
            r = await sb.exec(["sh", "-c", 'python3 -c "$SERVER" </dev/null >/dev/null 2>&1 &'], env={"SERVER": SERVER})
            if r.exit_code != 0:
                raise RuntimeError(f"the server did not start: {r.stderr!r}")
            path = netns.path(node_id, sb.id)

            async def inside() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                sock = await asyncio.to_thread(netns.connect_inside, path, "127.0.0.1", PORT)
                return await asyncio.open_connection(sock=sock)

            for _ in range(100):  # it listens soon after the exec returns
                try:
                    (await inside())[1].close()
                    break
                except ConnectionRefusedError:
                    await asyncio.sleep(0.1)
            async with sb.forward(PORT) as (host, port):
                async def forwarded() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                    return await asyncio.open_connection(host, port)

                for i in range(args.rounds):
                    for kind in ("keepalive", "connect"):
                        for way, connect in (("forward", forwarded), ("netns", inside)):
                            rate = await load(connect, kind == "keepalive", args.seconds, args.concurrency)
                            rates[kind][way].append(rate)
                    print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                        f"{k} forward {v['forward'][-1]:.0f}/s netns {v['netns'][-1]:.0f}/s" for k, v in rates.items()),
                        file=sys.stderr)
        finally:
            await sb.destroy()
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/port_forward.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("port_forward: the baseline enters the sandbox's namespace: run as root", file=sys.stderr)
        return 2
    with running_platform(args.node_id, ENV) as (url, _):
        rates = asyncio.run(run(url, args.node_id, args))
    results = {kind: {way: {"median_per_s": round(statistics.median(v), 1), "rounds": [round(x, 1) for x in v]}
                      for way, v in ways.items()} for kind, ways in rates.items()}
    for kind in results:
        results[kind]["ratio"] = round(results[kind]["forward"]["median_per_s"]
                                       / results[kind]["netns"]["median_per_s"], 3)
    print_table("HTTP requests/s, 2-byte responses (medians over rounds)",
                ["load", "through the forward", "client inside the netns", "ratio"],
                [[k, v["forward"]["median_per_s"], v["netns"]["median_per_s"], v["ratio"]] for k, v in results.items()])
    params = {"seconds": args.seconds, "rounds": args.rounds, "concurrency": args.concurrency}
    out = write_json(args.out, "port_forward", params | {"out": str(args.out)}, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The bus's own ceiling for a bulk path: the same bytes, in the same chunks, with the same flow
control, between a plain nats-py requester and a plain nats-py responder through the platform's
nats-server and its auth, with no sandbox and no sandfleet code in between.

A benchmark runs it beside the platform's path (`measure`) and prints the platform's ratio to
it beside its ratio to the direct path: what of the gap is the bus (nats-server and nats-py as
they come), what is ours. Each end is a process of its own, as the client and the launcher are,
started as `python -m loadtest.bus_ceiling` (this module imports nothing of sandfleet, so
nothing of it patches nats-py there: its 32 KiB reads, its copies of each payload and its
asyncio loop are the ceiling's). The connect options (the seed signing in) come on stdin.

    up      the requester sends each chunk as a request's payload, `window` in flight, the
            responder answers each with a small ack (an upload: acked per chunk);
    down    the requester asks for chunk after chunk, `window` asks in flight, the responder
            answers each with the chunk's bytes (a download; a process's output read with
            window 1, as its long poll keeps one read in flight).
The bytes are a file's (read with pread, from the page cache once warm) or zeros (`--zero`);
neither end writes them anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass

import nats

_ACK = b"k"


@dataclass(frozen=True)
class Ceiling:
    seconds: float
    cpu_s: dict[str, float]  # requester ("client"), responder ("node"); nats-server is the caller's to read


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(at, min(chunk, size - at)) for at in range(0, size, chunk)]


class _Bytes:
    """Where the bytes come from: the file (pread of one range), or zeros of the asked length."""

    def __init__(self, path: str | None) -> None:
        self.fd = os.open(path, os.O_RDONLY) if path else -1
        self.zeros = b""

    def read(self, at: int, n: int) -> bytes:
        if self.fd >= 0:
            return os.pread(self.fd, n, at)
        if len(self.zeros) != n:
            self.zeros = bytes(n)
        return self.zeros


async def _serve(url: str, options: dict, subject: str, way: str, path: str | None) -> None:
    nc = await nats.connect(url, **options)
    source = _Bytes(path)
    done = asyncio.Event()

    async def on_msg(msg) -> None:
        if msg.data == b"end":
            await msg.respond(_ACK)
            done.set()
        elif way == "up":
            await msg.respond(_ACK)
        else:
            at, n = map(int, msg.data.split(b" "))
            await msg.respond(source.read(at, n))

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    print("ready", flush=True)
    await done.wait()
    await nc.drain()


async def _ask(url: str, options: dict, subject: str, way: str, path: str | None, size: int, chunk: int,
               window: int) -> float:
    nc = await nats.connect(url, **options)
    source = _Bytes(path)
    ranges = _chunks(size, chunk)
    got = 0

    async def one(at: int, n: int) -> None:
        nonlocal got
        if way == "up":
            reply = await nc.request(subject, source.read(at, n), timeout=60)
            assert reply.data == _ACK
            got += n
        else:
            reply = await nc.request(subject, f"{at} {n}".encode(), timeout=60)
            got += len(reply.data)

    t0 = time.perf_counter()
    inflight: set[asyncio.Task] = set()
    for at, n in ranges:
        while len(inflight) >= window:
            done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        inflight.add(asyncio.ensure_future(one(at, n)))
    for task in asyncio.as_completed(inflight):
        await task
    seconds = time.perf_counter() - t0
    assert got == size, f"{got} of {size} bytes"
    await nc.request(subject, b"end", timeout=60)
    await nc.drain()
    return seconds


def _cpu_of(usage: resource.struct_rusage) -> float:
    return round(usage.ru_utime + usage.ru_stime, 2)


def _start(role: str, options: dict, argv: list[str]) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-m", "loadtest.bus_ceiling", role, *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    child.stdin.write(json.dumps(options))  # type: ignore[union-attr]  # the seed: never on a command line
    child.stdin.close()  # type: ignore[union-attr]
    return child


def measure(url: str, options: dict, way: str, size: int, chunk: int, window: int, path: str | None = None) -> Ceiling:
    """Move `size` bytes `way` ("up" or "down") in `chunk`-byte messages, `window` in flight
    (blocking: run it in a thread). `options` are what `nats.connect` takes to sign in
    (sandfleet.credentials.connect_options): strings only."""
    subject = f"bench.ceiling.{secrets.token_hex(4)}"
    common = [url, subject, way, "--size", str(size), "--chunk", str(chunk), "--window", str(window)]
    if path:
        common += ["--path", path]
    server = _start("serve", options, common)
    try:
        assert server.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        client = _start("ask", options, common)
        out = client.stdout.read()  # type: ignore[union-attr]
        _, status, client_use = os.wait4(client.pid, 0)
        client.returncode = os.waitstatus_to_exitcode(status)
        if client.returncode != 0:
            raise RuntimeError(f"bus ceiling requester failed ({client.returncode})")
        _, status, server_use = os.wait4(server.pid, 0)
        server.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if server.returncode is None:
            server.kill()
            server.wait()
    return Ceiling(json.loads(out)["seconds"], {"client": _cpu_of(client_use), "node": _cpu_of(server_use)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["serve", "ask"])
    ap.add_argument("url")
    ap.add_argument("subject")
    ap.add_argument("way", choices=["up", "down"])
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--path")
    args = ap.parse_args()
    options = json.loads(sys.stdin.read() or "{}")
    if args.role == "serve":
        asyncio.run(_serve(args.url, options, args.subject, args.way, args.path))
    else:
        seconds = asyncio.run(_ask(args.url, options, args.subject, args.way, args.path, args.size, args.chunk,
                                   args.window))
        print(json.dumps({"seconds": seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`sandfleet top` (live CPU and memory of every sandbox of the fleet, or of one node) and
`sandfleet set-timeout ID SECONDS`. `top` asks each node once per refresh for all of its
sandboxes (`node_metrics`); CPU % is the CPU time a sandbox used between two refreshes. It ends
quietly on Ctrl-C and on a closed pipe (`sandfleet top | head`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

from sandfleet import _health, client
from schemas.health import SandboxMetrics

CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase the screen


def register(sub: argparse._SubParsersAction) -> None:
    bus = argparse.ArgumentParser(add_help=False)
    bus.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")

    top = sub.add_parser("top", parents=[bus], help="live per-sandbox CPU and memory of the fleet or of one node")
    top.add_argument("--node", default=None, help="only this node's sandboxes")
    top.add_argument("--interval", type=_positive, default=2.0, help="seconds between refreshes (default 2)")
    top.add_argument("--count", "-n", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")
    top.set_defaults(func=_quietly(_top))

    st = sub.add_parser("set-timeout", parents=[bus], help="end a sandbox SECONDS from now (later or sooner)")
    st.add_argument("id")
    st.add_argument("seconds", type=float)
    st.set_defaults(func=_quietly(_set_timeout))


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


def _quietly(command: Callable[[client.Fleet, argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> int:
            async with client.connect(args.nats, name="sandfleet-cli") as fleet:
                return await command(fleet, args)

        try:
            return asyncio.run(go())
        except KeyboardInterrupt:
            return 0
        except BrokenPipeError:
            # The reader went away (`| head`): say nothing, and keep the interpreter's own flush at
            # exit from failing again on the closed pipe.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return run


async def _set_timeout(fleet: client.Fleet, args: argparse.Namespace) -> int:
    sb = await fleet.sandbox(args.id)
    record = await sb.set_timeout(args.seconds)
    print(f"{record.id} ends at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record.deadline))} "
          f"(in {record.deadline - time.time():.0f} s)")
    return 0


async def _top(fleet: client.Fleet, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    before: dict[str, SandboxMetrics] = {}
    shown = 0
    while True:
        found = await _health.fleet_metrics(fleet, args.node)
        frame = render(found, before)
        sys.stdout.write((CLEAR if tty else ("\n" if shown else "")) + frame)
        sys.stdout.flush()
        before = {m.sandbox_id: m for _, m in found}
        shown += 1
        if args.count and shown >= args.count:
            return 0
        await asyncio.sleep(args.interval)


def render(found: list[tuple[str, SandboxMetrics]], before: dict[str, SandboxMetrics]) -> str:
    """One frame: a header line, then a line per sandbox (CPU % from the previous frame's reading)."""
    lines = [f"{time.strftime('%H:%M:%S')}  {len(found)} sandboxes",
             f"{'SANDBOX':<24} {'NODE':<16} {'CPU%':>6} {'CPU-S':>8} {'MEM':>9} {'PEAK':>9} {'LIMIT':>9} "
             f"{'DISK':>9} {'PROCS':>5} {'RX':>9} {'TX':>9}"]
    for node, m in found:
        prev = before.get(m.sandbox_id)
        if prev is not None and m.at > prev.at and m.cpu_s >= 0 and prev.cpu_s >= 0:
            cpu = f"{100 * (m.cpu_s - prev.cpu_s) / (m.at - prev.at):6.1f}"
        else:
            cpu = f"{'-':>6}"
        lines.append(f"{m.sandbox_id:<24} {node:<16} {cpu} {m.cpu_s:8.2f} {_size(m.memory_bytes):>9} "
                     f"{_size(m.memory_peak_bytes):>9} {_size(m.memory_limit_bytes):>9} {_size(m.disk_bytes):>9} "
                     f"{m.processes:>5} {_size(m.rx_bytes):>9} {_size(m.tx_bytes):>9}")
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    if n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)

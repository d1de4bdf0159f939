"""`sandfleet exec` (streamed), `sandfleet logs ID PID [--follow]` and `sandfleet ps ID`: a
sandbox's commands and background processes from the CLI. Output goes to the terminal as the
command writes it; a closed pipe (`| head`) ends the CLI quietly (the command in the sandbox
runs on to its end or timeout)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import BinaryIO

from sandfleet import client


class _PipeClosed(Exception):
    """Whoever reads our output is gone."""


def _writer(stream: BinaryIO):  # type: ignore[no-untyped-def]
    def write(data: bytes) -> None:
        try:
            stream.write(data)
            stream.flush()
        except BrokenPipeError:
            raise _PipeClosed() from None

    return write


def _quietly_closed() -> int:
    """stdout's reader went away: point it at /dev/null so the interpreter's final flush is quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def _run(args: argparse.Namespace, body) -> int:  # type: ignore[no-untyped-def]
    async def run() -> int:
        async with client.connect(args.nats, name="sandfleet-cli") as fleet:
            return await body(fleet)

    try:
        return asyncio.run(run())
    except _PipeClosed:
        return _quietly_closed()


def exec_(args: argparse.Namespace, argv: list[str]) -> int:
    """Run argv, its output streamed as it comes; exit with its code."""

    async def body(fleet: client.Fleet) -> int:
        sb = await fleet.sandbox(args.id)
        r = await sb.exec(argv, timeout_s=args.timeout_s, on_stdout=_writer(sys.stdout.buffer),
                          on_stderr=_writer(sys.stderr.buffer))
        if r.timed_out:
            print(f"sandfleet exec: timed out after {args.timeout_s:g}s", file=sys.stderr)
        return r.exit_code if 0 <= r.exit_code < 256 else 1

    return _run(args, body)


def register(sub: argparse._SubParsersAction) -> None:
    logs = sub.add_parser("logs", help="print a background process's output (all the node still holds)")
    logs.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    logs.add_argument("id")
    logs.add_argument("pid", type=int)
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the process ends")
    logs.set_defaults(func=_logs)


def _logs(args: argparse.Namespace) -> int:
    async def body(fleet: client.Fleet) -> int:
        sb = await fleet.sandbox(args.id)
        out, err = _writer(sys.stdout.buffer), _writer(sys.stderr.buffer)
        async for chunk in sb.process(args.pid).output(follow=args.follow):
            if chunk.dropped:
                print(f"sandfleet logs: {chunk.dropped} earlier bytes were dropped by the node's buffer",
                      file=sys.stderr)
            (out if chunk.stream == "stdout" else err)(chunk.data)
        return 0

    return _run(args, body)


def ps(args: argparse.Namespace) -> int:
    """`sandfleet ps ID`: the sandbox's background processes."""

    async def body(fleet: client.Fleet) -> int:
        sb = await fleet.sandbox(args.id)
        now = time.time()
        print(f"{'PID':>6} {'OS PID':>7} {'STATE':<14} {'AGE':>7} {'OUTPUT':>9}  COMMAND")
        for p in await sb.processes():
            state = "running" if p.exit is None else (f"signal {p.exit.signal}" if p.exit.signal
                                                      else f"exit {p.exit.exit_code}")
            print(f"{p.pid:>6} {p.os_pid or '-':>7} {state:<14} {now - p.started_at:>6.0f}s {p.written:>9}  "
                  f"{' '.join(p.argv)}")
        return 0

    return _run(args, body)

"""Streaming exec and shell sessions against their baseline, side by side in one run.

    .venv/bin/python -m loadtest.streaming [--rounds 200]

- first byte: a command in a host-view `process` sandbox sleeps a moment (so the reader is
  already waiting, as it is for any command that has run a while), then writes the time of
  its write (`date +%s.%N`, the same clock as the client's: one kernel). Streamed, the latency
  is from that write to the callback that gets the byte; the baseline is the same command's
  plain exec, from the write to its reply.
- shell round trip: `sh.run("true")` in one shell session against `sb.exec(["true"])`.
Latency is measured by the client (the SDK), so it includes every bus round trip a trainer sees.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import sandfleet
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json

ENV = {"SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0",
       "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}
WRITE_AFTER = ["sh", "-c", "sleep 0.02; date +%s.%N"]
OPS = ("first_byte_streamed", "first_byte_plain_exec", "shell_run_true", "exec_true")


async def first_byte_streamed(sb: sandfleet.Sandbox) -> float:
    got: list[float] = []

    def on_stdout(data: bytes) -> None:
        if not got:
            got.append(time.time())
            got.append(float(data.split()[0]))

    await sb.exec(WRITE_AFTER, on_stdout=on_stdout)
    return (got[0] - got[1]) * 1000


async def first_byte_plain(sb: sandfleet.Sandbox) -> float:
    r = await sb.exec(WRITE_AFTER)
    return (time.time() - float(r.stdout.split()[0])) * 1000


async def timed(op) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    await op()
    return (time.perf_counter() - t0) * 1000


async def run(url: str, rounds: int) -> dict[str, list[float]]:
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    async with sandfleet.connect(url, name="bench") as fleet:
        sb = await fleet.create(memory_mb=256, host_view=True, labels={"bench": "streaming"})
        try:
            sh = await sb.shell()
            for _ in range(3):  # warm both paths up
                await first_byte_streamed(sb), await first_byte_plain(sb), await sh.run("true")
            for i in range(rounds):  # interleaved, so load on the machine falls on both sides alike
                lat["first_byte_streamed"].append(await first_byte_streamed(sb))
                lat["first_byte_plain_exec"].append(await first_byte_plain(sb))
                lat["shell_run_true"].append(await timed(lambda: sh.run("true")))
                lat["exec_true"].append(await timed(lambda: sb.exec(["true"])))
                if (i + 1) % 50 == 0:
                    print(f"round {i + 1}/{rounds}", file=sys.stderr)
            await sh.close()
        finally:
            await sb.destroy()
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/streaming.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("streaming: sandboxes need root", file=sys.stderr)
        return 2
    with running_platform(args.node_id, ENV) as (url, _):
        lat = asyncio.run(run(url, args.rounds))
    results = {op: {**percentiles(lat[op]), "n": len(lat[op]), "max": round(max(lat[op]), 2)} for op in OPS}
    print_table("streaming exec and shell sessions vs their baselines (ms, measured by the client)",
                ["op", "n", "p50", "p99", "max"],
                [[op, results[op]["n"], results[op]["p50"], results[op]["p99"], results[op]["max"]] for op in OPS])
    out = write_json(args.out, "streaming", {"rounds": args.rounds, "out": str(args.out)}, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Stream throughput: a command's output to a client over the bus vs the node reading it directly.

    .venv/bin/python -m loadtest.stream_throughput [--mb 1024] [--rounds 3]

The command is `head -c <mb>M /dev/zero` in a host-view `process` sandbox. Each round, in an
order that alternates, three sides:
  exec     `sb.exec(argv, on_stdout=cb)`: a streamed exec, every chunk handed to the callback;
  output   `proc = await sb.spawn(argv)` then `async for out in proc.output()`;
  direct   what the node could do with no bus: `nsenter --target <init> --all` (the node entering
           the sandbox's namespaces) running the same command into a pipe the benchmark reads
           with os.read in pieces of 1 MiB;
  bus      the bus's own ceiling (loadtest/bus_ceiling.py): as many bytes (zeros) in replies of
           MAX_READ_BYTES, one ask in flight (a reader's long poll keeps one read in flight),
           between a plain nats-py requester and responder through the same nats-server and
           auth: no sandbox, no sandfleet code.
Figures are medians over rounds in MB/s (10^6 bytes of output per second, from the request to
the last byte), as a ratio of direct and of bus; `dropped` counts bytes the node's buffer
dropped (0: the reader held the command back instead); `reply KiB` the mean output a read
reply carried (the platform's) or the ceiling's chunk; CPU seconds per side as in
loadtest/file_transfer.py (client, launcher, nats-server; the direct side's nsenter and head
are its reaped children, under `children`; the ceiling's ends are "client" and "node").
The issue's target: >= 200 MB/s and >= 0.5 of direct.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sandfleet
from loadtest import bus_ceiling
from loadtest.file_transfer import CpuMeter, median_cpu
from sandfleet import credentials
from schemas import process as proc
from loadtest.platform import running_platform
from loadtest.report import print_table, write_json

ENV = {"SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0",
       "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}
SIDES = ("exec", "output", "direct", "bus")


async def via_exec(sb: sandfleet.Sandbox, argv: list[str]) -> tuple[int, int, int]:
    """(bytes, dropped, callbacks: each a read reply's one span here)."""
    got = [0, 0]

    def on_stdout(data: bytes) -> None:
        got[0] += len(data)
        got[1] += 1

    r = await sb.exec(argv, on_stdout=on_stdout, timeout_s=600)
    assert r.exit_code == 0, r.stderr
    return got[0], 0, got[1]


async def via_output(sb: sandfleet.Sandbox, argv: list[str]) -> tuple[int, int, int]:
    process = await sb.spawn(argv, buffer_bytes=16 << 20)
    got = dropped = outputs = 0
    async for out in process.output():
        got += len(out.data)
        dropped += out.dropped
        outputs += 1
    return got, dropped, outputs


def _direct(init_pid: int, argv: list[str]) -> int:
    reader = subprocess.Popen(["nsenter", "--target", str(init_pid), "--all", *argv], stdout=subprocess.PIPE)
    fd, got = reader.stdout.fileno(), 0  # type: ignore[union-attr]
    while data := os.read(fd, 1 << 20):
        got += len(data)
    assert reader.wait() == 0
    return got


async def via_direct(init_pid: int, argv: list[str]) -> tuple[int, int, int]:
    return await asyncio.to_thread(_direct, init_pid, argv), 0, 0


async def via_bus(url: str, want: int) -> tuple[int, int, int, dict[str, float]]:
    got = await asyncio.to_thread(bus_ceiling.measure, url, credentials.connect_options(url), "down", want,
                                  proc.MAX_READ_BYTES, 1)
    return want, 0, -(-want // proc.MAX_READ_BYTES), got.cpu_s


async def run(url: str, args: argparse.Namespace, data_dir: Path) -> dict:
    cpu = CpuMeter(data_dir)
    cpus: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    argv = ["head", "-c", f"{args.mb}M", "/dev/zero"]
    want = args.mb << 20
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    dropped: dict[str, int] = {s: 0 for s in SIDES}
    replies: dict[str, list[int]] = {s: [] for s in SIDES}
    async with sandfleet.connect(url, name="bench") as fleet:
        sb = await fleet.create(memory_mb=256, host_view=True, timeout_s=3600, labels={"bench": "stream"})
        try:
            init_pid = (await sb.info()).init_pid
            for rnd in range(args.rounds):
                for side in SIDES if rnd % 2 == 0 else tuple(reversed(SIDES)):
                    c0 = cpu.read()
                    t0 = time.perf_counter()
                    ends: dict[str, float] = {}
                    if side == "exec":
                        got, lost, n = await via_exec(sb, argv)
                    elif side == "output":
                        got, lost, n = await via_output(sb, argv)
                    elif side == "bus":
                        got, lost, n, ends = await via_bus(url, want)
                    else:
                        got, lost, n = await via_direct(init_pid, argv)
                    times[side].append(time.perf_counter() - t0)
                    used = CpuMeter.spent(c0, cpu.read())
                    if ends:
                        used.pop("children", None)  # the ceiling's two ends, by name
                    cpus[side].append(used | ends)
                    replies[side].append(n)
                    assert got + lost == want, f"{side}: {got} + {lost} dropped of {want} bytes"
                    dropped[side] += lost
                print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr)
        finally:
            await sb.destroy()
    direct, bus = statistics.median(times["direct"]), statistics.median(times["bus"])
    return {side: {"mb_s": round(want / statistics.median(times[side]) / 1e6, 1),
                   "ratio": round(direct / statistics.median(times[side]), 3),
                   "of_bus": round(bus / statistics.median(times[side]), 3),
                   "reply_kib": round(want / statistics.median(replies[side]) / 1024, 1) if replies[side][0] else 0.0,
                   "median_s": round(statistics.median(times[side]), 3),
                   "rounds_s": [round(t, 3) for t in times[side]], "dropped": dropped[side],
                   "cpu_s": median_cpu(cpus[side])} for side in SIDES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", f"bench-stream-{os.getpid()}"))
    ap.add_argument("--out", type=Path, default=Path("results/stream_throughput.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("stream_throughput: sandboxes need root", file=sys.stderr)
        return 2
    with running_platform(args.node_id, ENV) as (url, data_dir):
        results = asyncio.run(run(url, args, data_dir))
    print_table(f"stream throughput of head -c {args.mb}M /dev/zero (host-view process, medians of {args.rounds})",
                ["side", "MB/s", "of direct", "of bus", "reply KiB", "median s", "dropped bytes", "CPU-s"],
                [[side, r["mb_s"], r["ratio"], r["of_bus"], r["reply_kib"], r["median_s"], r["dropped"],
                  " ".join(f"{k} {v}" for k, v in r["cpu_s"].items())] for side, r in results.items()])
    print(f"\nwrote {write_json(args.out, 'stream_throughput', vars(args) | {'out': str(args.out)}, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

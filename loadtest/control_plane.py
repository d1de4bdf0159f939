"""Control-plane benchmark on SIMULATED nodes: placements/s, request → running latency, a gang batch.

    .venv/bin/python -m loadtest.control_plane [--nodes 160] [--n 20000] [--batch 100]
        [--concurrency 8] [--gang 32000] [--replicas 1] [--min-share 16] [--simnode-procs 1]

A private nats-server and `--replicas` real placement processes; `--nodes` simulated nodes
(loadtest/simnode.py: they register and heartbeat, take launches and write their records'
`starting`/`running` transitions and events after a modelled 5-20 ms, and create nothing),
in `--simnode-procs` processes of their own, apart from this one (the trainer's SDK).
Three measurements, side by side in one run:
  1. raw NATS request/reply on the same machine (an echo responder, same concurrency);
  2. steady creation: batches of `--batch` via `create_many`, `--concurrency` in flight, until
     `--n` sandboxes run; placements/s and latency from the request until the SDK knows each one
     started (its `started` event, through the SDK's progress calls);
  3. one gang batch of `--gang` sandboxes on fresh nodes: time until placement has answered
     (every sandbox placed and recorded) and until every one is running.
Each phase also reports the CPU seconds the bus server, placement, the simulated nodes and
the SDK spent on it (on a shared machine rates move with the neighbours, CPU cost much less),
and the bus traffic per sandbox: messages into and out of the server, JetStream API requests,
messages stored.
SANDFLEET_PROFILE_PLACEMENT=/tmp/p.prof writes a cProfile of the first placement replica,
SANDFLEET_PROFILE_SIMNODES=/tmp/s.prof one of each simulated-node process (`/tmp/s.prof.<first>`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import sandfleet
from linuxnode import procfs
from loadtest.report import percentiles, print_table, write_json
from loadtest.simnode import ControlPlane
from sandfleet.bus import Bus


async def raw_request_reply(url: str, n: int, concurrency: int) -> dict:
    server, client = await Bus.connect(url, "echo-server"), await Bus.connect(url, "echo-client")

    async def echo(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(msg.data)

    await server.nc.subscribe("bench.echo", cb=echo)
    await server.nc.flush()  # the server has the subscription before the first request
    payload = b"x" * 256
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.nc.request("bench.echo", payload, timeout=10)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await client.close()
    await server.close()
    return {"requests": n, "concurrency": concurrency, "per_s": round(n / elapsed)}


async def steady(fleet: sandfleet.Fleet, n: int, batch: int, concurrency: int) -> dict:
    latencies: list[float] = []
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            k = min(batch, left)
            left -= k
            sent, seen = time.perf_counter(), 0

            def progress(p) -> None:  # type: ignore[no-untyped-def]
                # Each sandbox's latency: until the SDK knows it started (the call after its
                # `started` event). The SDK's own watch, not one of this benchmark's: a second
                # subscription would cost the bus a second delivery of every started event.
                nonlocal seen
                latencies.extend([(time.perf_counter() - sent) * 1000] * (p.running - seen))
                seen = p.running

            await fleet.create_many(k, memory_mb=64, cpu=0.1, request_timeout_s=120, progress=progress)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"sandboxes": n, "batch": batch, "concurrency": concurrency, "elapsed_s": round(elapsed, 2),
            "placements_per_s": round(n / elapsed), "latency_ms": percentiles(latencies)}


async def gang(fleet: sandfleet.Fleet, n: int, meter: CpuMeter) -> dict:
    placed_at: list[float] = []
    cpu_at_start, cpu_placed = meter.now(), {}

    def progress(p) -> None:  # type: ignore[no-untyped-def]
        if not placed_at and p.placed == n:
            placed_at.append(time.perf_counter())
            cpu_placed.update(meter.since(cpu_at_start))

    start = time.perf_counter()
    boxes = await fleet.create_many(n, memory_mb=64, cpu=0.1, request_timeout_s=600, progress=progress)
    running = time.perf_counter() - start
    return {"sandboxes": len(boxes), "placed_s": round(placed_at[0] - start, 3), "all_running_s": round(running, 3),
            "cpu_s_until_placed": cpu_placed}


def _cpu_s(pid: int) -> float:
    stat = procfs.read_stat(pid)
    if stat is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return (stat.utime + stat.stime) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds each process of the run spent in a phase: the bus server, the placement
    replicas, and this process (every simulated node and the SDK). On a shared, noisy machine
    the rates move with the neighbours; the CPU a phase costs does much less."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.pids = {"nats_server": [cp.server_pid], "placement": cp.placement_pids, "simnodes": cp.simnode_pids}

    def now(self) -> dict[str, float]:
        now = {k: sum(_cpu_s(p) for p in pids) for k, pids in self.pids.items()}
        t = os.times()
        return now | {"sdk": t.user + t.system}

    def since(self, before: dict[str, float]) -> dict[str, float]:
        after = self.now()
        return {k: round(after[k] - before[k], 2) for k in before}

    async def measure(self, phase, sandboxes: int):  # type: ignore[no-untyped-def]
        """`phase`'s result, with its CPU seconds and the bus traffic it made per sandbox: messages
        into and out of the server, JetStream API requests, messages stored."""
        before, counts = self.now(), self.cp.server_counts()
        result = await phase
        result["cpu_s"] = self.since(before)
        after = self.cp.server_counts()
        result["bus_per_sandbox"] = {k: round((after[k] - counts[k]) / sandboxes, 2) for k in counts}
        return result


async def run(args: argparse.Namespace) -> dict:
    cp = await ControlPlane(replicas=args.replicas, env={"SANDFLEET_PLACEMENT_MIN_SHARE": str(args.min_share)}).start()
    try:
        raw = await raw_request_reply(cp.url, args.raw_n, args.raw_concurrency)
        setup_bus = await Bus.connect(cp.url, "bench-setup")
        await cp.wait_for_replicas(setup_bus, timeout=60)
        await setup_bus.close()
        per_node = max(args.capacity, (args.n + args.gang) // args.nodes + 1)
        shares = [args.nodes // args.simnode_procs + (i < args.nodes % args.simnode_procs) for i in range(args.simnode_procs)]
        for i, k in enumerate(shares):
            cp.add_simnodes(k, per_node, first=sum(shares[:i]))
        await asyncio.sleep(1.0)  # every replica has heard every node
        async with sandfleet.connect(cp.url) as fleet:
            results = {"raw_request_reply": raw, "nodes": args.nodes, "simnode_processes": args.simnode_procs,
                       "placement_replicas": args.replicas}
            meter = CpuMeter(cp)
            if args.n:
                results["steady"] = await meter.measure(steady(fleet, args.n, args.batch, args.concurrency), args.n)
            if args.gang:
                results["gang"] = await meter.measure(gang(fleet, args.gang, meter), args.gang)
        return results
    finally:
        cp.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=160, help="simulated nodes")
    ap.add_argument("--capacity", type=int, default=2000, help="sandbox slots per simulated node")
    ap.add_argument("--n", type=int, default=20000, help="sandboxes in the steady phase (0: skip)")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8, help="create_many calls in flight")
    ap.add_argument("--gang", type=int, default=32000, help="sandboxes in the gang batch (0: skip)")
    ap.add_argument("--replicas", type=int, default=1, help="placement processes")
    ap.add_argument("--simnode-procs", type=int, default=1, help="processes the simulated nodes are spread over")
    ap.add_argument("--min-share", type=int, default=16,
                    help="placement's SANDFLEET_PLACEMENT_MIN_SHARE: least sandboxes per node per batch (1: spread over all)")
    ap.add_argument("--raw-n", type=int, default=20000)
    ap.add_argument("--raw-concurrency", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("results/control_plane.json"))
    args = ap.parse_args()
    results = asyncio.run(run(args))
    rows = [["raw NATS request/reply (echo)", results["raw_request_reply"]["per_s"], "", "", ""]]
    if "steady" in results:
        s = results["steady"]
        rows.append([f"create_many x{s['batch']}, {s['concurrency']} in flight, {s['sandboxes']} sandboxes",
                     s["placements_per_s"], s["latency_ms"]["p50"], s["latency_ms"]["p99"], ""])
    if "gang" in results:
        g = results["gang"]
        rows.append([f"gang batch of {g['sandboxes']}", "", "", "", f"placed {g['placed_s']} s, running {g['all_running_s']} s"])
        rows.append(["  (until placed)", "", "", "", ""])
    cpus = [results[k]["cpu_s"] for k in ("steady", "gang") if k in results]
    if "gang" in results:
        cpus.append(results["gang"]["cpu_s_until_placed"])
    for row, cpu in zip(rows[1:], cpus):
        row.append(" / ".join(f"{cpu[k]:g}" for k in ("nats_server", "placement", "simnodes", "sdk")))
    rows[0].append("")
    print_table(f"control plane on {results['nodes']} SIMULATED nodes, {results['placement_replicas']} placement replica(s)",
                ["what", "per s", "p50 ms", "p99 ms", "gang", "CPU s: nats / placement / simnodes / SDK"], rows)
    print(f"raw request/reply in the same run: {results['raw_request_reply']['per_s']}/s; steady placements are "
          f"{results['steady']['placements_per_s'] / results['raw_request_reply']['per_s']:.2f} of it"
          if "steady" in results else "")
    for phase in ("steady", "gang"):
        if phase in results:
            print(f"{phase}, bus traffic per sandbox: " + ", ".join(
                f"{k} {v:g}" for k, v in results[phase]["bus_per_sandbox"].items()))
    print(f"written to {write_json(args.out, 'control_plane', vars(args) | {'out': str(args.out)}, results)}")


if __name__ == "__main__":
    main()

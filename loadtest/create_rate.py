"""Create → exec `true` → destroy cycles: the platform end to end, beside the same isolation done directly.

    .venv/bin/python -m loadtest.create_rate [--n 300] [--concurrency 8] [--rounds 3]

The platform side is `sandfleet up` on a free port with the SDK driving it. The direct side
(the floor) calls the very same kernel library in one process with no bus and no
services: cgroups, netns, init, exec, kill, release. Rounds alternate between the two so
both see the same machine noise; cycles/s is the median over rounds, latencies pool all.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sandfleet
from loadtest.report import percentiles, print_table, write_json
from linuxnode import cgroups, netns, process
from sandfleet.config import free_port

BENCH_NODE = "bench-direct"


class PlatformSide:
    """Through the bus: the SDK asks placement, the launcher, the node agent."""

    def __init__(self, fleet: sandfleet.Fleet) -> None:
        self.fleet = fleet

    async def create(self, i: int) -> sandfleet.Sandbox:
        return await self.fleet.create(memory_mb=64, cpu=0.5, host_view=True)

    async def exec_true(self, sb: sandfleet.Sandbox) -> int:
        return (await sb.exec(["true"])).exit_code

    async def destroy(self, sb: sandfleet.Sandbox) -> None:
        await sb.destroy()


class DirectSide:
    """The floor: the same kernel library called in this process, no bus, no services. Its
    sandboxes' roots are host uid `id_host` (linuxnode.userns; 0: the host's root)."""

    def __init__(self, offset: int, id_host: int = 0) -> None:
        self.layout = cgroups.CgroupLayout.detect()
        self.offset = offset
        self.id_host = id_host

    async def create(self, i: int) -> tuple[str, cgroups.SandboxCgroups, process.InitProcess]:
        sid = f"direct-{self.offset + i}"
        group = cgroups.SandboxCgroups(self.layout, BENCH_NODE, sid)
        group.create(cpu=0.5, memory_mb=64, pids=512)
        ns = netns.create(BENCH_NODE, sid)
        spec = process.ProcessSpec(sandbox_id=sid, cgroup_procs=group.procs_files, netns=ns,
                                   tmp_size_mb=32, workspace_size_mb=128, id_host=self.id_host)
        return sid, group, await process.start_async(spec)

    async def exec_true(self, box: tuple) -> int:
        _, group, init = box
        return (await process.exec(init, ["true"], cgroup_procs=group.procs_files)).exit_code

    async def destroy(self, box: tuple) -> None:
        sid, group, init = box
        await process.kill_async(init)
        await asyncio.to_thread(group.remove)
        netns.remove(BENCH_NODE, sid)


async def run_round(side, n: int, concurrency: int) -> tuple[float, dict[str, list[float]]]:  # type: ignore[no-untyped-def]
    lat: dict[str, list[float]] = {"create": [], "exec": [], "destroy": []}
    gate = asyncio.Semaphore(concurrency)

    async def cycle(i: int) -> None:
        async with gate:
            t0 = time.perf_counter()
            box = await side.create(i)
            t1 = time.perf_counter()
            code = await side.exec_true(box)
            t2 = time.perf_counter()
            await side.destroy(box)
            t3 = time.perf_counter()
            assert code == 0, code
            lat["create"].append((t1 - t0) * 1000)
            lat["exec"].append((t2 - t1) * 1000)
            lat["destroy"].append((t3 - t2) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(cycle(i) for i in range(n)))
    return n / (time.perf_counter() - start), lat


async def platform_round(url: str, n: int, concurrency: int) -> tuple[float, dict[str, list[float]]]:
    async with sandfleet.connect(url, name="bench") as fleet:
        return await run_round(PlatformSide(fleet), n, concurrency)


async def direct_round(n: int, concurrency: int, offset: int) -> tuple[float, dict[str, list[float]]]:
    side = DirectSide(offset)
    try:
        return await run_round(side, n, concurrency)
    finally:
        cgroups.remove_node_root(side.layout, BENCH_NODE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=300, help="cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/create_rate.json"))
    args = ap.parse_args()

    cli = [sys.executable, "-m", "sandfleet.cli"]
    rates: dict[str, list[float]] = {"platform": [], "direct": []}
    lat: dict[str, dict[str, list[float]]] = {s: {"create": [], "exec": [], "destroy": []} for s in rates}
    with tempfile.TemporaryDirectory(prefix="sandfleet-bench-") as tmp:
        up = subprocess.run([*cli, "up", "--detach", "--port", str(free_port()), "--data-dir", tmp],
                            capture_output=True, text=True, env={**__import__("os").environ,
                                                                  "SANDFLEET_LOG_LEVEL": "WARNING"})
        if up.returncode != 0:
            print(up.stderr, file=sys.stderr)
            return 1
        url = up.stdout.strip()
        try:
            asyncio.run(platform_round(url, min(20, args.n), args.concurrency))  # warm-up, not counted
            for r in range(args.rounds):
                for side in ("platform", "direct"):
                    if side == "platform":
                        rate, got = asyncio.run(platform_round(url, args.n, args.concurrency))
                    else:
                        rate, got = asyncio.run(direct_round(args.n, args.concurrency, r * args.n))
                    rates[side].append(rate)
                    for k, v in got.items():
                        lat[side][k].extend(v)
                    print(f"round {r + 1}/{args.rounds} {side:<8} {rate:7.1f} cycles/s", flush=True)
        finally:
            subprocess.run([*cli, "down", "--data-dir", tmp], capture_output=True)
        process.shutdown()

    results = {
        side: {
            "cycles_per_s": round(statistics.median(rates[side]), 1),
            "rounds_cycles_per_s": [round(x, 1) for x in rates[side]],
            **{k: percentiles(v) for k, v in lat[side].items()},
        }
        for side in rates
    }
    results["ratio_platform_over_direct"] = round(results["platform"]["cycles_per_s"] / results["direct"]["cycles_per_s"], 3)
    rows = [
        [side, results[side]["cycles_per_s"], *(results[side][k][p] for k in ("create", "exec", "destroy") for p in ("p50", "p99"))]
        for side in ("platform", "direct")
    ]
    print_table(
        f"create → exec true → destroy, n={args.n} x {args.rounds} rounds, concurrency {args.concurrency} (ms)",
        ["side", "cycles/s", "create p50", "create p99", "exec p50", "exec p99", "destroy p50", "destroy p99"],
        rows,
    )
    print(f"ratio platform/direct: {results['ratio_platform_over_direct']}")
    out = write_json(args.out, "create_rate", vars(args) | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak node memory of N idle agent sandboxes, reclamation off vs on, side by side in one run.

    .venv/bin/python -m loadtest.memory_reclaim [--n 500] [--ramp-s 300] [--hold-s 60]

Each sandbox (`process`, host view) runs the same Python agent loop: it imports a few standard
modules, holds the same data as every other agent (a seeded pseudo-random blob: identical
across sandboxes, incompressible) and its own history (small private objects), and sleeps,
waking briefly every few seconds. Sandboxes arrive evenly over `--ramp-s`, as a rollout's do,
then all are held `--hold-s`. Both sides are a fresh `sandfleet up` with the same short idle
and merge windows; the off side runs the reclaimer with SANDFLEET_RECLAIM=off (it only
watches: no KSM, no zram, no page-out). Node memory, sampled every second, is what the node's
sandboxes are charged (their memory cgroups) plus the RAM the node's zram holds (its
compressed swap), both from the reclaimer's `node.v1.<node>.savings`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path

import sandfleet
from loadtest.platform import running_platform
from loadtest.report import print_table, write_json
from schemas import reclaim

MiB = 1 << 20
AGENT = """
import collections, hashlib, json, random, re, time
random.seed(1234)
shared = random.randbytes({data_mib} << 20)   # the same bytes in every agent (a task's data, a vocabulary)
history = [json.dumps({{"step": i, "obs": "observation %d of the episode" % i}}) for i in range({heap})]
while True:                                    # the agent at rest: wake, look, sleep
    time.sleep(5)
    hashlib.sha256(history[-1].encode()).hexdigest()
"""
WINDOWS = {  # the same on both sides; short, so a benchmark run sees reclamation act
    "SANDFLEET_RECLAIM_IDLE_S": "10",
    "SANDFLEET_RECLAIM_MERGE_S": "10",
    "SANDFLEET_RECLAIM_INTERVAL_S": "2",
    # placement's pressure feedback would stop a ramp on a busy machine: not what this measures
    "SANDFLEET_CPU_PSI_LIMIT": "0",
    "SANDFLEET_MEMORY_PSI_LIMIT": "0",
}


async def savings(fleet: sandfleet.Fleet, node_id: str) -> reclaim.NodeSavings:
    return await fleet.bus.request(reclaim.savings_subject(node_id), reclaim.SavingsRequest(), reclaim.NodeSavings)


async def run_side(url: str, node_id: str, args: argparse.Namespace) -> dict:
    agent = AGENT.format(data_mib=args.data_mib, heap=args.heap).encode()
    async with sandfleet.connect(url) as fleet:
        series: list[tuple[float, int, int]] = []  # (t, charged, zram held)
        started = time.monotonic()
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                with contextlib.suppress(sandfleet.errors.SandfleetError):
                    s = await savings(fleet, node_id)
                    series.append((time.monotonic() - started, s.memory_bytes, s.swap_stored_bytes))
                await asyncio.sleep(1.0)

        boxes: list[sandfleet.Sandbox] = []
        gate = asyncio.Semaphore(8)

        async def arrive(i: int) -> None:
            await asyncio.sleep(i * args.ramp_s / args.n)
            async with gate:
                sb = await fleet.create(memory_mb=128, cpu=0.25, host_view=True, timeout_s=24 * 3600)
                boxes.append(sb)
                await sb.write_file("/workspace/agent.py", agent)
                r = await sb.exec(["sh", "-c", "python3 /workspace/agent.py >/dev/null 2>&1 &"])
                if r.exit_code != 0:
                    raise RuntimeError(f"agent did not start: {r.stderr!r}")

        sampler = asyncio.create_task(sample())
        try:
            await asyncio.gather(*(arrive(i) for i in range(args.n)))
            ramp_done = time.monotonic() - started
            await asyncio.sleep(args.hold_s)
            end = await savings(fleet, node_id)
        finally:
            done.set()
            await sampler
            gate = asyncio.Semaphore(16)

            async def destroy(sb: sandfleet.Sandbox) -> None:
                async with gate:
                    with contextlib.suppress(sandfleet.errors.SandfleetError):
                        await sb.destroy()

            await asyncio.gather(*(destroy(sb) for sb in boxes))
    totals = [(t, c + z) for t, c, z in series]
    peak_t, peak = max(totals, key=lambda x: x[1])
    return {
        "sandboxes": len(boxes),
        "ramp_s": round(ramp_done, 1),
        "peak_node_mib": round(peak / MiB, 1),
        "peak_at_s": round(peak_t, 1),
        "end_node_mib": round((end.memory_bytes + end.swap_stored_bytes) / MiB, 1),
        "per_sandbox_peak_mib": round(peak / MiB / max(1, len(boxes)), 2),
        "merged_mib": round(end.merged_bytes / MiB, 1),
        "swapped_mib": round(end.swapped_bytes / MiB, 1),
        "zram_held_mib": round(end.swap_stored_bytes / MiB, 1),
        "actions": end.actions,
        "samples": len(series),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--ramp-s", type=float, default=None, help="arrivals spread over this long (default 0.6 s each)")
    p.add_argument("--hold-s", type=float, default=60.0)
    p.add_argument("--data-mib", type=int, default=8, help="identical data each agent holds")
    p.add_argument("--heap", type=int, default=30_000, help="private history items each agent holds")
    p.add_argument("--out", type=Path, default=Path("results/memory_reclaim.json"))
    args = p.parse_args()
    args.ramp_s = args.ramp_s if args.ramp_s is not None else 0.6 * args.n
    results: dict[str, dict] = {}
    for side, env in (("off", {"SANDFLEET_RECLAIM": "off"}), ("on", {"SANDFLEET_RECLAIM": "on"})):
        node_id = f"bench-reclaim-{side}"
        with running_platform(node_id, {**WINDOWS, **env}) as (url, _):
            results[side] = asyncio.run(run_side(url, node_id, args))
    results["peak_reduction"] = round(1 - results["on"]["peak_node_mib"] / results["off"]["peak_node_mib"], 3)
    params = {k: v for k, v in vars(args).items() if k != "out"} | {"windows": WINDOWS}
    write_json(args.out, "memory_reclaim", params, results)
    cols = ["reclamation", "sandboxes", "peak node MiB", "per sandbox MiB", "end MiB", "merged MiB",
            "swapped MiB", "zram holds MiB", "actions"]
    rows = [[side, r["sandboxes"], r["peak_node_mib"], r["per_sandbox_peak_mib"], r["end_node_mib"], r["merged_mib"],
             r["swapped_mib"], r["zram_held_mib"], ",".join(f"{k}={v}" for k, v in sorted(r["actions"].items()))]
            for side, r in (("off", results["off"]), ("on", results["on"]))]
    print_table(f"memory reclamation: {args.n} idle agent sandboxes", cols, rows)
    print(f"peak node memory {results['peak_reduction'] * 100:.1f}% lower with reclamation (target >= 50%)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""kill -9 of each node service 1 s into a batch: how many of the batch fail (issue 16 §2).

    .venv/bin/python -m loadtest.kill_midbatch [--n 500] [--kill-after 1.0] [--isolation process]
                                               [--services launcher agent layer-cache]

One platform for the run, one busybox layer (so every sandbox needs the agent's confinement and
the layer-cache's root). For each service in turn: `fleet.create_many(N)` from that layer, the
service killed with SIGKILL `--kill-after` seconds after the request went out (the supervisor
restarts it), then the batch followed to its end. Reported per service: how many ended
`running` and `failed` (with each failure reason), the time from the request until the batch
settled, how many sandboxes had other than one init on the host (a launch built twice), and
then everything is destroyed. A first row, `none`, is the same batch with no kill: the
baseline for the time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import sandfleet
from loadtest.container_rate import LAYER, build_busybox_layer
from loadtest.platform import running_platform
from loadtest.report import print_table, write_json
from schemas.sandbox import ENDED

SERVICES = ("launcher", "agent", "layer-cache")


def inits_per_sandbox(node_id: str) -> Counter:
    """Sandbox id → sandbox inits (pid 1 of a pid namespace) in its cgroups, from /proc."""
    marker = f"/sandfleet/{node_id}/"
    found: Counter = Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                owners = {line.split(marker, 1)[1].split("/")[0] for line in f if marker in line}
            with open(f"/proc/{pid}/status") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(nspid) >= 2 and nspid[-1] == "1" and len(owners) == 1:
            found[owners.pop().strip()] += 1
    return found


async def one_batch(fleet: sandfleet.Fleet, data_dir: Path, node_id: str, service: str | None,
                    args: argparse.Namespace) -> dict:
    label = f"kill-{service or 'none'}-{time.time_ns()}"
    started = time.perf_counter()
    batch = asyncio.create_task(fleet.create_many(args.n, isolation=args.isolation, layers=[LAYER], memory_mb=32,
                                                  cpu=0.01, labels={"bench": label},
                                                  request_timeout_s=args.settle_s))
    killed_at = None
    if service is not None:
        await asyncio.sleep(args.kill_after)
        pid = json.loads((data_dir / "supervisor.json").read_text())["services"][service]
        os.kill(pid, signal.SIGKILL)
        killed_at = round(time.perf_counter() - started, 2)
    try:
        await batch
    except sandfleet.errors.SandfleetError as exc:
        print(f"  {service}: {str(exc)[:200]}", flush=True)
    while True:  # the records, once none of the batch is between states any more
        records = [r for r in await fleet.list(include_ended=True) if r.spec.labels.get("bench") == label]
        if all(r.state.value == "running" or r.state in ENDED for r in records):
            break
        await asyncio.sleep(0.5)
    settled_s = round(time.perf_counter() - started, 2)
    inits = inits_per_sandbox(node_id)
    running = [r.id for r in records if r.state.value == "running"]
    reasons = Counter(f"{r.reason.value}: {r.detail[:60]}" for r in records if r.state.value == "failed")
    gate = asyncio.Semaphore(16)

    async def destroy(sandbox_id: str) -> None:
        async with gate:
            try:
                await (await fleet.sandbox(sandbox_id)).destroy()
            except sandfleet.errors.NotFound:
                pass

    await asyncio.gather(*(destroy(i) for i in running))
    return {
        "service": service or "none",
        "killed_at_s": killed_at,
        "sandboxes": len(records),
        "running": len(running),
        "failed": sum(reasons.values()),
        "failure_reasons": dict(reasons),
        "not_one_init": sum(1 for i in running if inits[i] != 1),
        "settled_s": settled_s,
    }


async def run(args: argparse.Namespace) -> dict:
    with running_platform(args.node_id, env={"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101"}
                          ) as (url, data_dir):
        async with sandfleet.connect(url, name="bench-kill-midbatch") as fleet:
            await build_busybox_layer(fleet)
            rows = [await one_batch(fleet, data_dir, args.node_id, None, args)]
            for service in args.services:
                rows.append(await one_batch(fleet, data_dir, args.node_id, service, args))
                print(f"  {rows[-1]}", flush=True)
                # The next kill must find every service up (a restart may still be under way).
                deadline = time.monotonic() + 60
                while not all([await fleet.ping(s) for s in SERVICES]) and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            left = len(await fleet.list())
    return {"batches": rows, "live_after_destroy": left}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="sandboxes per batch")
    ap.add_argument("--kill-after", type=float, default=1.0, help="seconds from the request to the kill")
    ap.add_argument("--isolation", default="process", choices=["process", "container"])
    ap.add_argument("--services", nargs="+", default=list(SERVICES), choices=list(SERVICES))
    ap.add_argument("--settle-s", type=float, default=600.0, help="how long a batch may take to settle")
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench-kill"))
    ap.add_argument("--out", type=Path, default=Path("results/kill_midbatch.json"))
    args = ap.parse_args()
    results = asyncio.run(run(args))
    print_table(f"kill -9 {args.kill_after:g}s into a batch of {args.n} ({args.isolation}, layered)",
                ["killed", "at s", "running", "failed", "not one init", "settled s", "failure reasons"],
                [[r["service"], r["killed_at_s"] or "-", r["running"], r["failed"], r["not_one_init"], r["settled_s"],
                  "; ".join(f"{n}x {why}" for why, n in r["failure_reasons"].items()) or "-"]
                 for r in results["batches"]])
    out = write_json(args.out, "kill_midbatch", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     results)
    print(f"\nwrote {out}")
    return 0 if all(r["failed"] == 0 and r["not_one_init"] == 0 for r in results["batches"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

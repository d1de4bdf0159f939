"""MicroVM create → exec `true` → destroy, restored from a saved machine state versus booted
cold, side by side in one run.

    .venv/bin/python -m loadtest.microvm_start [--n 10] [--cold-n 3]

Two platforms, one after the other on this machine (`sandfleet up`, one node each), the same
busybox layer and shape (1 vCPU, memory_mb 512). The first creates with saved states (the
default): its first create boots the machine once and saves its state (reported alone as
`first create`), every later one restores it. The second runs with SANDFLEET_MICROVM_SNAPSHOTS=0:
every create boots cold. Cycles run one at a time (a TCG boot takes a whole core). The
accelerator is the node's (`sandfleet status` says which); rows of TCG and KVM runs are never
mixed in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import sandfleet
from loadtest.container_rate import build_busybox_layer
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json

LAYER = "bench-vm"
APPLETS = ("sh", "true", "sleep", "cat", "echo", "uname")
MEMORY_MB = 512


async def _side(url: str, n: int) -> dict[str, object]:
    async with sandfleet.connect(url, name="bench") as fleet:
        await build_busybox_layer(fleet, LAYER, APPLETS)
        status = next((n.microvm for n in await fleet.nodes() if n.microvm), "")

        lat: dict[str, list[float]] = {"create": [], "exec": [], "destroy": [], "cycle": []}
        first_ms, failed = 0.0, 0
        for i in range(n + 1):  # the first: the boot that saves the state (or just one more cold boot)
            t0 = time.perf_counter()
            try:
                sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
            except sandfleet.errors.SandfleetError as exc:  # a TCG boot past placement's 30 s launch budget
                print(f"create failed: {exc}")
                failed += 1
                continue
            t1 = time.perf_counter()
            try:
                code = (await sb.exec(["true"])).exit_code
            finally:
                t2 = time.perf_counter()
                await sb.destroy()
            t3 = time.perf_counter()
            if code != 0:
                raise RuntimeError(f"`true` exited {code}")
            if i == 0:
                first_ms = (t1 - t0) * 1000
                continue
            for key, ms in (("create", t1 - t0), ("exec", t2 - t1), ("destroy", t3 - t2), ("cycle", t3 - t0)):
                lat[key].append(ms * 1000)
        return {"status": status, "first_create_ms": round(first_ms, 1), "n": len(lat["cycle"]), "failed": failed,
                **{k: percentiles(v) for k, v in lat.items()}}


async def main(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, object]] = {}
    with running_platform("bench-vm-restored") as (url, _):
        results["restored"] = await _side(url, args.n)
    with running_platform("bench-vm-cold", env={"SANDFLEET_MICROVM_SNAPSHOTS": "0"}) as (url, _):
        results["cold"] = await _side(url, args.cold_n)
    rows = []
    for side, r in results.items():
        rows.append([side, r["n"], r["failed"], r["first_create_ms"], r["create"]["p50"], r["create"]["p99"],  # type: ignore[index]
                     r["exec"]["p50"], r["destroy"]["p50"], r["cycle"]["p50"], r["cycle"]["p99"]])  # type: ignore[index]
    print(f"microvm {results['restored']['status']}")
    print_table("microvm create → exec true → destroy (ms)",
                ["start", "n", "failed", "first create", "create p50", "create p99", "exec p50", "destroy p50",
                 "cycle p50", "cycle p99"], rows)
    out = write_json(Path(args.out), "microvm_start", vars(args), results)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10, help="restored cycles")
    parser.add_argument("--cold-n", type=int, default=3, help="cold-boot cycles (each ~15-40 s under TCG)")
    parser.add_argument("--out", default="loadtest/results/microvm_start.json")
    asyncio.run(main(parser.parse_args()))

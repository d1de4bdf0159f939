"""What user namespaces cost: create → exec `true` → destroy cycles on a platform whose sandbox
roots are an unprivileged host range (SANDFLEET_USERNS on, the default) beside one whose roots
are the host's uid 0 (SANDFLEET_USERNS=off), side by side in one run.

    .venv/bin/python -m loadtest.userns_cost [--n 200] [--concurrency 8] [--rounds 3] [--direct]

Both platforms run at once (each its own node id, data dir and half of the egress subnet), so
both see the same load; rounds alternate between them; cycles/s is the median over rounds, and
the median of each round's on/off ratio is given too (the two sides run back to back, so they
share the moment's load on a shared machine). With the namespace on, a start costs one setns
and three id calls in the init and in each exec helper: the namespace itself is made once per
spawner, and the layers are idmapped once per node, so no per-sandbox mount is added.
`--direct` runs the same cycles through the kernel library in this process instead (no bus, no
services: the floor create_rate calls direct), both sides from one spawner, rounds alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from linuxnode import cgroups, userns
from loadtest.create_rate import BENCH_NODE, DirectSide, platform_round, run_round
from loadtest.platform import running_platform
from loadtest.report import Rounds, alternating_rounds, print_rounds, write_json

SIDES = ("on", "off")


def _direct_rounds(args) -> Rounds:
    ids = {"on": userns.node_range("on").host, "off": 0}
    offset = 0

    def one(side: str, n: int):
        nonlocal offset
        offset += n
        return asyncio.run(run_round(DirectSide(offset - n, ids[side]), n, args.concurrency))

    try:  # the `on` side's first start makes its namespace: in the warm-up, not counted
        return alternating_rounds(SIDES, args.rounds, args.n, one, label="userns", note=" (direct)")
    finally:
        cgroups.remove_node_root(cgroups.CgroupLayout.detect(), BENCH_NODE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=200, help="cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-id", default="bench-userns")
    ap.add_argument("--direct", action="store_true", help="the kernel library in this process, no platform")
    ap.add_argument("--out", type=Path, default=Path("results/userns_cost.json"))
    args = ap.parse_args()

    # Pressure admission off: on a loaded machine it would refuse creates, and this measures the create path.
    common = {"SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0"}
    envs = {"on": {**common, "SANDFLEET_USERNS": "on", "SANDFLEET_EGRESS_SUBNET": "10.219.0.0/17"},
            "off": {**common, "SANDFLEET_USERNS": "off", "SANDFLEET_EGRESS_SUBNET": "10.219.128.0/17"}}
    if args.direct:
        measured = _direct_rounds(args)
    else:
        with running_platform(f"{args.node_id}-on", envs["on"]) as (url_on, _), \
                running_platform(f"{args.node_id}-off", envs["off"]) as (url_off, _):
            urls = {"on": url_on, "off": url_off}
            measured = alternating_rounds(
                SIDES, args.rounds, args.n, lambda side, n: asyncio.run(platform_round(urls[side], n, args.concurrency)),
                label="userns")
    results = measured.results()
    print_rounds(results, SIDES, "userns", f"create → exec true → destroy{' (direct)' if args.direct else ''}, "
                 f"n={args.n} x {args.rounds} rounds, concurrency {args.concurrency} (ms)", target=0.9)
    out = write_json(args.out, "userns_cost", vars(args) | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

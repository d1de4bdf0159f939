"""Create latency from a warm pool versus a cold create, `process` and `container`, side by side
in one run.

    .venv/bin/python -m loadtest.warm_pool [--rounds 4] [--per-round 10]

One platform (`sandfleet up`, one node), one busybox layer, one shape per level (cpu 0.1,
memory_mb 128, the layer). Rounds alternate the two sides, so the machine's load falls on both
alike: a cold round creates `per-round` sandboxes one after the other with no pool of their
shape (a shape of their own: memory_mb 129); a warm round first waits until the node reports
`per-round` spares ready, then creates as many of the pool's shape one after the other. Each
create is timed from the SDK call to its return (a running sandbox), as a trainer sees it;
each then runs `true` (not timed: it proves the sandbox works), and a round's sandboxes are
destroyed after the round. `claimed` counts the warm creates that took a spare (a create that
finds none is built cold and still counted on the warm side). The pool refills in the
background during a warm round, as it does under a trainer.
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
from schemas import node as node_schema
from schemas.node import ConfinedList, Empty

LAYER = "bench-pool"
QUIET = {"SANDFLEET_CPU_PSI_LIMIT": "101", "SANDFLEET_MEMORY_PSI_LIMIT": "101", "SANDFLEET_POOL_MEMORY_PSI": "0"}
WAIT_S = 300.0


def shape(isolation: str, warm: bool) -> dict[str, object]:
    return dict(isolation=isolation, layers=[LAYER], cpu=0.1, memory_mb=128 if warm else 129)


async def _spares(fleet: sandfleet.Fleet, node_id: str) -> set[str]:
    held = await fleet.bus.request(node_schema.subject(node_id, node_schema.AGENT_LIST), Empty(), ConfinedList, timeout=30)
    return set(held.sandbox_ids) - {r.id for r in await fleet.list()}


async def _ready(fleet: sandfleet.Fleet, node_id: str, key: str, n: int) -> None:
    since, deadline = time.time(), time.monotonic() + WAIT_S
    while True:
        info = next((i for i in await fleet.nodes() if i.id == node_id), None)
        if info is not None and info.at > since and info.warm.get(key, 0) >= n:
            await asyncio.sleep(0.1)
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool never had {n} spares ready: {info.warm if info else None}")
        await asyncio.sleep(0.2)


async def _round(fleet: sandfleet.Fleet, spec: dict[str, object], n: int, spares: set[str]) -> tuple[list[float], int]:
    made, ms = [], []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await fleet.create(**spec)  # type: ignore[arg-type]
            ms.append((time.perf_counter() - t0) * 1000)
            made.append(sb)
            if (await sb.exec(["true"])).exit_code != 0:
                raise RuntimeError(f"`true` failed in {sb.id}")
    finally:
        await asyncio.gather(*(sb.destroy() for sb in made))
    return ms, sum(sb.id in spares for sb in made)


async def _level(fleet: sandfleet.Fleet, node_id: str, isolation: str, rounds: int, per_round: int
                 ) -> dict[str, object]:
    key = (await fleet.set_pool(size=per_round, **shape(isolation, True))).key
    cold: list[float] = []
    warm: list[float] = []
    claimed = 0
    try:
        for _ in range(rounds):
            ms, _ = await _round(fleet, shape(isolation, False), per_round, set())
            cold += ms
            await _ready(fleet, node_id, key, per_round)
            ms, took = await _round(fleet, shape(isolation, True), per_round, await _spares(fleet, node_id))
            warm += ms
            claimed += took
    finally:
        await fleet.clear_pool(**shape(isolation, True))
    return {"cold": percentiles(cold), "warm": percentiles(warm), "n": len(warm), "claimed": claimed}


async def main(args: argparse.Namespace) -> None:
    results: dict[str, object] = {}
    env = {**QUIET, "SANDFLEET_POOL_BUILDS": str(args.builds)}
    with running_platform(args.node_id, env=env) as (url, data_dir):
        results["data_dir"] = str(data_dir)
        async with sandfleet.connect(url, name="bench") as fleet:
            await build_busybox_layer(fleet, LAYER, ("sh", "true"))
            levels = (await fleet.nodes())[0].isolation
            for isolation in ("process", "container"):
                if isolation in levels:
                    results[isolation] = await _level(fleet, args.node_id, isolation, args.rounds, args.per_round)
    rows = []
    for isolation in ("process", "container"):
        if isolation not in results:
            continue
        r: dict = results[isolation]  # type: ignore[assignment]
        cold, warm = r["cold"], r["warm"]
        rows.append([isolation, r["n"], r["claimed"], cold["p50"], cold["p99"], warm["p50"], warm["p99"],
                     round(cold["p50"] / warm["p50"], 1) if warm["p50"] else 0.0])
    print_table("create latency, SDK call → running sandbox (ms)",
                ["isolation", "n", "claimed", "cold p50", "cold p99", "warm p50", "warm p99", "cold/warm p50"], rows)
    out = write_json(Path(args.out), "warm_pool", vars(args), results)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side and level (they alternate)")
    parser.add_argument("--per-round", type=int, default=10, help="creates per round; also the pool's size")
    parser.add_argument("--builds", type=int, default=1, help="SANDFLEET_POOL_BUILDS: spares built at once (the default)")
    parser.add_argument("--node-id", default="bench-pool")
    parser.add_argument("--out", default="loadtest/results/warm_pool.json")
    asyncio.run(main(parser.parse_args()))

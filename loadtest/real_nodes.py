"""Real nodes: one gang batch of `container` sandboxes over `sandfleet up --nodes N`, beside one node.

    .venv/bin/python -m loadtest.real_nodes [--nodes 4] [--n 2000] [--baseline-nodes 1]   # --nodes 2 --n 20: smoke

`up --nodes 4` runs four complete nodes (layer-cache, launcher, reclaimer, agent, each with
its own node id, data dir and cgroup root) against one bus, all on THIS machine: the four
nodes share its 2 cores (and its memory), so they add parallel launch paths, not hardware;
the side-by-side `--baseline-nodes 1` run (the same batch, the same machine, the same run)
shows what that costs or gains. Each side: build a busybox layer, start one sandbox per node
so every node holds the layer (placement prefers nodes that do), then ONE `create_many(n)`
(a gang batch: placement answers with every placement, the nodes launch in parallel, the SDK
follows the `started`/`failed` events). It reports when placement answered, when the last
sandbox was running (from the events' own timestamps), the per-node spread, every failure
with its reason, p50/p99 from the request to each `started` event, and the CPU seconds each
platform process (and the children it reaped, like crun) used during the batch. Then it
destroys all of them, times that, and checks that no overlay, cgroup, network namespace or
process of the nodes' sandboxes is left, and after `down` nothing of the nodes at all.
Placement is configured so the batch fits (capacity, overcommit for the small asks) and its
pressure feedback is off: on a shared machine it would otherwise refuse what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import sandfleet
from loadtest.container_rate import LAYER, build_busybox_layer
from loadtest.platform import leftovers, running_platform
from linuxnode import procfs
from loadtest.report import percentiles, print_table, write_json
from sandfleet.bus import decode
from schemas import events
from schemas.events import AnySandboxEvent
from schemas.sandbox import State

TICK = os.sysconf("SC_CLK_TCK")
SANDBOX_ID = re.compile(r"sb-[0-9a-f]{12}")


def node_ids(base: str, nodes: int) -> list[str]:
    """The ids `up --nodes N` gives its nodes (see sandfleet.supervisor.plan_nodes)."""
    return [base] if nodes == 1 else [f"{base}-{i}" for i in range(1, nodes + 1)]


def platform_env(n: int, nodes: int, cpu: float, memory_mb: int) -> dict[str, str]:
    """Room for the whole batch on ONE node (so the baseline fits and 4 nodes are not capped):
    sandbox slots, and CPU/memory overcommit ratios that the small asks of n sandboxes fit in."""
    cores, ram_mb = os.cpu_count() or 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return {
        "SANDFLEET_CAPACITY": str(max(2000, n)),
        "SANDFLEET_CPU_OVERCOMMIT": str(max(200, math.ceil(1.1 * n * cpu / cores))),
        "SANDFLEET_MEMORY_OVERCOMMIT": str(max(10, math.ceil(1.1 * n * memory_mb / ram_mb))),
        "SANDFLEET_CPU_PSI_LIMIT": "0",
        "SANDFLEET_MEMORY_PSI_LIMIT": "0",
    }


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(own utime+stime, reaped children's cutime+cstime) of a process, in clock ticks."""
    stat = procfs.read_stat(pid)
    return (0, 0) if stat is None else (stat.utime + stat.stime, stat.children_time)


def host_busy_ticks() -> int:
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:]]
    return sum(t) - t[3] - t[4]  # all but idle and iowait


def platform_cpu(data_dir: Path) -> dict[str, tuple[int, int]]:
    state = json.loads((data_dir / "supervisor.json").read_text())
    return {"supervisor": cpu_ticks(state["pid"]), **{n: cpu_ticks(p) for n, p in state["services"].items()}}


def cpu_used(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, dict[str, float]]:
    """CPU seconds per service (its per-node instances summed): own, and of the children it reaped."""
    used: dict[str, dict[str, float]] = {}
    for name, (own, kids) in after.items():
        b_own, b_kids = before.get(name, (0, 0))
        row = used.setdefault(name.split("@")[0], {"own_s": 0.0, "children_s": 0.0})
        row["own_s"] = round(row["own_s"] + (own - b_own) / TICK, 2)
        row["children_s"] = round(row["children_s"] + (kids - b_kids) / TICK, 2)
    return used


async def _registered(fleet: sandfleet.Fleet, nodes: list[str], layer: str | None, timeout: float) -> bool:
    """Every node heartbeats (holding `layer`, with nothing running or starting, if given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = {i.id: i for i in await fleet.nodes()}
        if all(n in seen and (layer is None or (layer in seen[n].layers and not seen[n].running
                                                and not seen[n].starting)) for n in nodes):
            return True
        await asyncio.sleep(0.25)
    return False


async def _destroy(boxes: list[sandfleet.Sandbox], concurrency: int) -> list[str]:
    gate, errors = asyncio.Semaphore(concurrency), []

    async def one(sb: sandfleet.Sandbox) -> None:
        async with gate:
            try:
                await sb.destroy()
            except sandfleet.errors.SandfleetError as exc:
                errors.append(f"{sb.id}: {exc}")

    await asyncio.gather(*(one(sb) for sb in boxes))
    return errors


async def one_batch(url: str, data_dir: Path, nodes: list[str], args: argparse.Namespace) -> dict:
    spec = dict(isolation="container", layers=[LAYER], cpu=args.cpu, memory_mb=args.memory_mb, pids=64,
                disk_mb=args.disk_mb, labels={"bench": "real_nodes"})
    async with sandfleet.connect(url, name="bench-real-nodes") as fleet:
        if not await _registered(fleet, nodes, None, 90):
            raise RuntimeError(f"nodes {nodes} did not all register")
        await build_busybox_layer(fleet)
        # One sandbox per node first (a batch of len(nodes) spreads one to each), so every node
        # has fetched the layer: placement fills nodes holding it first.
        warm = await fleet.create_many(len(nodes), request_timeout_s=300, **spec)
        warmed = sorted(sb.node for sb in warm)
        await _destroy(warm, 8)
        layer_everywhere = await _registered(fleet, nodes, LAYER, 60)

        outcome: dict[str, tuple[str, float, float, str, str]] = {}  # id -> (state, event at, seen at, detail, node)

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            e = decode(msg.data, AnySandboxEvent)
            if e.state in (State.RUNNING, State.FAILED) and e.sandbox_id not in outcome:
                outcome[e.sandbox_id] = (e.state.value, e.at, time.time(), f"{e.reason.value}: {e.detail}", e.node)

        subs = [await fleet.bus.nc.subscribe(events.sandbox_subject("*", name), cb=on_event,
                                             pending_msgs_limit=4 * args.n + 1024, pending_bytes_limit=-1)
                for name in ("started", "failed")]
        answered: list[float] = []
        step = max(1, args.n // 10)
        shown = [-1]

        def progress(p: sandfleet.BatchProgress) -> None:
            if not answered:
                answered.append(time.time())
            if (p.running + p.failed) // step > shown[0]:
                shown[0] = (p.running + p.failed) // step
                print(f"  {len(nodes)} node(s): placed {p.placed}, running {p.running}, failed {p.failed} "
                      f"at {time.time() - t0:.1f} s", file=sys.stderr, flush=True)

        cpu_before, host_before, me_before = platform_cpu(data_dir), host_busy_ticks(), os.times()
        t0 = time.time()
        batch_error = ""
        try:
            boxes = await fleet.create_many(args.n, request_timeout_s=args.timeout_s, progress=progress, **spec)
        except sandfleet.errors.SandfleetError as exc:
            boxes, batch_error = getattr(exc, "created", []), f"{type(exc).__name__}: {exc}"
        returned = time.time()
        cpu_after, host_after, me_after = platform_cpu(data_dir), host_busy_ticks(), os.times()
        await asyncio.sleep(0.5)  # events published just before the SDK returned
        for sub in subs:
            await sub.unsubscribe()

        ours = {sb.id for sb in boxes} | set(outcome)
        started = {i: o for i, o in outcome.items() if o[0] == State.RUNNING.value}
        failed = {i: o for i, o in outcome.items() if o[0] == State.FAILED.value}
        reasons = Counter(SANDBOX_ID.sub("<id>", o[3])[:200] for o in failed.values())
        t_all = [o[1] for o in outcome.values()]

        t1 = time.time()
        handles = {sb.id: sb for sb in boxes}
        for r in await fleet.list():  # whatever of the batch is live, also what the SDK gave up on
            if r.id in ours or r.spec.labels.get("bench") == "real_nodes":
                handles.setdefault(r.id, sandfleet.Sandbox(fleet, r.id, r.node))
        destroy_errors = await _destroy(list(handles.values()), args.concurrency)
        teardown_s = time.time() - t1
        deadline = time.monotonic() + 30  # the kernel may finish a cgroup's last exit a little later
        while (left := leftovers(nodes, data_dir)) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return {
            "nodes": len(nodes),
            "node_ids": nodes,
            "warmed_nodes": warmed,
            "layer_on_every_node": layer_everywhere,
            "requested": args.n,
            "started": len(started),
            "failed": len(failed),
            "no_outcome": args.n - len(started) - len(failed),
            "failure_reasons": dict(reasons.most_common()),
            "batch_error": batch_error[:1000],
            "placement_answered_s": round(answered[0] - t0, 3) if answered else None,
            "all_running_s": round(max(o[1] for o in started.values()) - t0, 3) if started else None,
            "all_settled_s": round(max(t_all) - t0, 3) if t_all else None,
            "sdk_returned_s": round(returned - t0, 3),
            "request_to_started_ms": percentiles([(o[1] - t0) * 1000 for o in started.values()]),
            "spread": dict(sorted(Counter(sb.node for sb in boxes).items())),  # started, per node
            "placed_spread": dict(sorted(Counter(o[4] for o in outcome.values()).items())),  # started or failed
            "cpu_s": cpu_used(cpu_before, cpu_after),
            "cpu_s_platform_total": round(sum(v["own_s"] + v["children_s"]
                                              for v in cpu_used(cpu_before, cpu_after).values()), 2),
            "cpu_s_benchmark_client": round(sum(me_after[:2]) - sum(me_before[:2]), 2),
            "cpu_s_host_busy": round((host_after - host_before) / TICK, 2),  # everyone's, on a shared machine
            "teardown_s": round(teardown_s, 3),
            "destroyed": len(handles),
            "destroy_errors": destroy_errors[:20],
            "left_after_destroy": left,
            "live_after_destroy": len(await fleet.list()),
        }


def run(args: argparse.Namespace) -> dict:
    """The batch on `--nodes`, then (unless 0) on `--baseline-nodes`; the ratios between them."""
    sides = [(args.nodes, args.node_id)]
    if args.baseline_nodes:
        sides.append((args.baseline_nodes, f"{args.node_id}-base"))
    env = platform_env(args.n, args.nodes, args.cpu, args.memory_mb)
    runs = []
    for count, base in sides:
        nodes = node_ids(base, count)
        print(f"{count} node(s) {nodes}: one batch of {args.n}", file=sys.stderr, flush=True)
        with running_platform(base, env, nodes=count) as (url, data_dir):
            got = asyncio.run(one_batch(url, data_dir, nodes, args))
        got["left_after_down"] = leftovers(nodes, data_dir, whole_node=True)
        got["data_dir"] = str(data_dir)
        runs.append(got)
    results: dict = {"runs": runs, "placement_env": env, "cores_shared_by_all_nodes": os.cpu_count()}
    if len(runs) == 2:
        main, base = runs

        def ratio(key: str) -> float | None:
            return round(main[key] / base[key], 3) if main.get(key) and base.get(key) else None

        results["ratio_nodes_over_baseline"] = {k: ratio(k) for k in (
            "placement_answered_s", "all_running_s", "cpu_s_platform_total", "teardown_s")}
        # Times of a batch that partly failed are not the same work as those of one that did not.
        results["ratio_nodes_over_baseline"]["comparable"] = all(r["started"] == r["requested"] for r in runs)
    return results


def clean(r: dict) -> bool:
    return (r["started"] == r["requested"] and not r["left_after_destroy"] and not r["left_after_down"]
            and not r["live_after_destroy"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4, help="complete nodes of `sandfleet up` on this machine")
    ap.add_argument("--n", type=int, default=2000, help="sandboxes in the one batch")
    ap.add_argument("--baseline-nodes", type=int, default=1, help="the same batch on this many nodes; 0: skip")
    ap.add_argument("--memory-mb", type=int, default=32, help="each sandbox's memory limit (small: n must fit)")
    ap.add_argument("--cpu", type=float, default=0.1, help="each sandbox's CPU ask")
    ap.add_argument("--disk-mb", type=int, default=16, help="each sandbox's writable layer")
    ap.add_argument("--concurrency", type=int, default=64, help="parallel destroys")
    ap.add_argument("--timeout-s", type=float, default=1200, help="how long the SDK follows the batch")
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/real_nodes.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("real_nodes: containers need root", file=sys.stderr)
        return 2
    results = run(args)
    runs = results["runs"]
    print_table(
        f"one gang batch of {args.n} container sandboxes; all nodes share this machine's {os.cpu_count()} cores "
        "(s, ms, CPU s)",
        ["nodes", "started", "failed", "placed s", "all running s", "p50 ms", "p99 ms", "platform CPU s",
         "teardown s", "left"],
        [[r["nodes"], r["started"], r["failed"], r["placement_answered_s"], r["all_running_s"],
          r["request_to_started_ms"]["p50"], r["request_to_started_ms"]["p99"], r["cpu_s_platform_total"],
          r["teardown_s"], "nothing" if not (r["left_after_destroy"] or r["left_after_down"]) else "LEAK"] for r in runs],
    )
    services = sorted({s for r in runs for s in r["cpu_s"]})
    print_table("CPU seconds during the batch, per service (own + reaped children)", ["service", *(f"{r['nodes']} node(s)" for r in runs)],
                [[s, *(f"{r['cpu_s'].get(s, {}).get('own_s', 0):.2f} + {r['cpu_s'].get(s, {}).get('children_s', 0):.2f}"
                       for r in runs)] for s in services])
    for r in runs:
        print(f"{r['nodes']} node(s): placed {r['placed_spread']}, started {r['spread']}; failures {r['failure_reasons'] or 'none'}"
              f"{'; ' + r['batch_error'][:300] if r['batch_error'] else ''}")
    if "ratio_nodes_over_baseline" in results:
        print(f"ratio {args.nodes} nodes / {args.baseline_nodes}: {results['ratio_nodes_over_baseline']}")
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = write_json(args.out, "real_nodes", params, results)
    print(f"wrote {out}")
    return 0 if all(clean(r) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

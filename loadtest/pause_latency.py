"""Pause, resume, checkpoint and restore latency of a sandbox holding a large workspace.

    .venv/bin/python -m loadtest.pause_latency [--rounds 5] [--workspace-mb 200] [--nodes 2]

Each round creates a `container` sandbox over a busybox layer, fills /workspace with
`--workspace-mb` MB of random bytes written by `dd` inside it (so nothing compresses or
deduplicates it away), starts a background loop so there are running processes to freeze,
then times, one after the other: `sb.pause()`, `sb.resume()`, `sb.checkpoint()` (freeze, pack
the writable layer into a layer in the store, thaw) and `fleet.restore(handle, node=...)`
(until the new sandbox is running). With `--nodes 2` (two complete nodes of `sandfleet up`
on this machine, one bus) the restore is pinned to the node the sandbox is NOT on: a
migration, which fetches the checkpoint layer to that node first; with one node it restores
on the same node. Every restore is checked: the workspace file's sha256 inside the restored
sandbox must equal the one computed in the original, and that read is timed too
(`read_restored`): with the default lazy layer fetch a restored sandbox is running before its
workspace's bytes reach the node, and this first full read is what fetches them. Latency is
measured by the caller (the SDK), so it includes the bus round trips a trainer would see.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import sandfleet
from loadtest.container_rate import build_busybox_layer
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json

LAYER = "bench-pause-busybox"
APPLETS = ("sh", "dd", "sha256sum", "cut", "cat", "echo", "sleep", "true", "rm")
OPS = ("pause", "resume", "checkpoint", "restore", "read_restored")
# Placement's pressure feedback would refuse sandboxes on a busy shared machine: not what this measures.
ENV = {"SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0",
       "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}


async def _checked(sb: sandfleet.Sandbox, script: str) -> bytes:
    r = await sb.exec(["sh", "-c", script], timeout_s=300)
    if r.exit_code != 0:
        raise RuntimeError(f"`{script}` exited {r.exit_code} in {sb.id}: {r.stderr[-500:]!r}")
    return r.stdout


async def one_round(fleet: sandfleet.Fleet, nodes: list[str], workspace_mb: int, lat: dict[str, list[float]]) -> dict:
    # Its upper dir (a tmpfs) holds the workspace, charged to its memory: room for both plus the loop.
    spec = dict(isolation="container", layers=[LAYER], cpu=1.0, memory_mb=workspace_mb + 128,
                disk_mb=workspace_mb + 64, labels={"bench": "pause_latency"})
    sb = await fleet.create(**spec)
    restored = None
    try:
        await _checked(sb, f"dd if=/dev/urandom of=/workspace/blob bs=1M count={workspace_mb} 2>/dev/null")
        digest = (await _checked(sb, "sha256sum /workspace/blob | cut -d' ' -f1")).strip()
        await _checked(sb, "(while true; do sleep 0.1; done) >/dev/null 2>&1 &")
        target = next((n for n in nodes if n != sb.node), sb.node)

        t0 = time.perf_counter()
        await sb.pause()
        t1 = time.perf_counter()
        await sb.resume()
        t2 = time.perf_counter()
        handle = await sb.checkpoint(timeout_s=900)
        t3 = time.perf_counter()
        restored = await fleet.restore(handle, node=target, request_timeout_s=900)
        t4 = time.perf_counter()
        got = (await _checked(restored, "sha256sum /workspace/blob | cut -d' ' -f1")).strip()
        t5 = time.perf_counter()
        for op, s in zip(OPS, ((t1 - t0), (t2 - t1), (t3 - t2), (t4 - t3), (t5 - t4))):
            lat[op].append(s * 1000)

        if restored.node != target:
            raise RuntimeError(f"restore pinned to {target} ran on {restored.node}")
        if got != digest:
            raise RuntimeError(f"the restored workspace differs: sha256 {got!r} != {digest!r}")
        return {"from": sb.node, "to": restored.node, "checkpoint_service_s": round(handle.seconds, 3)}
    finally:
        await sb.destroy()
        if restored is not None:
            await restored.destroy()


async def run(url: str, args: argparse.Namespace, nodes: list[str]) -> tuple[dict[str, list[float]], list[dict]]:
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    moves = []
    async with sandfleet.connect(url, name="bench") as fleet:
        deadline = time.monotonic() + 60
        while {n.id for n in await fleet.nodes()} < set(nodes):  # every node has sent its first heartbeat
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {nodes} did not all register")
            await asyncio.sleep(0.2)
        await build_busybox_layer(fleet, LAYER, APPLETS)
        for i in range(args.rounds):
            moves.append(await one_round(fleet, nodes, args.workspace_mb, lat))
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{op} {lat[op][-1]:.0f} ms" for op in OPS),
                  file=sys.stderr)
    return lat, moves


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workspace-mb", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=1, choices=(1, 2), help="2: restore on the other node (migration)")
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/pause_latency.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("pause_latency: containers need root", file=sys.stderr)
        return 2
    nodes = [args.node_id] if args.nodes == 1 else [f"{args.node_id}-{i}" for i in range(1, args.nodes + 1)]
    with running_platform(args.node_id, ENV, nodes=args.nodes) as (url, data_dir):
        lat, moves = asyncio.run(run(url, args, nodes))
    results = {
        **{op: {**percentiles(lat[op]), "n": len(lat[op]), "max": round(max(lat[op]), 2)} for op in OPS},
        "restore_on": "another node" if args.nodes > 1 else "the same node",
        "moves": moves,
        "nodes": nodes,
        "data_dir": str(data_dir),
    }
    params = {"rounds": args.rounds, "workspace_mb": args.workspace_mb, "nodes": args.nodes, "isolation": "container"}
    print_table(f"pause/resume/checkpoint/restore of a sandbox with a {args.workspace_mb} MB workspace "
                f"(restore on {results['restore_on']}; ms)",
                ["op", "n", "p50", "p99", "max"],
                [[op, results[op]["n"], results[op]["p50"], results[op]["p99"], results[op]["max"]] for op in OPS])
    out = write_json(args.out, "pause_latency", params | {"out": str(args.out)}, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

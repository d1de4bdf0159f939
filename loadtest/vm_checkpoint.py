"""A microVM's memory checkpoint and its restore, beside the files-only checkpoint and restore of
a `container` on the same layer, in one run.

    .venv/bin/python -m loadtest.vm_checkpoint [--n 5]

One platform (`sandfleet up`, one node), a busybox layer, memory_mb 512 (352 MiB guest RAM).
Each round, one of each side, one at a time (a TCG guest takes a whole core):
- **microvm, memory=True**: create, start a counter in the background, `checkpoint(memory=True)`
  (timed: the save over QMP, the layer built and stored; its state's size reported), destroy,
  `fleet.restore` to the first answered `exec true` (timed), the counter checked to go on.
- **container, files only**: create, write the same file, `checkpoint()` (timed), destroy,
  restore to the first `exec true` (timed). A VM has no files-only checkpoint (its writable layer
  is in guest RAM), so this is the level a files checkpoint is for.
- **microvm, fresh create** to its first `exec true` (restored from the node's saved boot state):
  what a restore of a memory checkpoint costs over a start with nothing kept.
Each round's checkpoint layers are removed after it. The accelerator is the node's (`sandfleet
status`); TCG and KVM rows are never mixed in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import sandfleet
from loadtest.container_rate import build_busybox_layer
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json
from sandfleet.layers_client import Layers

LAYER = "bench-vmck"
APPLETS = ("sh", "true", "sleep", "cat", "echo", "wc")
MEMORY_MB = 512
COUNTER = "i=0; while :; do i=$((i+1)); echo $i >> /workspace/count; sleep 0.2; done"


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


async def _lines(sb: sandfleet.Sandbox) -> int:
    return int((await sb.exec(["sh", "-c", "cat /workspace/count 2>/dev/null | wc -l"])).stdout or 0)


async def _memory_round(fleet: sandfleet.Fleet) -> dict[str, float]:
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB, request_timeout_s=300)
    try:
        await sb.spawn(["sh", "-c", COUNTER])
        while await _lines(sb) < 3:
            await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        ck = await sb.checkpoint(memory=True)
        checkpoint_ms = _ms(t0)
        saved = await _lines(sb)
    finally:
        await sb.destroy()
    try:
        t0 = time.perf_counter()
        restored = await fleet.restore(ck, request_timeout_s=300)
        try:
            code = (await restored.exec(["true"])).exit_code
            restore_ms = _ms(t0)
            if code != 0:
                raise RuntimeError(f"`true` exited {code} in the restored VM")
            while await _lines(restored) <= saved:  # its counter goes on from the saved count
                await asyncio.sleep(0.2)
        finally:
            await restored.destroy()
    finally:
        await Layers(fleet.bus).remove(ck.name)
    assert ck.machine is not None
    return {"checkpoint": checkpoint_ms, "restore_to_exec": restore_ms, "size_mib": ck.machine.size / (1 << 20)}


async def _files_round(fleet: sandfleet.Fleet) -> dict[str, float]:
    sb = await fleet.create(isolation="container", layers=[LAYER], memory_mb=MEMORY_MB)
    try:
        await sb.exec(["sh", "-c", "echo 1 > /workspace/count"])
        t0 = time.perf_counter()
        ck = await sb.checkpoint()
        checkpoint_ms = _ms(t0)
    finally:
        await sb.destroy()
    try:
        t0 = time.perf_counter()
        restored = await fleet.restore(ck)
        try:
            code = (await restored.exec(["true"])).exit_code
            restore_ms = _ms(t0)
        finally:
            await restored.destroy()
        if code != 0:
            raise RuntimeError(f"`true` exited {code} in the restored container")
    finally:
        await Layers(fleet.bus).remove(ck.name)
    return {"checkpoint": checkpoint_ms, "restore_to_exec": restore_ms}


async def _fresh_round(fleet: sandfleet.Fleet) -> dict[str, float]:
    t0 = time.perf_counter()
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB, request_timeout_s=300)
    try:
        await sb.exec(["true"])
        return {"create_to_exec": _ms(t0)}
    finally:
        await sb.destroy()


async def main(args: argparse.Namespace) -> None:
    sides = {"microvm_memory": _memory_round, "container_files": _files_round, "microvm_fresh": _fresh_round}
    with running_platform("bench-vmck") as (url, _):
        async with sandfleet.connect(url, name="bench") as fleet:
            await build_busybox_layer(fleet, LAYER, APPLETS)
            status = next((n.microvm for n in await fleet.nodes() if n.microvm), "")
            await _fresh_round(fleet)  # the first create boots and saves the shape's state: not measured
            samples: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
            for _ in range(args.n):
                for side, round_ in sides.items():
                    for key, value in (await round_(fleet)).items():
                        samples[side].setdefault(key, []).append(value)
    results: dict[str, object] = {"status": status, "n": args.n}
    for side, found in samples.items():
        results[side] = {k: (round(statistics.median(v), 1) if k == "size_mib" else percentiles(v))
                         for k, v in found.items()}
    mem, files, fresh = (results[s] for s in sides)
    print(f"node: {status}")
    print_table("checkpoint and restore to the first exec (ms)", ["side", "checkpoint p50", "checkpoint p99",
                                                                  "restore→exec p50", "restore→exec p99", "state MiB"],
                [["microvm memory=True", mem["checkpoint"]["p50"], mem["checkpoint"]["p99"],  # type: ignore[index]
                  mem["restore_to_exec"]["p50"], mem["restore_to_exec"]["p99"], mem["size_mib"]],  # type: ignore[index]
                 ["container files only", files["checkpoint"]["p50"], files["checkpoint"]["p99"],  # type: ignore[index]
                  files["restore_to_exec"]["p50"], files["restore_to_exec"]["p99"], "-"],  # type: ignore[index]
                 ["microvm fresh create", "-", "-", fresh["create_to_exec"]["p50"],  # type: ignore[index]
                  fresh["create_to_exec"]["p99"], "-"]])  # type: ignore[index]
    out = write_json(Path(args.out), "vm_checkpoint", vars(args), results)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5, help="rounds (one of each side a round)")
    parser.add_argument("--out", default="loadtest/results/vm_checkpoint.json")
    asyncio.run(main(parser.parse_args()))

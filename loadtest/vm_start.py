"""`vm` against `microvm`: create → exec `true` → destroy, side by side in one run, and the
screenshot round trip of a `vm` desktop.

    .venv/bin/python -m loadtest.vm_start [--n 10] [--shots 100] [--no-desktop]

One platform (`sandfleet up`, one node), the same busybox layer and shape (1 vCPU, memory_mb
512) for both levels. Each level's first create boots its machine once and saves its state
(reported alone as `first create`); every later one restores it. Cycles alternate vm, microvm,
one at a time (a TCG guest takes a whole core), so both see the same load. Then, unless
`--no-desktop`: a `vm` over a Debian layer of full_machine.VM_DESKTOP_PACKAGES (built here,
minutes) with an 800x600 desktop and xterm on it, and `sb.screenshot()` of the whole screen
timed from the SDK (QMP screendump into a memfd, PPM to PNG on the node, bytes over the bus)
and of a 200x200 region. The accelerator is the node's (`sandfleet status`); TCG and KVM rows
are never mixed in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import sandfleet
from linuxnode.vm.full_machine import VM_DESKTOP_PACKAGES
from loadtest.container_rate import build_busybox_layer
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json
from sandfleet.layers_client import Layers
from schemas.sandbox import DesktopSpec

LAYER = "bench-vmf"
DESKTOP_LAYER = "bench-vmf-desktop"
APPLETS = ("sh", "true", "sleep", "cat", "echo", "uname")
MEMORY_MB = 512
DESKTOP_MEMORY_MB = 768
SCREEN = DesktopSpec(width=800, height=600)
LEVELS = ("vm", "microvm")


async def _cycle(fleet: sandfleet.Fleet, isolation: str) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    sb = await fleet.create(isolation=isolation, layers=[LAYER], memory_mb=MEMORY_MB, request_timeout_s=300)
    t1 = time.perf_counter()
    try:
        code = (await sb.exec(["true"])).exit_code
    finally:
        t2 = time.perf_counter()
        await sb.destroy()
    t3 = time.perf_counter()
    if code != 0:
        raise RuntimeError(f"`true` exited {code} in a {isolation}")
    return (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000


async def _starts(fleet: sandfleet.Fleet, n: int) -> dict[str, dict[str, object]]:
    first = {level: (await _cycle(fleet, level))[0] for level in LEVELS}  # boot + save, once per level
    lat = {level: {"create": [], "exec": [], "destroy": [], "cycle": []} for level in LEVELS}
    for _ in range(n):
        for level in LEVELS:
            create, run, destroy = await _cycle(fleet, level)
            for key, ms in (("create", create), ("exec", run), ("destroy", destroy),
                            ("cycle", create + run + destroy)):
                lat[level][key].append(ms)
    return {level: {"first_create_ms": round(first[level], 1), "n": n,
                    **{k: percentiles(v) for k, v in lat[level].items()}} for level in LEVELS}


async def _screenshots(fleet: sandfleet.Fleet, shots: int) -> dict[str, object]:
    started = time.perf_counter()
    await Layers(fleet.bus).build_debian(DESKTOP_LAYER, VM_DESKTOP_PACKAGES)
    built_s = time.perf_counter() - started
    sb = await fleet.create(isolation="vm", layers=[DESKTOP_LAYER], memory_mb=DESKTOP_MEMORY_MB, desktop=SCREEN,
                            request_timeout_s=600, timeout_s=900)
    try:
        screen = await sb.screen_info()
        await sb.spawn(["xterm", "-fn", "fixed", "-e", "sh"], env={"DISPLAY": screen.display, "HOME": "/tmp"})
        await sb.type("echo sandfleet vm screenshot benchmark")
        await sb.keys("Return")
        await asyncio.sleep(2)  # xterm's first paint; not measured
        lat: dict[str, list[float]] = {"screenshot": [], "screenshot_region_200": []}
        size = 0
        for _ in range(shots):
            t0 = time.perf_counter()
            png = await sb.screenshot()
            t1 = time.perf_counter()
            await sb.screenshot((100, 100, 200, 200))
            t2 = time.perf_counter()
            lat["screenshot"].append((t1 - t0) * 1000)
            lat["screenshot_region_200"].append((t2 - t1) * 1000)
            size = len(png)
    finally:
        await sb.destroy()
    return {"layer_build_s": round(built_s, 1), "png_bytes": size, "shots": shots,
            **{k: percentiles(v) for k, v in lat.items()}}


async def main(args: argparse.Namespace) -> None:
    with running_platform("bench-vmf") as (url, _):
        async with sandfleet.connect(url, name="bench") as fleet:
            await build_busybox_layer(fleet, LAYER, APPLETS)
            node = (await fleet.nodes())[0]
            results: dict[str, object] = {"status": node.microvm, "levels": node.isolation,
                                          "starts": await _starts(fleet, args.n)}
            if not args.no_desktop:
                results["screen"] = await _screenshots(fleet, args.shots)
    starts = results["starts"]
    rows = [[level, r["n"], r["first_create_ms"], r["create"]["p50"], r["create"]["p99"], r["exec"]["p50"],  # type: ignore[index]
             r["destroy"]["p50"], r["cycle"]["p50"], r["cycle"]["p99"]] for level, r in starts.items()]  # type: ignore[union-attr]
    print(f"node: {results['status']}")
    print_table("create → exec true → destroy, restored from saved states (ms)",
                ["level", "n", "first create", "create p50", "create p99", "exec p50", "destroy p50", "cycle p50",
                 "cycle p99"], rows)
    if "screen" in results:
        s = results["screen"]
        print_table(f"vm screenshot round trip, {SCREEN.width}x{SCREEN.height} (ms)", ["what", "p50", "p99"],
                    [[k, s[k]["p50"], s[k]["p99"]] for k in ("screenshot", "screenshot_region_200")])  # type: ignore[index]
    out = write_json(Path(args.out), "vm_start", vars(args), results)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10, help="restored cycles of each level")
    parser.add_argument("--shots", type=int, default=100)
    parser.add_argument("--no-desktop", action="store_true", help="skip the desktop layer and screenshots")
    parser.add_argument("--out", default="loadtest/results/vm_start.json")
    asyncio.run(main(parser.parse_args()))

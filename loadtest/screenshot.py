"""Screenshot round trip of a `container` sandbox's desktop, as a computer-use agent sees it.

    .venv/bin/python -m loadtest.screenshot [--shots 200] [--width 1280 --height 800] [--layer NAME]

Builds the desktop layer (`sandfleet desktop layer`'s recipe; minutes) unless `--layer` names one
already in a running platform's store (`--nats URL`), creates a sandbox with a desktop over it,
starts chromium on a local page there and waits for its first paint, then times, from the SDK:
`sb.screenshot()` of the whole screen (the node reads Xvfb's framebuffer file from outside and
encodes PNG; bytes back over the bus), a 200x200 region of it, and one `sb.mouse(x, y,
action="move")` (an xdotool run entered into the sandbox, as exec is). The target for the full
screenshot is p50 < 200 ms on this machine (issue 15).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path


import sandfleet
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json
from sandfleet._sandbox import Sandbox
from sandfleet.cli_desktop import CHROMIUM, PACKAGES
from sandfleet.layers_client import Layers
from schemas.sandbox import DesktopSpec

LAYER = "bench-desktop"
OPS = ("screenshot", "screenshot_region_200", "mouse_move")
PAGE = b"""<!doctype html><html><body style="font:24px sans-serif;background:linear-gradient(#fff,#8cf)">
<h1>sandfleet screenshot benchmark</h1><p>Lorem ipsum dolor sit amet, consectetur adipiscing elit.</p>
<button style="font-size:32px">a button</button><input value="some text"></body></html>"""
ENV = {"SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0",
       "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}


async def _desktop_sandbox(fleet: sandfleet.Fleet, layer: str, screen: DesktopSpec) -> Sandbox:
    return await fleet.create(isolation="container", layers=[layer], memory_mb=2048, pids=4096,
                              labels={"bench": "screenshot"}, desktop=screen, request_timeout_s=120)


async def _painted(sb: Sandbox, timeout_s: float = 180.0) -> None:
    """Until the page's first paint: a screenshot that is no longer one flat colour."""
    deadline = time.monotonic() + timeout_s
    first = None
    while time.monotonic() < deadline:
        png = await sb.screenshot(compression=9)
        if first is None:
            first = png
        elif png != first:
            await asyncio.sleep(2)  # and a moment for the rest of the page
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("chromium never painted its page")


async def run(url: str, args: argparse.Namespace) -> tuple[dict[str, list[float]], dict]:
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    screen = DesktopSpec(width=args.width, height=args.height)
    async with sandfleet.connect(url, name="bench") as fleet:
        layer = args.layer
        if layer is None:
            started = time.monotonic()
            await Layers(fleet.bus).build_debian(LAYER, PACKAGES)
            print(f"desktop layer built in {time.monotonic() - started:.0f} s", file=sys.stderr)
            layer = LAYER
        sb = await _desktop_sandbox(fleet, layer, screen)
        try:
            info = await sb.screen_info()
            await sb.write_file("/tmp/page.html", PAGE)
            await sb.spawn([*CHROMIUM, "--kiosk", "--test-type", "--user-data-dir=/tmp/chromium",
                            "file:///tmp/page.html"], env={"DISPLAY": info.display, "HOME": "/tmp"})
            await _painted(sb)
            sizes = []
            for i in range(args.shots):
                t0 = time.perf_counter()
                png = await sb.screenshot()
                t1 = time.perf_counter()
                await sb.screenshot((0, 0, 200, 200))
                t2 = time.perf_counter()
                await sb.mouse(10 + i % 100, 10, action="move")
                t3 = time.perf_counter()
                for op, s in zip(OPS, (t1 - t0, t2 - t1, t3 - t2)):
                    lat[op].append(s * 1000)
                sizes.append(len(png))
        finally:
            with contextlib.suppress(sandfleet.errors.SandfleetError):
                await sb.destroy()
    return lat, {"png_bytes_p50": sorted(sizes)[len(sizes) // 2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shots", type=int, default=200)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    ap.add_argument("--layer", default=None, help="a desktop layer already in the store of --nats (no build)")
    ap.add_argument("--nats", default=None, help="a running platform (default: start one for the run)")
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/screenshot.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("screenshot: containers need root", file=sys.stderr)
        return 2
    if args.nats:
        lat, extra = asyncio.run(run(args.nats, args))
    else:
        with running_platform(args.node_id, ENV) as (url, _):
            lat, extra = asyncio.run(run(url, args))
    results = {op: {**percentiles(lat[op]), "n": len(lat[op]), "max": round(max(lat[op]), 2)} for op in OPS} | extra
    params = {"shots": args.shots, "width": args.width, "height": args.height, "isolation": "container"}
    print_table(f"screenshot round trip, {args.width}x{args.height} container desktop (ms)",
                ["op", "n", "p50", "p99", "max"],
                [[op, results[op]["n"], results[op]["p50"], results[op]["p99"], results[op]["max"]] for op in OPS])
    print(f"full-screen PNG p50 {extra['png_bytes_p50'] / 1024:.0f} KiB")
    out = write_json(args.out, "screenshot", params | {"out": str(args.out)}, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

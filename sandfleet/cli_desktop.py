"""`sandfleet desktop ...`: the desktop layer, and a sandbox's screen from the command line.

`sandfleet desktop layer [NAME]` builds the layer a sandbox with a `desktop` runs on: one Debian
root (the platform's `--debian` builder) with a virtual X display, a small window manager,
xdotool, Debian's chromium and fonts. The other verbs act on a running sandbox's screen:
`shot ID -o screen.png`, `mouse ID X Y`, `keys ID ctrl+l`, `type ID TEXT`, `info ID`.

`register(sub)` adds the `desktop` command to a parser; `python -m sandfleet.cli_desktop
desktop ...` runs it on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from sandfleet import client
from sandfleet.layers_client import connect

LAYER = "desktop"
# Everything a screen needs, from Debian: xvfb (the X server, drawing into memory), a window
# manager that gives every window the whole screen, xdotool (input, the display's own tool),
# chromium and a font. debootstrap does not resolve virtual packages: dbus-x11 is what provides
# the `dbus-session-bus` chromium's GTK settings backend (dconf) depends on.
PACKAGES = ["xvfb", "matchbox-window-manager", "xdotool", "chromium", "fonts-dejavu-core", "dbus-x11"]
# What chromium needs inside a sandbox: no setuid/namespace sandbox of its own (the sandbox is
# the boundary), no GPU, and its shared memory in /tmp (a sandbox's /dev/shm is small).
CHROMIUM = ["chromium", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--password-store=basic"]


def register(sub: argparse._SubParsersAction) -> None:
    desktop = sub.add_parser("desktop", help="the desktop layer; a sandbox's screen (screenshot, mouse, keys, type)")
    verbs = desktop.add_subparsers(dest="verb", required=True)
    bus = argparse.ArgumentParser(add_help=False)
    bus.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")

    layer = verbs.add_parser("layer", parents=[bus], help=f"build the desktop layer ({' '.join(PACKAGES)})")
    layer.add_argument("name", nargs="?", default=LAYER, help=f"the layer's name (default {LAYER})")
    layer.add_argument("--suite", default="", help="Debian suite (default: the building node's release)")
    layer.set_defaults(func=_layer)

    info = verbs.add_parser("info", parents=[bus], help="the screen's DISPLAY and size (starts the display)")
    info.add_argument("id")
    info.set_defaults(func=_on_screen(lambda sb, a: sb.screen_info()))

    shot = verbs.add_parser("shot", parents=[bus], help="a screenshot, as PNG")
    shot.add_argument("id")
    shot.add_argument("-o", "--output", type=Path, required=True, help="the PNG file to write ('-': stdout)")
    shot.add_argument("--region", type=_region, default=None, metavar="X,Y,W,H", help="a part of the screen")
    shot.set_defaults(func=_shot)

    mouse = verbs.add_parser("mouse", parents=[bus], help="move the pointer to X Y and click (or act) there")
    mouse.add_argument("id")
    mouse.add_argument("x", type=int)
    mouse.add_argument("y", type=int)
    mouse.add_argument("--button", default="left", choices=["left", "middle", "right", "wheel_up", "wheel_down"])
    mouse.add_argument("--action", default="click", choices=["click", "double", "down", "up", "move"])
    mouse.set_defaults(func=_on_screen(lambda sb, a: sb.mouse(a.x, a.y, a.button, a.action)))

    keys = verbs.add_parser("keys", parents=[bus], help="press key chords one after another (ctrl+l Return)")
    keys.add_argument("id")
    keys.add_argument("chords", nargs="+")
    keys.set_defaults(func=_on_screen(lambda sb, a: sb.keys(*a.chords)))

    type_ = verbs.add_parser("type", parents=[bus], help="type text as a keyboard would")
    type_.add_argument("id")
    type_.add_argument("text")
    type_.add_argument("--delay-ms", type=int, default=5)
    type_.set_defaults(func=_on_screen(lambda sb, a: sb.type(a.text, delay_ms=a.delay_ms)))


def _region(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: X,Y,WIDTH,HEIGHT in pixels")
    x, y, w, h = (int(p) for p in parts)
    return x, y, w, h


def _layer(args: argparse.Namespace) -> int:
    async def go() -> int:
        layers = await connect(args.nats, name="sandfleet-cli")
        try:
            started = time.monotonic()
            reply = await layers.build_debian(args.name, PACKAGES, suite=args.suite)
            print(f"{args.name}: {reply.layer.size / 2**20:.1f} MiB, {reply.layer.files} files, "
                  f"built in {time.monotonic() - started:.0f} s; use it with "
                  f"layers=[{args.name!r}], desktop=DesktopSpec()", flush=True)
            return 0
        finally:
            await layers.bus.close()

    return asyncio.run(go())


def _on_screen(act):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        async def go() -> int:
            async with client.connect(args.nats, name="sandfleet-cli") as fleet:
                reply = await act(await fleet.sandbox(args.id), args)
            print(json.dumps({f: getattr(reply, f) for f in reply.__struct_fields__}))
            return 0

        return asyncio.run(go())

    return run


def _shot(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with client.connect(args.nats, name="sandfleet-cli") as fleet:
            sb = await fleet.sandbox(args.id)
            meta, png = await sb.screenshot_with_info(args.region)
        if str(args.output) == "-":
            sys.stdout.buffer.write(png)
        else:
            args.output.write_bytes(png)
            print(f"{args.output}: {meta.width}x{meta.height} at ({meta.x}, {meta.y}) of the "
                  f"{meta.screen_width}x{meta.screen_height} screen, {len(png)} bytes")
        return 0

    return asyncio.run(go())

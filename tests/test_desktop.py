"""Computer use on `container` sandboxes: a real chromium on a real X display (Debian's xvfb,
matchbox, xdotool) in a sandbox over the desktop layer, driven from outside through the bus.

The layer is built once for this module by the platform's Debian builder from the recipe
`sandfleet desktop layer` uses (sandfleet/cli_desktop.py): ~1.1 GiB unpacked, a few minutes.
The page is a local file: a button over the top half of the window and a text field over the
bottom half, each changing its colour on input, so a screenshot tells by its pixels whether a
click, typed text and key chords reached the page. What a screen shows is waited for (a hang
guard only): nothing here is timed. The framebuffer decoder and the key-chord parser are
checked without a platform, the decoder against forged files too (the file lies in the
sandbox's /tmp, its bytes are the sandbox's to forge).
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import time
import zlib

import msgspec
import pytest

from sandfleet import errors
from sandfleet._sandbox import Sandbox
from sandfleet.cli_desktop import CHROMIUM, PACKAGES
from sandfleet.layers_client import Layers
from schemas import desktop as wire
from schemas import node as node_schema
from schemas import sandbox
from schemas.errors import ErrorCode
from schemas.sandbox import DesktopSpec
from services.launcher import framebuffer
from tests.conftest import ROOT
from tests.kernel import require
from tests.layer_trees import busybox_layer

LAYER = "desk-test"
SCREEN = DesktopSpec(width=800, height=600)
SCREEN_WAIT_S = 120.0  # a hang guard: chromium's first paint on a loaded 2-core machine
BLUE, RED, YELLOW, GREEN = (0, 0, 255), (255, 0, 0), (255, 255, 0), (0, 255, 0)
PAGE = """<!doctype html><html><body style="margin:0;overflow:hidden">
<button id="b" style="position:fixed;left:0;top:0;width:100vw;height:50vh;border:0;background:#0000ff"
 onclick="this.style.background='#ff0000'">press</button>
<input id="t" style="position:fixed;left:0;top:50vh;width:100vw;height:50vh;border:0;background:#ffff00;font-size:30px"
 oninput="this.style.background = this.value == 'ok' ? '#00ff00' : '#ffff00'">
</body></html>
"""


# -- without a platform: the framebuffer decoder, PNG, key chords -----------------------------


def _xwd(width: int, height: int, pixel: bytes, *, order: str = ">", byte_order: int = 0,
         masks=(0xFF0000, 0xFF00, 0xFF), ncolors: int = 2, **override) -> bytes:
    """An XWD file as Xvfb keeps its screen (header, window name, colormap, pixels), every pixel `pixel`."""
    fields = dict(header_size=104, version=7, fmt=2, depth=24, width=width, height=height, xoff=0,
                  byte_order=byte_order, unit=32, bit_order=0, pad=32, bpp=32, stride=width * 4, visual=4, red=masks[0], green=masks[1],
                  blue=masks[2], bits_rgb=8, entries=256, ncolors=ncolors, ww=width, wh=height, wx=0, wy=0, border=0)
    fields.update(override)
    header = struct.pack(f"{order}25I", *fields.values()) + b"Xvfb"
    return header + b"\0" * (12 * min(ncolors, 256)) + pixel * (width * height)  # a forged count, a real map


def _decode_png(data: bytes) -> tuple[int, int, bytes]:
    """An 8-bit RGB, unfiltered PNG as framebuffer.png writes it: (width, height, RGB bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack_from(">I", data, pos + 8 + length)[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, *_ = size
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(idat)
    line = width * 3 + 1
    assert all(raw[row * line] == 0 for row in range(height))  # filter type 0 on every row
    return width, height, b"".join(raw[row * line + 1:(row + 1) * line] for row in range(height))


def test_a_framebuffer_in_either_byte_order_becomes_the_same_rgb_png():
    # Blue-green-red in memory (LSB first, X's usual) and the same colour stored MSB first.
    for data in (_xwd(6, 4, bytes([30, 20, 10, 0])), _xwd(6, 4, bytes([0, 10, 20, 30]), order="<", byte_order=1)):
        fb = framebuffer.parse_xwd(data, 6, 4)
        assert _decode_png(framebuffer.png(fb, 0, 0, 6, 4)) == (6, 4, bytes([10, 20, 30]) * 24)
        assert _decode_png(framebuffer.png(fb, 2, 1, 3, 2, level=9)) == (3, 2, bytes([10, 20, 30]) * 6)


def test_a_forged_framebuffer_file_is_refused_never_read_past():
    good = _xwd(8, 8, b"\0\0\xff\0")
    framebuffer.parse_xwd(good, 8, 8)
    forged = {
        "short": good[:50], "truncated pixels": good[:-1], "not xwd": b"\0" * 400,
        "another size": _xwd(9, 8, b"\0" * 4), "16 bits a pixel": _xwd(8, 8, b"\0" * 4, bpp=16),
        "huge header": _xwd(8, 8, b"\0" * 4, header_size=1 << 30),
        "huge colormap": _xwd(8, 8, b"\0" * 4, ncolors=1 << 31),
        "huge rows": _xwd(8, 8, b"\0" * 4, stride=1 << 30), "narrow rows": _xwd(8, 8, b"\0" * 4, stride=8),
        "overlapping masks": _xwd(8, 8, b"\0" * 4, masks=(0xFF, 0xFF, 0xFF00)),
        "odd mask": _xwd(8, 8, b"\0" * 4, masks=(0xF0F0, 0xFF00, 0xFF)),
        "bitmap format": _xwd(8, 8, b"\0" * 4, fmt=1),
    }
    for why, data in forged.items():
        with pytest.raises(ValueError):
            framebuffer.parse_xwd(data, 8, 8)
            pytest.fail(f"{why}: accepted")
    fb = framebuffer.parse_xwd(good, 8, 8)
    for region in ((0, 0, 9, 8), (7, 0, 2, 1), (0, 8, 1, 1), (-1, 0, 1, 1), (0, 0, 0, 1)):
        with pytest.raises(ValueError):
            framebuffer.png(fb, *region)


def test_key_chords_name_known_keys_or_are_refused_before_anything_is_sent():
    chords = ("ctrl+L", "Return", "shift+tab", "alt+F4", "ctrl+shift+t", "a", "A", "/")
    assert [wire.chord_keysyms(c) for c in chords] == [
        "ctrl+l", "Return", "shift+Tab", "alt+F4", "ctrl+shift+t", "a", "A", "slash"]
    for bad in ("", "+", "ctrl+", "ctrl++", "hyper+a", "foo", "ctrl+foo", "é", "Return Tab", "ctrl+a+b"):
        with pytest.raises(ValueError):
            wire.chord_keysyms(bad)
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode({"type": "screen.keys", "sandbox_id": "sb-1", "keys": [bad]}),
                                type=wire.KeysRequest)


def test_a_desktop_spec_has_bounds_and_needs_layers():
    assert sandbox.SandboxSpec().desktop is None
    for bad in ({"width": 100}, {"height": 10_000}, {"width": "800"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"desktop": bad}, sandbox.SandboxSpec)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"host_view": True, "desktop": {}}, sandbox.SandboxSpec)


# -- on the platform ------------------------------------------------------------------------


async def _create(fleet, desktop: DesktopSpec | None, **spec) -> Sandbox:
    return await fleet.create(desktop=desktop, request_timeout_s=120, **spec)


@pytest.fixture(scope="module")
async def desktop_layer(fleet):
    require(os.geteuid() == 0, "sandboxes need root")
    started = time.monotonic()
    built = await Layers(fleet.bus).build_debian(LAYER, PACKAGES)
    print(f"\ndesktop: layer {LAYER}: {built.layer.size / 2**20:.0f} MiB, built in {time.monotonic() - started:.0f} s")
    return LAYER


@pytest.fixture(scope="module")
async def desk(fleet, desktop_layer):
    sb = await _create(fleet, SCREEN, isolation="container", layers=[desktop_layer], memory_mb=2048, pids=4096)
    try:
        yield sb
    finally:
        await sb.destroy()


def _pixel(png: bytes, x: int, y: int) -> tuple[int, int, int]:
    width, _, rgb = _decode_png(png)
    at = (y * width + x) * 3
    return tuple(rgb[at:at + 3])  # type: ignore[return-value]


async def _until(sb: Sandbox, x: int, y: int, colour: tuple[int, int, int]) -> bytes:
    """Screenshots of a small region around (x, y) until its centre has `colour`; the last one."""
    deadline = time.monotonic() + SCREEN_WAIT_S
    while True:
        png = await sb.screenshot((x - 5, y - 5, 11, 11))
        if _pixel(png, 5, 5) == colour:
            return png
        assert time.monotonic() < deadline, f"({x}, {y}) is {_pixel(png, 5, 5)}, never {colour}"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(900)  # the module's first test builds the layer
async def test_chromium_on_the_sandbox_screen_changes_when_clicked_typed_into_and_keyed(desk):
    screen = await desk.screen_info()
    assert (screen.display, screen.width, screen.height) == (wire.DISPLAY, SCREEN.width, SCREEN.height)
    await desk.write_file("/tmp/page.html", PAGE.encode())
    browser = await desk.spawn([*CHROMIUM, "--kiosk", "--test-type", "--user-data-dir=/tmp/chromium",
                                "file:///tmp/page.html"], env={"DISPLAY": screen.display, "HOME": "/tmp"})
    # Clicked on the left, looked at on the right: the pointer (drawn into the framebuffer), the
    # button's label and the typed text stay clear of where the colour is read.
    w, h = SCREEN.width, SCREEN.height
    button, button_seen = (w // 4, h // 4), (w * 7 // 8, h // 8)
    field, field_seen = (w // 4, h * 3 // 4), (w * 7 // 8, h * 7 // 8)
    await _until(desk, *button_seen, BLUE)  # the page is up
    whole = await desk.screenshot()
    assert _decode_png(whole)[:2] == (w, h)
    assert _pixel(whole, *button_seen) == BLUE and _pixel(whole, *field_seen) == YELLOW

    await desk.mouse(*button)
    await _until(desk, *button_seen, RED)
    assert _pixel(await desk.screenshot(), *field_seen) == YELLOW  # only the button changed

    await desk.mouse(*field)  # focus the field
    await desk.type("ok")
    await _until(desk, *field_seen, GREEN)
    await desk.keys("ctrl+a", "BackSpace")
    await _until(desk, *field_seen, YELLOW)
    meta, png = await desk.screenshot_with_info((10, 20, 30, 40))
    assert (meta.x, meta.y, meta.width, meta.height, meta.screen_width) == (10, 20, 30, 40, SCREEN.width)
    assert _decode_png(png)[:2] == (30, 40)
    await browser.kill()


async def test_bad_screen_input_is_refused_typed_and_changes_nothing(fleet, desk, tmp_path_factory):
    off = [(SCREEN.width, 0), (0, SCREEN.height), (5000, 5), (-1, 0)]
    for x, y in off:
        with pytest.raises(errors.InvalidRequest):
            await desk.mouse(x, y)
    for region in ((0, 0, SCREEN.width + 1, 10), (SCREEN.width - 1, 0, 2, 2), (0, 0, 0, 5)):
        with pytest.raises(errors.InvalidRequest):
            await desk.screenshot(region)
    with pytest.raises(errors.InvalidRequest):
        await desk.keys("ctrl+nokey")
    with pytest.raises(errors.InvalidRequest):
        await desk.mouse(1, 1, button="fourth")
    with pytest.raises(errors.InvalidRequest):
        await desk.type("")
    # The node refuses what the SDK would have: sent as any client could.
    body = msgspec.json.encode({"type": "screen.keys", "sandbox_id": desk.id, "keys": ["Hyper_Q"]})
    with pytest.raises(errors.ServiceFailure) as refused:
        await fleet.bus.request(node_schema.subject(desk.node, wire.KEYS_PRESS), body, wire.InputDone, timeout=30)
    assert refused.value.code == ErrorCode.INVALID_REQUEST
    assert _decode_png(await desk.screenshot())[:2] == (SCREEN.width, SCREEN.height)  # the screen is still there

    plain = await fleet.create(memory_mb=64, host_view=True)  # no desktop asked for
    try:
        with pytest.raises(errors.Unsupported):
            await plain.screenshot()
        with pytest.raises(errors.Unsupported):
            await plain.mouse(1, 1)
    finally:
        await plain.destroy()
    base = await busybox_layer(fleet, tmp_path_factory, "desk-nox")
    bare = await _create(fleet, SCREEN, isolation="container", layers=[base], memory_mb=64)  # a desktop, no Xvfb
    try:
        with pytest.raises(errors.Unsupported, match="desktop"):
            await bare.screen_info()
    finally:
        await bare.destroy()


async def test_the_cli_writes_a_screenshot_and_presses_keys(platform, desk, tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sandfleet.cli", "desktop", *args, "--nats", platform.url],
                              env=platform.env, capture_output=True, text=True, timeout=120, cwd=ROOT)

    shot = await asyncio.to_thread(cli, "shot", desk.id, "-o", str(tmp_path / "s.png"), "--region", "0,0,64,32")
    assert shot.returncode == 0, shot.stderr
    assert _decode_png((tmp_path / "s.png").read_bytes())[:2] == (64, 32)
    pressed = await asyncio.to_thread(cli, "keys", desk.id, "Escape")
    assert pressed.returncode == 0 and "duration_ms" in pressed.stdout, pressed.stderr
    refused = await asyncio.to_thread(cli, "keys", desk.id, "ctrl+nokey")
    assert refused.returncode == 2 and "InvalidRequest" in refused.stderr, refused.stderr

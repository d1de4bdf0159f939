"""A sandbox's screen, from the client: screenshots and input (schemas/desktop.py).

The sandbox must have been created with `desktop=DesktopSpec(width, height)` over layers that
have a display (`sandfleet desktop layer` builds them); its programs draw on `DISPLAY` (":0",
also in `screen_info()`). Everything goes to the node holding the sandbox, which drives the
display from outside it: the same calls work for any isolation level that offers a desktop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandfleet._requests import _convert
from schemas import desktop as wire

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox

TIMEOUT_S = 60.0  # the first request of a sandbox starts its display


async def screen_info(sb: Sandbox) -> wire.ScreenInfo:
    req = wire.ScreenInfoRequest(sandbox_id=sb.id)
    return await sb._fleet.bus.request(sb._subject(wire.SCREEN_INFO), req, wire.ScreenInfo, timeout=TIMEOUT_S)


async def screenshot(sb: Sandbox, region: tuple[int, int, int, int] | None,
                     compression: int) -> tuple[wire.Screenshot, bytes]:
    raw = dict(sandbox_id=sb.id, compression=compression)
    if region is not None:
        x, y, width, height = region
        raw["region"] = dict(x=x, y=y, width=width, height=height)
    req = _convert(raw, wire.ScreenshotRequest)
    return await sb._fleet.bus.request_raw(sb._subject(wire.SCREENSHOT), req, wire.Screenshot, timeout=TIMEOUT_S)


async def mouse(sb: Sandbox, x: int, y: int, button: str, action: str) -> wire.InputDone:
    req = _convert(dict(sandbox_id=sb.id, x=x, y=y, button=button, action=action), wire.MouseRequest)
    return await sb._fleet.bus.request(sb._subject(wire.MOUSE), req, wire.InputDone, timeout=TIMEOUT_S)


async def keys(sb: Sandbox, chords: tuple[str, ...]) -> wire.InputDone:
    req = _convert(dict(sandbox_id=sb.id, keys=list(chords)), wire.KeysRequest)
    return await sb._fleet.bus.request(sb._subject(wire.KEYS_PRESS), req, wire.InputDone, timeout=TIMEOUT_S)


async def type_text(sb: Sandbox, text: str, delay_ms: int) -> wire.InputDone:
    req = _convert(dict(sandbox_id=sb.id, text=text, delay_ms=delay_ms), wire.TypeRequest)
    timeout = TIMEOUT_S + len(text) * delay_ms / 1000
    return await sb._fleet.bus.request(sb._subject(wire.TYPE_TEXT), req, wire.InputDone, timeout=timeout)

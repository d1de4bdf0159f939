"""Sandboxes' screens on this node: the `screen.*` endpoints (schemas/desktop.py), small functions
of (request, launcher), and the X display that namespace levels drive from outside.

A sandbox created with a `desktop` gets its screen when the first `screen.*` request comes (or
when the launch asks for it, see `ensure`): a `Screen` kept in `Live.attached`, so it ends
before the sandbox's processes go. For `process` and `container` sandboxes that is `XDisplay`:
Xvfb and a small window manager from the sandbox's own layers, started as its processes by the
driver's `spawn`; input goes by the display's own `xdotool` run through the driver's `exec`, the
way every command enters a sandbox; screenshots read Xvfb's framebuffer file (`-fbdir`) from
outside with the driver's `read_file` and encode it to PNG on the node (framebuffer.py). So
nothing of the platform runs or listens inside the sandbox, and no screenshot spawns a process.

Another level plugs in its own `Screen` through its driver: a driver with a `screen(instance,
desktop)` method is asked for it instead of `XDisplay`. The `vm` level does (drivers/vm.py
`VMScreen`): its screen is the machine's card, read and fed through QEMU's monitor (QMP screen
dump and input events), with X in the guest started through the agent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from sandfleet.bus import Endpoint, Raw
from sandfleet.errors import ServiceError
from schemas import desktop as wire
from schemas import node as node_schema
from schemas.errors import ErrorCode
from schemas.sandbox import DesktopSpec
from services.launcher import framebuffer
from services.launcher.driver_errors import translated
from services.launcher.drivers.base import Command, Driver, ExecFailed, Instance, RunningCommand, Unsupported
from services.launcher.keys import LOGGER, about, tag

if TYPE_CHECKING:  # not at run time: the launch path (lifecycle) may call `ensure` without a cycle
    from services.launcher.lifecycle import Launcher
    from services.launcher.state import Live

log = logging.getLogger(LOGGER)

NAME = "desktop"  # its key in Live.attached
FB_DIR = "/tmp"  # Xvfb keeps its framebuffer there as `Xvfb_screen0`, in the sandbox's own tmpfs
FB_FILE = f"{FB_DIR}/Xvfb_screen0"
SERVER = "Xvfb"
WINDOW_MANAGER = ["matchbox-window-manager", "-use_titlebar", "no"]  # every window fills the screen
START_S = 30.0  # for the display to answer, on a loaded machine
POLL_S = 0.05
TOOL_TIMEOUT_S = 30.0
MAX_PNG = 7 << 20  # under the bus's 8 MiB payload, with room for the headers
BUTTONS = {"left": "1", "middle": "2", "right": "3", "wheel_up": "4", "wheel_down": "5"}
TAIL = 4096  # bytes of the display server's output kept to say why it failed


class Screen(Protocol):
    """What a level offers for one sandbox's desktop."""

    display: str
    width: int
    height: int

    async def start(self) -> None:
        """Bring the display up if it is not (idempotent); Unsupported if the sandbox cannot have one."""

    async def shot(self, region: wire.Region | None, level: int) -> tuple[wire.Screenshot, bytes]:
        """The screen (or region) as PNG bytes; ValueError for a region off the screen."""

    async def pointer(self, x: int, y: int, button: str, action: str) -> None: ...

    async def keys(self, chords: list[str]) -> None: ...

    async def type_text(self, text: str, delay_ms: int) -> None: ...

    async def end(self) -> None: ...


class XDisplay:
    """Xvfb + window manager in a namespace sandbox, driven through the driver's seam."""

    display = wire.DISPLAY

    def __init__(self, driver: Driver, instance: Instance, spec: DesktopSpec, sandbox_id: str) -> None:
        self.driver, self.instance, self.sandbox_id = driver, instance, sandbox_id
        self.width, self.height = spec.width, spec.height
        self.starting = asyncio.Lock()
        self.adopted = False  # a display that answered before this launcher started one (a restart)
        self.server: _Server | None = None  # the display server this launcher started, and its window manager

    # -- the display's processes ---------------------------------------------------------

    async def start(self) -> None:
        async with self.starting:
            if (self.server is not None and self.server.ended is None) or (self.server is None and self.adopted):
                return  # it runs (a failed input is no reason to restart it under the sandbox's programs)
            self._close()
            if await self._geometry() == (self.width, self.height):
                self.adopted = True
                return
            server = self.server = _Server()
            argv = [SERVER, self.display, "-screen", "0", f"{self.width}x{self.height}x24", "-fbdir", FB_DIR,
                    "-nolisten", "tcp", "-noreset"]
            try:
                server.running.append(await self._spawn(argv, server.said, server.exited))
                await self._wait_for(server)
            except BaseException:
                self._close()
                raise
            try:  # without it, windows open where their program says: usable, so a failure is only logged
                server.running.append(await self._spawn(WINDOW_MANAGER, lambda _s, _d: None, lambda _w: None))
            except Unsupported as exc:
                log.warning("sandbox %s: no window manager (%s)", self.sandbox_id, exc, extra=about(self.sandbox_id))

    async def _spawn(self, argv: list[str], on_output: Callable[[int, bytes], None],
                     on_exit: Callable[[int], None]) -> RunningCommand:
        command = Command(argv=argv, env={"DISPLAY": self.display}, cwd="/", max_output=2 * TAIL)
        try:
            return await self.driver.spawn(self.instance, command, on_output, on_exit)
        except ExecFailed as exc:
            raise Unsupported(f"cannot start {argv[0]} in the sandbox ({exc}): its layers need the desktop "
                              "stack (`sandfleet desktop layer`)") from None

    async def _wait_for(self, server: _Server) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if server.ended is not None:
                said = server.output.decode(errors="replace").strip().splitlines()[-3:]
                raise Unsupported(f"the display server ended at its start (status {server.ended}): "
                                  f"{' / '.join(said) or 'nothing said'}; the sandbox's layers need the desktop "
                                  "stack (`sandfleet desktop layer`)")
            if await self._geometry() is not None:
                return
            await asyncio.sleep(POLL_S)
        raise TimeoutError(f"the display did not answer within {START_S:g} s")

    async def _geometry(self) -> tuple[int, int] | None:
        """The display's size as xdotool sees it; None while nothing answers on it."""
        out = await self._run(["xdotool", "getdisplaygeometry"], check=False)
        words = out.stdout.split()
        if out.exit_code != 0 or len(words) != 2 or not all(w.isdigit() for w in words):
            return None
        return int(words[0]), int(words[1])

    def _close(self) -> None:
        self.adopted = False
        if self.server is not None:
            for running in reversed(self.server.running):
                running.close()
            self.server = None

    async def end(self) -> None:
        self._close()

    # -- what the caller sees and does ---------------------------------------------------

    async def shot(self, region: wire.Region | None, level: int) -> tuple[wire.Screenshot, bytes]:
        x, y, w, h = (0, 0, self.width, self.height) if region is None else (
            region.x, region.y, region.width, region.height)
        if x + w > self.width or y + h > self.height:
            raise ValueError(f"region {w}x{h} at ({x}, {y}) is not within the {self.width}x{self.height} screen")
        try:
            data = await asyncio.to_thread(self.driver.read_file, self.instance, FB_FILE,
                                           framebuffer.file_limit(self.width, self.height))
            png = await asyncio.to_thread(_encode, data, self.width, self.height, x, y, w, h, level)
        except (ValueError, OSError) as exc:  # the sandbox's own file: its to break, not the caller's request
            raise ServiceError(ErrorCode.CONFLICT, f"the sandbox's screen is unreadable: {exc}") from None
        if len(png) > MAX_PNG:
            raise ServiceError(ErrorCode.CAPACITY, f"the screenshot is {len(png)} bytes, over the bus's limit: "
                                                   "ask for a region of the screen")
        return wire.Screenshot(x=x, y=y, width=w, height=h, screen_width=self.width,
                               screen_height=self.height), png

    async def pointer(self, x: int, y: int, button: str, action: str) -> None:
        if x >= self.width or y >= self.height:
            raise ValueError(f"({x}, {y}) is off the {self.width}x{self.height} screen")
        b = BUTTONS[button]
        then = {"move": [], "click": ["click", b], "double": ["click", "--repeat", "2", "--delay", "60", b],
                "down": ["mousedown", b], "up": ["mouseup", b]}[action]
        await self._run(["xdotool", "mousemove", str(x), str(y), *then])

    async def keys(self, chords: list[str]) -> None:
        await self._run(["xdotool", "key", "--delay", "12", *(wire.chord_keysyms(c) for c in chords)])

    async def type_text(self, text: str, delay_ms: int) -> None:
        # Through stdin: the text is never an argument, so none of it can read as an option.
        await self._run(["xdotool", "type", "--delay", str(delay_ms), "--file", "-"], stdin=text.encode(),
                        timeout_s=TOOL_TIMEOUT_S + len(text) * delay_ms / 1000)

    async def _run(self, argv: list[str], *, stdin: bytes = b"", check: bool = True,
                   timeout_s: float = TOOL_TIMEOUT_S):
        command = Command(argv=argv, env={"DISPLAY": self.display}, cwd="/", stdin=stdin, timeout_s=timeout_s,
                          max_output=64 << 10)
        out = await self.driver.exec(self.instance, command)
        if not check:
            return out
        said = out.stderr.decode(errors="replace").strip()
        if out.exit_code == 127:
            raise Unsupported(f"the sandbox has no {argv[0]}: its layers need the desktop stack "
                              "(`sandfleet desktop layer`)")
        if out.timed_out:
            raise TimeoutError(f"{argv[0]} {argv[1]} did not finish within {timeout_s:g} s")
        if out.exit_code != 0 or "No such key" in said or "Invalid" in said:
            self.adopted = False  # a display this launcher did not start is looked at again next time
            raise ServiceError(ErrorCode.CONFLICT, f"the display refused {argv[1]}: {said[-300:] or out.exit_code}")
        return out


class _Server:
    """One start of the display server: its processes, the tail of what it said, how it ended."""

    def __init__(self) -> None:
        self.running: list[RunningCommand] = []
        self.output = bytearray()
        self.ended: int | None = None  # its wait status, once it has ended

    def said(self, _stream: int, data: bytes) -> None:
        self.output += data
        del self.output[:-TAIL]

    def exited(self, wait_status: int) -> None:
        self.ended = wait_status


def _encode(data: bytes, width: int, height: int, x: int, y: int, w: int, h: int, level: int) -> bytes:
    return framebuffer.png(framebuffer.parse_xwd(data, width, height), x, y, w, h, level)


# -- endpoints ---------------------------------------------------------------------------


def _screen_of(live: Live) -> Screen:
    desktop = live.spec.desktop
    assert desktop is not None
    own = getattr(live.driver, "screen", None)  # a level with a screen of its own (a VM's monitor)
    return own(live.instance, desktop) if own is not None else XDisplay(live.driver, live.instance, desktop, live.id)


async def ensure(launcher: Launcher, sandbox_id: str) -> Screen:
    """The sandbox's screen, its display up; what every endpoint does first, and what a launch
    of a sandbox with a desktop may call once it is live so its programs find the display."""
    live = launcher.get_live(sandbox_id)
    if live.spec.desktop is None:
        raise ServiceError(ErrorCode.UNSUPPORTED, f"sandbox {sandbox_id} has no desktop: create it with "
                                                  "desktop=DesktopSpec(width, height) over the desktop layer")
    if live.quarantined or live.paused:
        state = "quarantined" if live.quarantined else "paused"
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is {state}: its screen does not change")
    screen = live.attached.get(NAME)
    if screen is None:
        screen = live.attached[NAME] = _screen_of(live)  # type: ignore[assignment]
    with translated(f"the screen of {sandbox_id}", path=False):
        await screen.start()  # type: ignore[union-attr]
    return screen  # type: ignore[return-value]


async def info(launcher: Launcher, req: wire.ScreenInfoRequest) -> wire.ScreenInfo:
    tag(launcher.node_id, req.sandbox_id)
    screen = await ensure(launcher, req.sandbox_id)
    return wire.ScreenInfo(display=screen.display, width=screen.width, height=screen.height)


async def shot(launcher: Launcher, req: wire.ScreenshotRequest) -> Raw:
    tag(launcher.node_id, req.sandbox_id)
    screen = await ensure(launcher, req.sandbox_id)
    with translated(f"the screen of {req.sandbox_id}", path=False):
        meta, png = await screen.shot(req.region, req.compression)
    return Raw(meta=meta, data=png)


async def _input(launcher: Launcher, sandbox_id: str, send) -> wire.InputDone:
    tag(launcher.node_id, sandbox_id)
    screen = await ensure(launcher, sandbox_id)
    started = time.perf_counter()
    with translated(f"the screen of {sandbox_id}", path=False):
        await send(screen)
    return wire.InputDone(duration_ms=(time.perf_counter() - started) * 1000)


async def mouse(launcher: Launcher, req: wire.MouseRequest) -> wire.InputDone:
    return await _input(launcher, req.sandbox_id, lambda s: s.pointer(req.x, req.y, req.button, req.action))


async def keys(launcher: Launcher, req: wire.KeysRequest) -> wire.InputDone:
    return await _input(launcher, req.sandbox_id, lambda s: s.keys(list(req.keys)))


async def type_text(launcher: Launcher, req: wire.TypeRequest) -> wire.InputDone:
    return await _input(launcher, req.sandbox_id, lambda s: s.type_text(req.text, req.delay_ms))


def endpoints(launcher: Launcher) -> list[Endpoint]:
    n, h, s = launcher.node_id, functools.partial, node_schema
    return [
        Endpoint("screen_info", s.subject(n, wire.SCREEN_INFO), wire.ScreenInfoRequest, h(info, launcher)),
        Endpoint("screen_shot", s.subject(n, wire.SCREENSHOT), wire.ScreenshotRequest, h(shot, launcher)),
        Endpoint("screen_mouse", s.subject(n, wire.MOUSE), wire.MouseRequest, h(mouse, launcher)),
        Endpoint("screen_keys", s.subject(n, wire.KEYS_PRESS), wire.KeysRequest, h(keys, launcher)),
        Endpoint("screen_type", s.subject(n, wire.TYPE_TEXT), wire.TypeRequest, h(type_text, launcher)),
    ]

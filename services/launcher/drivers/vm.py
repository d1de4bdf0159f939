"""The `vm` level: a full QEMU machine per sandbox (q35, SeaBIOS, a VGA screen, a virtio tablet
and keyboard: linuxnode/vm/full_machine.py) around the microVM's guest kernel, initramfs, agent
and layer disks. Everything inside goes through the guest agent exactly as for `microvm`, so
the driver is the microVM's, on other machines; what a full machine adds is its screen.

**Its screen** (`screen(instance, desktop)`, asked for by services/launcher/desktop.py): what the
card shows is read by QMP `screendump` and input goes in by QMP `input-send-event`
(linuxnode/vm/display.py), never through the guest. Something must draw: the sandbox's own
layers bring an X server on the card's framebuffer (Debian's Xorg, modesetting driver on the
bochs DRM device, evdev for the tablet and keyboard) and a small window manager; the node
starts them as the sandbox's processes through the agent, with an X config it writes naming
the guest's input devices (no udev in the guest to find them). `sandfleet layer build
vm-desktop --debian` with full_machine.VM_DESKTOP_PACKAGES makes such a layer (README, "The
`vm` level").

A `vm` without a `desktop` still has its card (1024x768): a screen is part of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from linuxnode.vm import machine, vm_guest
from linuxnode.vm.display import MonitorScreen, qcodes, typed
from linuxnode.vm.full_machine import DEFAULT_SCREEN, FIRMWARE, VM_DESKTOP_PACKAGES, FullMachines, screen_size
from linuxnode.vm.qmp import QmpError
from sandfleet.errors import ServiceError
from schemas import desktop as wire
from schemas.errors import ErrorCode
from schemas.layers import Rootfs
from schemas.node import Confinement
from schemas.sandbox import DesktopSpec, SandboxSpec
from services.launcher import framebuffer
from services.launcher.drivers.base import (
    Command,
    ExecFailed,
    Instance,
    LaunchRefused,
    RunningCommand,
    SandboxGone,
    Unsupported,
)
from services.launcher.drivers.microvm import MicroVMDriver, VMSandbox, _own, detect_vm_host
from services.launcher.keys import LOGGER, about

log = logging.getLogger(LOGGER)

SEABIOS = Path("/usr/share/seabios/bios-256k.bin")
X_CONFIG = "/tmp/sandfleet-xorg.conf"
X_LOG = "/tmp/sandfleet-xorg.log"
# No TCP, no reset when the last client goes, no screen saver; no GLX: its software renderer
# took ~20 s of X's ~45 s start in a TCG guest, and nothing here renders GL.
X_OPTIONS = ["-nolisten", "tcp", "-noreset", "-s", "0", "-dpms", "-extension", "GLX", "vt1"]
# X's socket and lock exist from early in its start: an X server a launcher before this one
# started (a restart) is taken as up by them; one this launcher starts says so by -displayfd.
X_UP = "test -S /tmp/.X11-unix/X0 && kill -0 $(cat /tmp/.X0-lock) 2>/dev/null"
WINDOW_MANAGER = ["matchbox-window-manager", "-use_titlebar", "no"]
START_S = 180.0  # for X to answer: its first start in a TCG guest on a loaded node
POLL_S = 0.2
TAIL = 4096
MAX_PNG = 7 << 20
INPUT_NAMES = {"tablet": "QEMU Virtio Tablet", "keyboard": "QEMU Virtio Keyboard"}
_EVENT_LINE = re.compile(r"(event\d{1,3})=(.{1,80})")


def x_config(tablet: str, keyboard: str) -> str:
    """Xorg on the card's DRM device, input from exactly these evdev nodes, nothing hotplugged,
    no screen saver (a screenshot shows what the programs drew, not a blanked card)."""
    return f"""Section "ServerFlags"
    Option "AutoAddDevices" "false"
    Option "AutoEnableDevices" "false"
    Option "DontVTSwitch" "true"
    Option "BlankTime" "0"
    Option "StandbyTime" "0"
    Option "SuspendTime" "0"
    Option "OffTime" "0"
EndSection
Section "Device"
    Identifier "card"
    Driver "modesetting"
    Option "kmsdev" "/dev/dri/card0"
    Option "AccelMethod" "none"
EndSection
Section "Screen"
    Identifier "screen"
    Device "card"
    DefaultDepth 24
EndSection
Section "InputDevice"
    Identifier "tablet"
    Driver "evdev"
    Option "Device" "/dev/input/{tablet}"
EndSection
Section "InputDevice"
    Identifier "keyboard"
    Driver "evdev"
    Option "Device" "/dev/input/{keyboard}"
    Option "XkbLayout" "us"
EndSection
Section "ServerLayout"
    Identifier "layout"
    Screen "screen"
    InputDevice "tablet" "CorePointer"
    InputDevice "keyboard" "CoreKeyboard"
EndSection
"""


def input_devices(listing: str) -> dict[str, str]:
    """{"tablet": "eventN", "keyboard": "eventM"} from the guest's `eventN=<name>` lines (its word,
    so only lines of the exact form count); ValueError if either is missing."""
    found: dict[str, str] = {}
    for line in listing.splitlines()[:64]:
        match = _EVENT_LINE.fullmatch(line.strip())
        if match:
            for role, name in INPUT_NAMES.items():
                if match.group(2) == name:
                    found.setdefault(role, match.group(1))
    missing = [INPUT_NAMES[r] for r in INPUT_NAMES if r not in found]
    if missing:
        raise ValueError(f"the guest shows no {' nor '.join(missing)} input device")
    return found


@contextlib.contextmanager
def _monitor_errors() -> Iterator[None]:
    """QMP failing under a call means QEMU went (or refused what the node built): the sandbox's state."""
    try:
        yield
    except QmpError as exc:
        raise SandboxGone(f"the vm's monitor: {exc}") from None


def _png(rgb: bytes, width: int, height: int, x: int, y: int, w: int, h: int, level: int) -> bytes:
    rgbx = bytearray(width * height * 4)
    for channel in range(3):
        rgbx[channel::4] = rgb[channel::3]
    fb = framebuffer.Framebuffer(width, height, width * 4, 0, (0, 1, 2), bytes(rgbx))
    return framebuffer.png(fb, x, y, w, h, level)


class VMScreen:
    """A `vm`'s screen: the card through QEMU's monitor, X in the guest through the driver."""

    display = wire.DISPLAY

    def __init__(self, driver: VMDriver, sandbox: VMSandbox, width: int, height: int) -> None:
        self.driver, self.sandbox = driver, sandbox
        self.width, self.height = width, height
        self.monitor: MonitorScreen | None = None
        self.starting = asyncio.Lock()
        self.running: list[RunningCommand] = []
        self.said = bytearray()
        self.ended: int | None = None
        self.adopted = False  # an X server that answered before this launcher started one
        self.ready = False  # the X server this launcher started takes clients

    async def start(self) -> None:
        async with self.starting:
            if self.monitor is None:
                with _monitor_errors():
                    self.monitor = await MonitorScreen.open(self.sandbox.vm.run_dir, self.width, self.height)
            if (self.running and self.ended is None) or (not self.running and self.adopted):
                return  # it runs (a failed input is no reason to restart it under the sandbox's programs)
            self._end_x()
            if await self._x_up():  # started by a launcher before this one (a restart)
                self.adopted = True
                return
            listing = await self._run(["sh", "-c", 'for e in /sys/class/input/event*; do '
                                       'printf "%s=%s\\n" "${e##*/}" "$(cat "$e/device/name")"; done'])
            devices = input_devices(listing.decode(errors="replace"))
            config = x_config(devices["tablet"], devices["keyboard"]).encode()
            await asyncio.to_thread(self.driver.write_file, self.sandbox, X_CONFIG, config, 0o644)
            self.ended, self.said, self.ready = None, bytearray(), False
            try:
                self.running.append(await self._spawn(
                    ["Xorg", self.display, "-config", X_CONFIG, "-logfile", X_LOG, "-displayfd", "1", *X_OPTIONS],
                    self._heard, self._exited))
                await self._wait_for_x()
            except BaseException:
                self._end_x()  # the next request starts it again
                raise
            try:  # without it windows open where their program says: usable, so only logged
                self.running.append(await self._spawn(WINDOW_MANAGER, lambda _s, _d: None, lambda _w: None))
            except Unsupported as exc:
                log.warning("sandbox %s: no window manager (%s)", self.sandbox.sandbox_id, exc,
                            extra=about(self.sandbox.sandbox_id))

    def _heard(self, stream: int, data: bytes) -> None:
        if stream == 1:  # -displayfd 1: the display's number, written once X takes clients
            self.ready = self.ready or data.strip() == self.display.lstrip(":").encode()
            return
        self.said += data
        del self.said[:-TAIL]

    def _exited(self, status: int) -> None:
        self.ended = status

    async def _wait_for_x(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.ended is not None:
                said = self.said.decode(errors="replace").strip().splitlines()[-3:]
                raise Unsupported(f"the X server ended at its start (status {self.ended}): "
                                  f"{' / '.join(said) or 'nothing said'} (see {X_LOG} in the sandbox); its "
                                  f"layers need a vm desktop ({' '.join(VM_DESKTOP_PACKAGES)})")
            if self.ready:
                return
            await asyncio.sleep(POLL_S)
        raise TimeoutError(f"the X server did not answer within {START_S:g} s")

    async def _x_up(self) -> bool:
        out = await self.driver.exec(self.sandbox, Command(argv=["sh", "-c", X_UP], cwd="/", timeout_s=30))
        return out.exit_code == 0

    async def _run(self, argv: list[str]) -> bytes:
        out = await self.driver.exec(self.sandbox, Command(argv=argv, cwd="/", timeout_s=30, max_output=64 << 10))
        if out.exit_code != 0:
            raise Unsupported(f"{argv[0]} failed in the vm: {out.stderr[-300:].decode(errors='replace')}")
        return out.stdout

    async def _spawn(self, argv: list[str], on_output: Callable[[int, bytes], None],
                     on_exit: Callable[[int], None]) -> RunningCommand:
        command = Command(argv=argv, env={"DISPLAY": self.display}, cwd="/", max_output=2 * TAIL)
        try:
            return await self.driver.spawn(self.sandbox, command, on_output, on_exit)
        except ExecFailed as exc:
            raise Unsupported(f"cannot start {argv[0]} in the vm ({exc}): its layers need a vm desktop "
                              f"({' '.join(VM_DESKTOP_PACKAGES)})") from None

    def _end_x(self) -> None:
        self.adopted = False
        for running in reversed(self.running):
            running.close()
        self.running = []

    async def end(self) -> None:
        self._end_x()
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

    # -- what the caller sees and does ---------------------------------------------------

    def _monitor(self) -> MonitorScreen:
        if self.monitor is None:
            raise Unsupported("the vm's screen is not started")
        return self.monitor

    async def shot(self, region: wire.Region | None, level: int) -> tuple[wire.Screenshot, bytes]:
        x, y, w, h = (0, 0, self.width, self.height) if region is None else (
            region.x, region.y, region.width, region.height)
        if x + w > self.width or y + h > self.height:
            raise ValueError(f"region {w}x{h} at ({x}, {y}) is not within the {self.width}x{self.height} screen")
        with _monitor_errors():
            try:
                rgb = await self._monitor().screendump()
            except ValueError as exc:  # QEMU's dump, checked as hostile: not the caller's request
                raise ServiceError(ErrorCode.CONFLICT, f"the vm's screen is unreadable: {exc}") from None
        png = await asyncio.to_thread(_png, rgb, self.width, self.height, x, y, w, h, level)
        if len(png) > MAX_PNG:
            raise ServiceError(ErrorCode.CAPACITY, f"the screenshot is {len(png)} bytes, over the bus's limit: "
                                                   "ask for a region of the screen")
        return wire.Screenshot(x=x, y=y, width=w, height=h, screen_width=self.width,
                               screen_height=self.height), png

    async def pointer(self, x: int, y: int, button: str, action: str) -> None:
        with _monitor_errors():
            await self._monitor().pointer(x, y, button, action)

    async def keys(self, chords: list[str]) -> None:
        presses = [qcodes(wire.chord_keysyms(c)) for c in chords]  # all checked before any is sent
        for i, codes in enumerate(presses):
            if i:
                await asyncio.sleep(0.012)
            with _monitor_errors():
                await self._monitor().press(codes)

    async def type_text(self, text: str, delay_ms: int) -> None:
        presses = [typed(c) for c in text]
        for i, codes in enumerate(presses):
            if i and delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            with _monitor_errors():
                await self._monitor().press(codes)


class VMDriver(MicroVMDriver):
    """The microVM's driver over full machines (`vms` is a FullMachines): its start gives the
    machine its screen; everything after start is the microVM's."""

    LEVEL = "vm"

    vms: FullMachines

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        if rootfs is None:
            raise LaunchRefused("a vm has no host view: name its layers, e.g. layers=['base']")
        try:
            size = screen_size(spec.desktop.width, spec.desktop.height) if spec.desktop else DEFAULT_SCREEN
            machine.guest_memory_mb(spec.memory_mb)
        except ValueError as exc:
            raise LaunchRefused(str(exc).replace("microvm", "vm")) from None
        self.vms.screens[sandbox_id] = size
        try:
            return await super().start(sandbox_id, spec, confinement, rootfs)
        finally:
            self.vms.screens.pop(sandbox_id, None)

    def screen(self, instance: Instance, desktop: DesktopSpec) -> VMScreen:
        sandbox = _own(instance)
        return VMScreen(self, sandbox, *self.vms.screen_of(sandbox.vm))


async def detect_vm(state_dir: Path) -> tuple[VMDriver | None, str]:
    """The driver, if QEMU, SeaBIOS and a built vm guest are here, and the node's status line."""
    if not SEABIOS.is_file():
        return None, f"off: no {SEABIOS} (Debian's seabios)"
    host = await detect_vm_host(vm_guest.find)
    if isinstance(host, str):
        return None, host
    vms = FullMachines(host.guest, host.accelerator, host.qemu, state_dir / "vm", snapshots=host.snapshots)
    return VMDriver(vms), (f"on: {host.accelerator.describe()}, q35 + {FIRMWARE}, guest {host.guest.release}, "
                           f"{host.start}")

"""A full machine's screen and input through QEMU's own monitor (QMP): `screendump` for what the
card shows, `input-send-event` for the tablet and keyboard (full_machine.py). Nothing of it
goes through the guest, so a guest cannot fake its screen or refuse input; what X inside the
guest makes of the events is the guest's business.

The screen is dumped as PPM into a memfd the node passed to QEMU once (QMP `add-fd`, opened
write-only through /proc so its access mode is the one `screendump` opens with): no file on
disk, the pages charged to QEMU's cgroup as it writes them, and the node reads them back with
pread. The node rewinds and truncates the shared file description before each dump. QEMU is
the guest's first target, so its PPM is still parsed as hostile input: exact header, the size
the card was given, every byte counted.

Keys are QEMU's qcodes (US layout): `qcodes(chord)` for a chord as schemas/desktop.py spells
it, `typed(char)` for a character to type.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from linuxnode.vm.qmp import Qmp

ABS_MAX = 0x7FFF  # QEMU's absolute axis range, 0..ABS_MAX over the whole screen
BUTTONS = {"left": "left", "middle": "middle", "right": "right", "wheel_up": "wheel-up", "wheel_down": "wheel-down"}
DOUBLE_CLICK_GAP_S = 0.06
_PPM = re.compile(rb"P6\n(\d{1,5}) (\d{1,5})\n255\n")

MODIFIER_QCODES = {"ctrl": "ctrl", "alt": "alt", "shift": "shift", "super": "meta_l", "meta": "meta_l"}
# X keysyms (schemas.desktop.KEYS' values) → qcodes; letters and digits are their own qcode.
KEYSYM_QCODES = {
    "Return": "ret", "Tab": "tab", "Escape": "esc", "BackSpace": "backspace", "Delete": "delete",
    "Insert": "insert", "space": "spc", "Home": "home", "End": "end", "Page_Up": "pgup", "Page_Down": "pgdn",
    "Left": "left", "Right": "right", "Up": "up", "Down": "down", "Menu": "menu", "Print": "print",
    "Pause": "pause", "Caps_Lock": "caps_lock", **{f"F{n}": f"f{n}" for n in range(1, 13)},
    "minus": "minus", "equal": "equal", "comma": "comma", "period": "dot", "slash": "slash",
    "backslash": "backslash", "semicolon": "semicolon", "apostrophe": "apostrophe", "grave": "grave_accent",
    "bracketleft": "bracket_left", "bracketright": "bracket_right",
}
_UNSHIFTED = {" ": "spc", "\n": "ret", "\t": "tab", "-": "minus", "=": "equal", "[": "bracket_left",
              "]": "bracket_right", "\\": "backslash", ";": "semicolon", "'": "apostrophe", "`": "grave_accent",
              ",": "comma", ".": "dot", "/": "slash"}
_SHIFTED = {**{c: q for c, q in zip("!@#$%^&*()", "1234567890")},
            **{c: q for c, q in zip('_+{}|:"~<>?', ["minus", "equal", "bracket_left", "bracket_right", "backslash",
                                                      "semicolon", "apostrophe", "grave_accent", "comma", "dot",
                                                      "slash"])}}


def qcodes(chord: str) -> list[str]:
    """`ctrl+shift+t` (as schemas.desktop.chord_keysyms gives it) as the qcodes held down
    together, modifiers first; ValueError for a key this keyboard has not."""
    *mods, key = chord.split("+")
    codes = [MODIFIER_QCODES[m] for m in mods]
    if len(key) == 1 and key.isascii() and key.isalnum():
        if key.isupper():
            codes.append("shift")
        codes.append(key.lower())
    elif key in MODIFIER_QCODES:
        codes.append(MODIFIER_QCODES[key])
    elif key in KEYSYM_QCODES:
        codes.append(KEYSYM_QCODES[key])
    elif key == "plus":
        codes += ["shift", "equal"]
    else:
        raise ValueError(f"key {key!r} has no key on a vm's keyboard (F13 and up, for one)")
    return list(dict.fromkeys(codes))


def typed(char: str) -> list[str]:
    """The qcodes that type `char` on a US keyboard; ValueError for one it cannot type."""
    if char.isascii() and char.isalnum():
        return ["shift", char.lower()] if char.isupper() else [char]
    if char in _UNSHIFTED:
        return [_UNSHIFTED[char]]
    if char in _SHIFTED:
        return ["shift", _SHIFTED[char]]
    raise ValueError(f"{char!r} cannot be typed on a vm's US keyboard (ASCII only)")


def parse_ppm(data: bytes, width: int, height: int) -> bytes:
    """The RGB pixels of a `width` x `height` PPM as QEMU writes it; ValueError for anything else."""
    header = _PPM.match(data[:32])
    if header is None:
        raise ValueError("the screen dump is not a binary PPM of 8-bit channels")
    size = int(header.group(1)), int(header.group(2))
    if size != (width, height):
        raise ValueError(f"the screen dump is {size[0]}x{size[1]}, not the card's {width}x{height}")
    pixels = data[header.end():]
    if len(pixels) != width * height * 3:
        raise ValueError(f"the screen dump has {len(pixels)} bytes of pixels, not {width * height * 3}")
    return pixels


def _key(code: str, down: bool) -> dict:
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": code}}}


def _button(button: str, down: bool) -> dict:
    return {"type": "btn", "data": {"down": down, "button": button}}


class MonitorScreen:
    """One machine's screen and input over its QMP socket (one client: this one)."""

    def __init__(self, qmp: Qmp, width: int, height: int) -> None:
        self.qmp, self.width, self.height = qmp, width, height
        self._lock = asyncio.Lock()  # QMP answers in order, one command at a time
        self._dump: int = -1  # the memfd QEMU dumps into
        self._dump_w: int = -1  # our write-only description of it, shared with QEMU's copy
        self._fdset: int | None = None

    @classmethod
    async def open(cls, run_dir: Path, width: int, height: int) -> MonitorScreen:
        """Connect to the machine's monitor (through an O_PATH fd: deep run dirs pass the 108-byte
        limit of a socket's path) and hand it the memfd its dumps go to."""
        fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            qmp = await Qmp.connect(f"/proc/self/fd/{fd}/qmp.sock")
        finally:
            os.close(fd)
        screen = cls(qmp, width, height)
        try:
            screen._dump = os.memfd_create("sandfleet-screen", os.MFD_CLOEXEC)
            screen._dump_w = os.open(f"/proc/self/fd/{screen._dump}", os.O_WRONLY | os.O_CLOEXEC)
            added = await qmp.execute("add-fd", fd=screen._dump_w)
            screen._fdset = int(added["fdset-id"])
        except BaseException:
            screen.close()
            raise
        return screen

    async def screendump(self) -> bytes:
        """The screen's RGB pixels, row by row (width * height * 3 bytes)."""
        limit = 64 + self.width * self.height * 3
        async with self._lock:
            os.ftruncate(self._dump_w, 0)
            os.lseek(self._dump_w, 0, os.SEEK_SET)
            await self.qmp.execute("screendump", {"filename": f"/dev/fdset/{self._fdset}", "format": "ppm"})
            data = os.pread(self._dump, limit + 1, 0)
        return parse_ppm(data, self.width, self.height)

    async def pointer(self, x: int, y: int, button: str, action: str) -> None:
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise ValueError(f"({x}, {y}) is off the {self.width}x{self.height} screen")
        b = BUTTONS[button]
        move = [{"type": "abs", "data": {"axis": "x", "value": round(x * ABS_MAX / max(self.width - 1, 1))}},
                {"type": "abs", "data": {"axis": "y", "value": round(y * ABS_MAX / max(self.height - 1, 1))}}]
        # Each step its own report (QMP syncs once per command): a press and its release in one
        # report may be read as no click at all.
        steps: list[list[dict]] = [move]
        if action in ("click", "double"):
            steps += [[_button(b, True)], [_button(b, False)]] * (2 if action == "double" else 1)
        elif action in ("down", "up"):
            steps.append([_button(b, action == "down")])
        for i, events in enumerate(steps):
            if action == "double" and i == 3:
                await asyncio.sleep(DOUBLE_CLICK_GAP_S)
            await self._send(events)

    async def press(self, codes: list[str]) -> None:
        """Hold `codes` down in order, then let them go in reverse (a chord)."""
        for code in codes:
            await self._send([_key(code, True)])
        for code in reversed(codes):
            await self._send([_key(code, False)])

    async def _send(self, events: list[dict]) -> None:
        async with self._lock:
            await self.qmp.execute("input-send-event", {"events": events})

    def close(self) -> None:
        self.qmp.close()
        for fd in (self._dump_w, self._dump):
            if fd >= 0:
                os.close(fd)
        self._dump = self._dump_w = -1

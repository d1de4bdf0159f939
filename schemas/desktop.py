"""A sandbox's screen (`node.v1.<node>.screen.*`), answered by the node's launcher: computer use.

A sandbox created with `desktop=DesktopSpec(width, height)` (schemas/sandbox.py) has a virtual
screen: its node starts a display server and a window manager from the sandbox's own layers as
the sandbox's processes (nothing of the platform runs or listens inside it) and drives them from
outside. `screen.info` starts the display if it is not up yet and answers where it is (the
`DISPLAY` a program in the sandbox draws on) and its size; every other `screen.*` request starts
it the same way first.

`screen.shot` answers a PNG of the screen, or of a `region` of it, as a raw reply (sandfleet.bus
Raw: the `Screenshot` in the META header, the PNG as the body); `screen.mouse` moves the pointer
to (x, y) and acts there with a button; `screen.keys` presses key chords (`ctrl+l`, `Return`,
`shift+Tab`) one after the other; `screen.type` types text as a keyboard would.

What is refused, before anything happens: a sandbox without a desktop (`unsupported`); a point
or region off its screen, a key name outside `KEYS` (or a chord of two keys, or no key), an empty
text (`invalid_request`); a paused sandbox (`conflict`). A sandbox whose layers have no display
server answers `unsupported` with what it lacks.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.sandbox import DesktopSpec, SandboxId

__all__ = ["DesktopSpec"]

SCREEN_INFO = "screen.info"
SCREENSHOT = "screen.shot"
MOUSE = "screen.mouse"
KEYS_PRESS = "screen.keys"
TYPE_TEXT = "screen.type"

DISPLAY = ":0"  # what a sandbox's program is given as DISPLAY to draw on its screen

Coordinate = Annotated[int, Meta(ge=0, le=4096)]  # checked against the screen's own size on the node
Button = Literal["left", "middle", "right", "wheel_up", "wheel_down"]
MouseAction = Literal["click", "double", "down", "up", "move"]
MAX_CHORDS = 64
MAX_TEXT = 16_384  # characters of one `screen.type`

# Modifier names as a chord spells them → xdotool's.
MODIFIERS = {"ctrl": "ctrl", "control": "ctrl", "alt": "alt", "shift": "shift", "super": "super",
             "win": "super", "cmd": "super", "meta": "meta"}
# Key names a chord may end with (case-insensitive) → the X keysym sent; plus one letter or digit.
KEYS: dict[str, str] = {
    "return": "Return", "enter": "Return", "tab": "Tab", "escape": "Escape", "esc": "Escape",
    "backspace": "BackSpace", "delete": "Delete", "del": "Delete", "insert": "Insert", "space": "space",
    "home": "Home", "end": "End", "page_up": "Page_Up", "pageup": "Page_Up", "page_down": "Page_Down",
    "pagedown": "Page_Down", "left": "Left", "right": "Right", "up": "Up", "down": "Down",
    "menu": "Menu", "print": "Print", "pause": "Pause", "caps_lock": "Caps_Lock",
    **{f"f{n}": f"F{n}" for n in range(1, 25)},
    "minus": "minus", "-": "minus", "equal": "equal", "=": "equal", "plus": "plus", "comma": "comma", ",": "comma",
    "period": "period", ".": "period", "slash": "slash", "/": "slash", "backslash": "backslash", "\\": "backslash",
    "semicolon": "semicolon", ";": "semicolon", "apostrophe": "apostrophe", "'": "apostrophe",
    "grave": "grave", "`": "grave", "bracketleft": "bracketleft", "[": "bracketleft",
    "bracketright": "bracketright", "]": "bracketright",
    **MODIFIERS,  # a modifier pressed on its own
}


def chord_keysyms(chord: str) -> str:
    """`ctrl+shift+t` as xdotool's `ctrl+shift+t`: modifiers first, then one key; ValueError for a
    name that is not a key here (so nothing is sent that the display would silently ignore)."""
    parts = chord.split("+")
    if chord == "+" or "" in parts:
        raise ValueError(f"key chord {chord!r} has an empty part: name `plus` for the + key")
    *mods, key = parts
    unknown = [m for m in mods if m.lower() not in MODIFIERS]
    if unknown:
        raise ValueError(f"key chord {chord!r}: {unknown[0]!r} is not a modifier ({', '.join(sorted(MODIFIERS))})")
    if len(key) == 1 and key.isascii() and key.isalnum():
        keysym = key.lower() if mods else key  # ctrl+L is ctrl+l, as shortcuts are written; not ctrl+shift+l
    elif key.lower() in KEYS:
        keysym = KEYS[key.lower()]
    else:
        raise ValueError(f"key chord {chord!r}: unknown key name {key!r} (a letter, a digit, or one of Return "
                         "Tab Escape BackSpace Delete Home End Page_Up Page_Down Left Right Up Down F1..F24 ...)")
    return "+".join([*(MODIFIERS[m.lower()] for m in mods), keysym])


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class ScreenInfoRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="screen.info"):
    sandbox_id: SandboxId


class ScreenInfo(_Struct, frozen=True, kw_only=True, tag="screen.info.reply"):
    display: str  # the DISPLAY its programs draw on
    width: int
    height: int


class Region(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    x: Coordinate = 0
    y: Coordinate = 0
    width: Annotated[int, Meta(ge=1, le=4096)]
    height: Annotated[int, Meta(ge=1, le=4096)]


class ScreenshotRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="screen.shot"):
    sandbox_id: SandboxId
    region: Region | None = None  # None: the whole screen
    # zlib's level for the PNG: 1 is fast (the default), 9 small; 0 stores the pixels as they are.
    compression: Annotated[int, Meta(ge=0, le=9)] = 1


class Screenshot(_Struct, frozen=True, kw_only=True, tag="screen.shot.reply"):
    """The META of a `screen.shot` reply; the body is the PNG (8-bit RGB, `width` x `height`)."""

    x: int
    y: int
    width: int
    height: int
    screen_width: int
    screen_height: int


class MouseRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="screen.mouse"):
    sandbox_id: SandboxId
    x: Coordinate
    y: Coordinate
    button: Button = "left"  # wheel_up / wheel_down: one notch of scrolling per click
    action: MouseAction = "click"  # move: the pointer only, no button


class KeysRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="screen.keys"):
    sandbox_id: SandboxId
    keys: Annotated[list[Annotated[str, Meta(min_length=1, max_length=64)]], Meta(min_length=1, max_length=MAX_CHORDS)]

    def __post_init__(self) -> None:
        for chord in self.keys:
            chord_keysyms(chord)


class TypeRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="screen.type"):
    sandbox_id: SandboxId
    text: Annotated[str, Meta(min_length=1, max_length=MAX_TEXT)]
    delay_ms: Annotated[int, Meta(ge=0, le=1000)] = 5  # between keystrokes, as a fast typist


class InputDone(_Struct, frozen=True, kw_only=True, tag="screen.input.reply"):
    """What a mouse, keys or type request answers once the display has taken every event."""

    duration_ms: float  # from the display being up to the last event taken

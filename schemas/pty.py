"""Terminals of a sandbox (`node.v1.<node>.pty.*`), answered by the node's launcher.

A terminal is a background process (schemas/process.py) whose stdin, stdout and stderr are one
pty whose master the node holds: `pty.spawn` starts it and answers its ProcessInfo, and from then
on it is a process like any other, by its `pid`: keystrokes go with `proc.write`, the screen's
bytes come with `proc.read` (all on stream 1: a terminal merges stdout and stderr, and the node's
bounded buffer keeps the newest), `proc.signal`, `proc.wait` and `proc.list` as for any process.
Only the window size is a terminal's own: `pty.resize`, which a process without a terminal
refuses (`conflict`). Sizes are 1..1000 columns and rows; anything else is refused before
anything happens (`invalid_request`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.node import AbsPath, Argv
from schemas.process import Pid
from schemas.sandbox import SandboxId

PTY_SPAWN = "pty.spawn"
PTY_RESIZE = "pty.resize"

MAX_SIZE = 1000
Size = Annotated[int, Meta(ge=1, le=MAX_SIZE)]


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class PtySpawnRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="pty.spawn"):
    sandbox_id: SandboxId
    argv: Argv | None = None  # required unless image_command
    image_command: bool = False  # as SpawnRequest's: the image's Entrypoint + (argv or its Cmd)
    env: Annotated[dict[str, str], Meta(max_length=1024)] = {}  # TERM is xterm-256color unless named
    cwd: AbsPath = "/workspace"
    cols: Size = 80
    rows: Size = 24
    # The node kills it (and its process group) after this long; None: it runs until it ends.
    timeout_s: Annotated[float, Meta(gt=0, le=7 * 24 * 3600)] | None = None
    # Screen output kept for readers; 0: the node's default. Capped by the node's maximum.
    buffer_bytes: Annotated[int, Meta(ge=0, le=1 << 30)] = 0


class ResizeRequest(_Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="pty.resize"):
    sandbox_id: SandboxId
    pid: Pid
    cols: Size
    rows: Size

"""Terminals of a sandbox, from the client: the `Terminal` handle.

A terminal is a background process on a pty whose master the node holds (schemas/pty.py), so
this handle is a `Process` (sandfleet/_processes.py) seen as a terminal: keystrokes are its
stdin, the screen's bytes its output (one stream), plus `resize`. Like a process it is only a
sandbox and a pid: any client may re-attach with `sb.terminal(pid)` and read the screen's bytes
from offset 0, as far as the node's buffer still holds them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from sandfleet import errors
from sandfleet._processes import Process, ended_or
from schemas import process as proc
from schemas import pty

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox


class Terminal:
    """A command on a terminal in a sandbox; cheap to make, holds nothing of its own."""

    def __init__(self, sb: Sandbox, pid: int, info: proc.ProcessInfo | None = None) -> None:
        self.process = Process(sb, pid, info)
        self.offset = 0  # of the next byte `output` yields, on the terminal's count from its start
        self.dropped = 0  # bytes the node's buffer had dropped before `output` could read them

    def __repr__(self) -> str:
        return f"Terminal(sandbox={self.sandbox.id!r}, pid={self.pid})"

    @property
    def sandbox(self) -> Sandbox:
        return self.process.sandbox

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit(self) -> proc.Exit | None:
        """How it ended, once a read or wait saw it end; None before."""
        return self.process.exit

    async def write(self, data: bytes | str) -> int:
        """Keystrokes, as a keyboard sends them (Enter is b"\\r", Ctrl-C b"\\x03"); a str is
        sent as UTF-8. Conflict once it has ended."""
        return await self.process.send_stdin(data.encode() if isinstance(data, str) else data)

    async def output(self, offset: int | None = None, *, follow: bool = True) -> AsyncIterator[bytes]:
        """The screen's bytes from `offset` (None: where this handle's last read stopped, 0 at
        first: all the node still holds) as they come, until it ends (or, with follow=False,
        until what is there now is read). What the node dropped first is counted in `dropped`."""
        async for out in self.process.output(self.offset if offset is None else offset, follow=follow):
            self.dropped += out.dropped
            self.offset = out.offset + len(out.data)
            if out.data:
                yield out.data

    async def resize(self, cols: int, rows: int) -> None:
        """The window size (1..1000 each; InvalidRequest else, and nothing changes); the program
        on it gets SIGWINCH. Conflict once it has ended."""
        req = pty.ResizeRequest(sandbox_id=self.sandbox.id, pid=self.pid, cols=cols, rows=rows)
        self.process.last = await self.process._request(pty.PTY_RESIZE, req, proc.ProcessInfo)

    async def signal(self, number: int = 15) -> None:
        """To its process group (Ctrl-C typed as b"\\x03" reaches the foreground job instead)."""
        await self.process.signal(number)

    async def kill(self) -> None:
        await self.process.kill()

    async def wait(self, timeout_s: float | None = None) -> proc.Exit:
        """Until it ends: its Exit. SandboxEnded if the sandbox ended under it, Timeout after `timeout_s`."""
        return await self.process.wait(timeout_s)


async def open_terminal(sb: Sandbox, argv: list[str] | None, *, cols: int, rows: int, env: dict[str, str] | None,
                        cwd: str, timeout_s: float | None, buffer_bytes: int, image_command: bool = False) -> Terminal:
    req = pty.PtySpawnRequest(sandbox_id=sb.id, argv=None if argv is None else list(argv), image_command=image_command,
                              env=env or {}, cwd=cwd, cols=cols, rows=rows, timeout_s=timeout_s,
                              buffer_bytes=buffer_bytes)
    try:
        info = await sb._fleet.bus.request(sb._subject(pty.PTY_SPAWN), req, proc.ProcessInfo, timeout=30)
    except errors.SandfleetError as exc:
        raise await ended_or(sb, exc) from None
    return Terminal(sb, info.pid, info)

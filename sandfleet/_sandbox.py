"""The `Sandbox` handle: everything done to one sandbox after it exists (exec, files, destroy,
pause/resume/hint, checkpoint), sent straight to the node that holds it (`node.v1.<node>.*`)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from sandfleet import _desktop, _files, _health, _processes, _pty, errors
from sandfleet._ports import Forward
from sandfleet._processes import OutputCallback, Process
from sandfleet._requests import _convert
from schemas import node
from schemas.sandbox import SandboxRecord

if TYPE_CHECKING:
    import os

    from schemas.desktop import InputDone, Screenshot, ScreenInfo

    from sandfleet.client import Fleet
    from schemas.files import Check, TransferDone


ExecResult = node.ExecReply  # what a command did: the node's reply as it came


class Sandbox:
    """A handle on one sandbox; cheap to make, holds no resources of its own."""

    def __init__(self, fleet: Fleet, sandbox_id: str, node_id: str) -> None:
        self._fleet = fleet
        self.id = sandbox_id
        self.node = node_id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, node={self.node!r})"

    def _subject(self, verb: str) -> str:
        return node.subject(self.node, verb)

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str = "/workspace",
        stdin: bytes = b"",
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        image_command: bool = False,
    ) -> ExecResult:
        """Run argv and return what it did. With `on_stdout`/`on_stderr`, each chunk is handed to
        its callback (sync or async) as the command writes it. `image_command=True` (a sandbox over
        an imported image) runs the image's Entrypoint followed by argv, or by its Cmd if argv is
        None, as `docker run IMAGE [ARGS]` does. Raises SandboxEnded if the sandbox ended under the
        command (its result would say nothing of the command)."""
        if on_stdout is not None or on_stderr is not None:
            return await _processes.streamed_exec(self, argv, timeout_s=timeout_s, env=env, cwd=cwd, stdin=stdin,
                                                  on_stdout=on_stdout, on_stderr=on_stderr,
                                                  image_command=image_command)
        req = node.ExecRequest(sandbox_id=self.id, argv=argv, image_command=image_command, env=env or {}, cwd=cwd,
                               stdin=stdin, timeout_s=timeout_s)
        try:
            r = await self._fleet.bus.request(self._subject(node.EXEC), req, node.ExecReply, timeout=timeout_s + 10)
        except errors.SandfleetError as exc:
            raise await _processes.ended_or(self, exc) from None
        if r.sandbox_ended:  # the node saw the signal that ended it come from the sandbox's end
            await _processes.raise_ended(self, "the command")
        return r

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        req = node.WriteFileRequest(sandbox_id=self.id, path=path, data=data, mode=mode)
        return (await self._fleet.bus.request(self._subject(node.WRITE_FILE), req, node.WriteFileReply, timeout=30)).size

    async def read_file(self, path: str) -> bytes:
        req = node.ReadFileRequest(sandbox_id=self.id, path=path)
        return (await self._fleet.bus.request(self._subject(node.READ_FILE), req, node.ReadFileReply, timeout=30)).data

    async def destroy(self) -> SandboxRecord:
        req = node.DestroyRequest(sandbox_id=self.id)
        return (await self._fleet.bus.request(self._subject(node.DESTROY), req, node.DestroyReply, timeout=60)).record

    async def info(self) -> SandboxRecord:
        return await self._fleet.get(self.id)

    async def pause(self) -> SandboxRecord:
        """Freeze every process (cgroup.freeze); the sandbox is `paused` until `resume()`."""
        req = node.PauseRequest(sandbox_id=self.id)
        return (await self._fleet.bus.request(self._subject(node.PAUSE), req, node.PauseReply, timeout=30)).record

    async def resume(self) -> SandboxRecord:
        """Thaw a paused sandbox; a quarantined one raises `Conflict`."""
        req = node.ResumeRequest(sandbox_id=self.id)
        return (await self._fleet.bus.request(self._subject(node.RESUME), req, node.ResumeReply, timeout=30)).record

    async def hint(self, hint: str) -> node.HintReply:
        """`idle` lowers the sandbox's CPU weight to the minimum, `active` restores the default."""
        req = _convert(dict(sandbox_id=self.id, hint=hint), node.HintRequest)
        return await self._fleet.bus.request(self._subject(node.HINT), req, node.HintReply, timeout=30)

    async def checkpoint(self, name: str | None = None, *, keep_paused: bool = False, memory: bool = False,
                         timeout_s: float = 600.0) -> node.Checkpoint:
        """Pack the sandbox's files (its writable layer, /workspace included) into layer `name`
        over its layers; pass the result to `Fleet.restore`. Processes are not captured, unless
        `memory`: a VM's (microvm, vm) whole running machine is saved, and the restored VM's
        processes go on where they were, on any node with the same QEMU, CPU model and
        accelerator (`handle.machine` says which); other levels raise `Unsupported`."""
        name = name or f"ckpt-{self.id[:40]}-{secrets.token_hex(4)}"
        req = _convert(dict(sandbox_id=self.id, name=name, keep_paused=keep_paused, memory=memory),
                       node.CheckpointRequest)
        return await self._fleet.bus.request(self._subject(node.CHECKPOINT), req, node.Checkpoint,
                                             timeout=timeout_s + 10)

    # -- lifetime and health (sandfleet/_health.py) --------------------------------------------

    async def set_timeout(self, seconds: float) -> SandboxRecord:
        """End the sandbox (reason `expired`) `seconds` from now, later or sooner than it would
        have; returns its record with the new `deadline`. `InvalidRequest` for 0, a negative
        value or one past the node's maximum, `Conflict` if it is already ending."""
        return await _health.set_timeout(self._fleet, self.node, self.id, seconds)

    async def metrics(self) -> _health.SandboxMetrics:
        """What it uses now, read by its node from outside it: CPU time, memory (current, peak),
        disk of its writable layer, processes, and network bytes of its netns's interfaces."""
        return await _health.metrics(self._fleet, self.node, self.id)

    # -- background processes and shells (issue 12: processes) ---------------------------

    async def spawn(self, argv: list[str] | None = None, *, env: dict[str, str] | None = None,
                    cwd: str = "/workspace", stdin: bool = False, timeout_s: float | None = None,
                    buffer_bytes: int = 0, image_command: bool = False) -> Process:
        """Start argv in the background; it runs until it ends, is killed, or the sandbox ends,
        whatever the client does. `stdin=True` keeps its stdin open for `send_stdin`; the node
        keeps its newest `buffer_bytes` of output (0: the node's default) for any reader.
        `image_command` as for `exec`: an image's server started as its image says."""
        return await _processes.spawn(self, argv, env=env, cwd=cwd, stdin=stdin, timeout_s=timeout_s,
                                      buffer_bytes=buffer_bytes, image_command=image_command)

    def process(self, pid: int) -> Process:
        """A handle on background process `pid` (from this client or any other)."""
        return Process(self, pid)

    async def processes(self):
        """Every background process the node keeps for this sandbox: running, and recently ended."""
        return await _processes.processes(self)

    async def shell(self, shell: str = "sh", *, env: dict[str, str] | None = None, cwd: str = "/workspace"):
        """A shell session whose state (cwd, environment, variables, background jobs) lasts
        between its runs (see sandfleet/_shell.py)."""
        from sandfleet._shell import Shell

        return await Shell.open(self, shell, env=env, cwd=cwd)
    # -- ports: forwarding local TCP connections to the sandbox's own ports ----------------

    def forward(self, port: int, *, local_port: int = 0, host: str = "127.0.0.1") -> Forward:
        """`async with sb.forward(8000) as (host, port):` a listener on the client's loopback
        (`local_port`, 0 for any free one) whose every connection reaches `port` inside the
        sandbox: its loopback (`host` "127.0.0.1", "::1") or its own egress address ("own").
        Entering it raises `PortRefused` (a `Conflict`) when nobody listens on that port."""
        return Forward(self, port, local_port=local_port, host=host)
    # -- files of any size, and the file tree (sandfleet/_files.py) ------------------------

    async def upload(self, src: str | os.PathLike | bytes, path: str, *, mode: int | None = None,
                     progress: _files.Progress | None = None, check: Check = "xxh3-128") -> TransferDone:
        """Copy a local file or directory (or bytes) to `path` in the sandbox, of any size: chunked,
        pipelined, checked end to end (`check`: xxh3-128, or "sha256" for a digest to compare with
        others; the result's `digest`); nothing is visible at `path` until it is all there. A
        directory keeps its modes and symlinks and replaces what was at `path`."""
        return await _files.upload(self, src, path, mode=mode, progress=progress, check=check)

    @property
    def files(self) -> _files.Files:
        """The sandbox's file tree: `list`, `stat`, `mkdir`, `remove`, `rename`."""
        return _files.Files(self)

    async def download(self, path: str, dst: str | os.PathLike, *,
                       progress: _files.Progress | None = None, check: Check = "xxh3-128") -> TransferDone:
        """Copy a file or directory of the sandbox to the local `dst` (replaced), checked the same way."""
        return await _files.download(self, path, dst, progress=progress, check=check)

    # -- terminals: a command on a pty the node holds (sandfleet/_pty.py) --------------------

    async def pty(self, argv: list[str] | None = None, *, cols: int = 80, rows: int = 24,
                  env: dict[str, str] | None = None, cwd: str = "/workspace", timeout_s: float | None = None,
                  buffer_bytes: int = 0, image_command: bool = False) -> _pty.Terminal:
        """Start argv (default `sh`) on a new terminal of `cols` x `rows` (1..1000): it leads a
        session with the terminal as its controlling tty, so job control, Ctrl-C (b"\x03") and
        resizes work as on a login; TERM is xterm-256color unless `env` names one. It runs until
        it ends or is killed, whatever the client does; any client re-attaches with `terminal(pid)`."""
        if argv is None and not image_command:
            argv = ["sh"]
        return await _pty.open_terminal(self, argv, cols=cols, rows=rows, env=env, cwd=cwd, timeout_s=timeout_s,
                                        buffer_bytes=buffer_bytes, image_command=image_command)

    def terminal(self, pid: int) -> _pty.Terminal:
        """A handle on terminal `pid` (from this client or any other); `process(pid)` works too."""
        return _pty.Terminal(self, pid)

    # -- computer use: the sandbox's screen (sandfleet/_desktop.py) --------------------------

    async def screen_info(self) -> ScreenInfo:
        """Its screen's DISPLAY (for the programs it runs) and size, the display started if it was
        not yet. `Unsupported` for a sandbox created without `desktop=DesktopSpec(...)`."""
        return await _desktop.screen_info(self)

    async def screenshot(self, region: tuple[int, int, int, int] | None = None, *, compression: int = 1) -> bytes:
        """The screen now, as PNG bytes (8-bit RGB); `region` (x, y, width, height) for a part of it
        (`InvalidRequest` if it is not on the screen). `compression` is zlib's level, 0..9."""
        return (await _desktop.screenshot(self, region, compression))[1]

    async def screenshot_with_info(self, region: tuple[int, int, int, int] | None = None, *,
                                   compression: int = 1) -> tuple[Screenshot, bytes]:
        """`screenshot`, with where on the screen the image lies and the screen's size."""
        return await _desktop.screenshot(self, region, compression)

    async def mouse(self, x: int, y: int, button: str = "left", action: str = "click") -> InputDone:
        """Move the pointer to (x, y) and act there: `click`, `double`, `down`, `up` with `button`
        (left, middle, right, wheel_up, wheel_down), or only `move`. `InvalidRequest` off the screen."""
        return await _desktop.mouse(self, x, y, button, action)

    async def keys(self, *chords: str) -> InputDone:
        """Press key chords one after another: `keys("ctrl+l")`, `keys("ctrl+a", "Delete", "Return")`.
        A chord is modifiers (ctrl, alt, shift, super, meta) and one key: a letter, a digit or a name
        of schemas.desktop.KEYS, case-insensitive; anything else is `InvalidRequest`."""
        return await _desktop.keys(self, chords)

    async def type(self, text: str, *, delay_ms: int = 5) -> InputDone:
        """Type `text` (any Unicode) as a keyboard would, `delay_ms` between keystrokes."""
        return await _desktop.type_text(self, text, delay_ms)

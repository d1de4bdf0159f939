"""The launcher's side of a background command: spawned like an exec (the same helper enters
the sandbox and spawns it in a new session), but nobody waits for it in a request. Its
stdout and stderr are read on the event loop and handed, chunk by chunk, to `on_output`;
stdin stays open for `write`; signals go through the helper's control pipe (protocol.py
SpawnCommand) to the command's process group; `on_exit` gets the wait status once.

Output is read in large pieces (the pipes are grown to PIPE_BYTES) but only a few per turn of
the loop, so a command writing as fast as it can never starves the loop. When `on_output`
returns a future (its reader is behind), reading pauses until it is done: the pipe fills and
the command waits, which is how a reader holds a fast command back.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal as signals
from collections.abc import Callable
from typing import TYPE_CHECKING

from linuxnode.process import spawner
from linuxnode.process.execio import OUTPUT_GRACE_S, check_command, send_command
from linuxnode.process.model import DEFAULT_ENV, ExecError, InitProcess
from linuxnode.process.protocol import Signal, SpawnCommand
from linuxnode.process.reports import Report

if TYPE_CHECKING:
    import asyncio

READ_CHUNK = 65536  # of stdin written at a time
PIPE_BYTES = 1 << 20  # the output pipes' size (the default pipe-max-size), and a read's
READS_PER_TURN = 4


class StdinClosed(Exception):
    """The command's stdin is closed (by the caller, or the command ended)."""


def sandbox_pid(host_pid: int) -> int | None:
    """The pid the sandbox sees for a host pid (the last NSpid), None if it is gone."""
    try:
        with open(f"/proc/{host_pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


class BackgroundCommand:
    """One running background command and its pipes. `on_output(stream, data)` with stream 1
    or 2; `on_exit(wait_status)` once, when its output is all read (or after a short grace)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fds: dict[str, int],
                 on_output: Callable[[int, bytes], object], on_exit: Callable[[int], None],
                 read_bytes: int = PIPE_BYTES) -> None:
        self.loop, self.on_output, self.on_exit = loop, on_output, on_exit
        # At most this much is handed to on_output at once: a reader's buffer that asks reading
        # to wait once it is half full stays within its size if no read is larger than the half.
        self.read_bytes = max(4096, min(read_bytes, PIPE_BYTES))
        self.report_r, self.control_w, self.in_w = fds["report"], fds["control"], fds["stdin"]
        self.report = bytearray()
        self.host_pid: int | None = None
        self.os_pid: int | None = None
        self.status: int | None = None
        self.started = loop.create_future()  # the command runs (or could not): its first report
        self.drained = loop.create_future()  # every output pipe closed after the exit
        self.outputs = {fds["stdout"]: 1, **({fds["stderr"]: 2} if "stderr" in fds else {})}  # a terminal has one
        self._writing: asyncio.Future | None = None
        self._paused: asyncio.Future | None = None  # what on_output asked reading to wait for
        for fd in self.outputs:
            with contextlib.suppress(OSError):  # a smaller pipe only means smaller reads
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        for fd in (self.report_r, *self.outputs):
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)
        os.set_blocking(self.in_w, False)

    @property
    def stdin_open(self) -> bool:
        return self.in_w >= 0

    def _readable(self, fd: int, reads: int = READS_PER_TURN, hold_back: bool = True) -> None:
        for _ in range(reads):
            try:
                chunk = os.read(fd, self.read_bytes)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._close_reader(fd)
                if fd == self.report_r:
                    self._settle(Report.parse(bytes(self.report)))
                return
            if fd == self.report_r:
                self.report += chunk
                self._settle(Report.parse(bytes(self.report)))
                continue
            wait = self.on_output(self.outputs[fd], chunk)
            if hold_back and hasattr(wait, "add_done_callback") and not wait.done():  # a future: asyncio is not imported here
                self._pause(wait)
                return

    def _pause(self, until) -> None:
        if self._paused is None:
            self._paused = until
            for fd in self.outputs:
                self.loop.remove_reader(fd)
            until.add_done_callback(self._resume)

    def _resume(self, _: object = None) -> None:
        self._paused = None
        for fd in self.outputs:
            self.loop.add_reader(fd, self._readable, fd)

    def _settle(self, report: Report) -> None:
        if report.command is not None and self.host_pid is None:
            self.host_pid = report.command
            self.os_pid = sandbox_pid(report.command)
        if not self.started.done() and (report.command is not None or report.status is not None or report.errors
                                        or self.report_r < 0):
            self.started.set_result(report)
        if self.status is None and (report.status is not None or report.errors or self.report_r < 0):
            # No status but an error (or a closed report pipe): the helper died; nothing runs.
            self.status = report.status if report.status is not None else signals.SIGKILL
            self._close_reader(self.report_r)
            self._close_stdin()
            self._close_control()
            if self.outputs:  # output still open belongs to its background children: a short grace
                self.loop.call_later(OUTPUT_GRACE_S, self._grace_over)
            else:
                self._exited()

    def _grace_over(self) -> None:
        """The command ended a grace ago: what is still in its pipes is taken (a reader paused
        for does not hold it back any longer), then they are closed."""
        for fd in list(self.outputs):
            self._readable(fd, reads=PIPE_BYTES // 4096, hold_back=False)
        self.close()

    def _exited(self) -> None:
        if not self.drained.done():
            self.drained.set_result(None)
            self.on_exit(self.status)

    def _close_reader(self, fd: int) -> None:
        if fd < 0:
            return
        if fd == self.report_r:
            self.report_r = -1
        elif fd in self.outputs:
            del self.outputs[fd]
        else:
            return
        self.loop.remove_reader(fd)  # a paused reader's is gone already: no matter
        os.close(fd)
        if not self.outputs and self.status is not None:
            self._exited()

    async def write(self, data: bytes) -> int:
        """Write all of data to stdin, waiting while the pipe is full; StdinClosed if it is."""

        view = memoryview(data)
        while view:
            if self.in_w < 0:
                raise StdinClosed("stdin is closed")
            try:
                view = view[os.write(self.in_w, view[:READ_CHUNK]):]
            except BlockingIOError:
                ready = self.loop.create_future()
                self._writing = ready
                self.loop.add_writer(self.in_w, lambda: ready.done() or ready.set_result(None))
                try:
                    await ready
                finally:
                    self._writing = None
                    if self.in_w >= 0:
                        self.loop.remove_writer(self.in_w)
            except (BrokenPipeError, OSError):
                self._close_stdin()
                raise StdinClosed("the command closed its stdin") from None
        return len(data)

    def close_stdin(self) -> None:
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.in_w >= 0:
            self.loop.remove_writer(self.in_w)
            os.close(self.in_w)
            self.in_w = -1
            if self._writing is not None and not self._writing.done():
                self._writing.set_result(None)  # the waiting write sees the pipe closed

    def _close_control(self) -> None:
        if self.control_w >= 0:
            os.close(self.control_w)
            self.control_w = -1

    def signal(self, number: int) -> bool:
        """Send signal `number` to the command's process group; False if it already ended."""
        if self.control_w < 0 or self.status is not None:
            return False
        with contextlib.suppress(BlockingIOError):  # 64 KiB of signals queued: the command is not listening
            os.write(self.control_w, bytes([number]))
        return True

    def close(self) -> None:
        """Stop reading; a command still running is killed (its helper gets SIGTERM)."""
        if self.status is None:
            pid = Report.parse(bytes(self.report)).pid
            if pid is not None:
                with contextlib.suppress(OSError):
                    spawner.send(Signal(pid=pid, signal=int(signals.SIGTERM)))
        for fd in list(self.outputs):
            self._close_reader(fd)
        self._close_stdin()
        if self.status is not None:  # else the report tells of the exit still
            self._close_control()


async def spawn(init: InitProcess, argv: list[str], *, cgroup_procs: list[str], env: dict[str, str] | None,
                cwd: str, on_output: Callable[[int, bytes], object],
                on_exit: Callable[[int], None], read_bytes: int = PIPE_BYTES, apparmor: str = "",
                uid: int = -1, gid: int = -1, build: bool = False) -> BackgroundCommand:
    """Start argv in the sandbox in the background; returns once it runs (or exited at once: a
    command not found exits 127). A missing cwd raises FileNotFoundError."""
    import asyncio

    full_env = {**DEFAULT_ENV, **(env or {})}
    check_command(argv, full_env, cwd)
    loop = asyncio.get_running_loop()
    (report_r, _), (_, in_w), (out_r, _), (err_r, _), (_, control_w) = send_command(
        init, 5, lambda pidfd, root, p: SpawnCommand(
            cgroup_procs=tuple(cgroup_procs), cwd=cwd, argv=tuple(argv), env=full_env, apparmor=apparmor, uid=uid,
            gid=gid, build=build, report=p[0][1], pidfd=pidfd, root=root, stdin=p[1][0], stdout=p[2][1], stderr=p[3][1],
            control=p[4][0]))
    os.set_blocking(control_w, False)
    command = BackgroundCommand(loop, {"report": report_r, "control": control_w, "stdin": in_w, "stdout": out_r,
                                       "stderr": err_r}, on_output, on_exit, read_bytes)
    return await running(command)


async def running(command: BackgroundCommand) -> BackgroundCommand:
    """`command` once it runs (or exited at once); why it could not start, raised, else."""
    try:
        report = await command.started
    except BaseException:
        command.close()
        raise
    if report.command is None and report.status is None:
        command.close()
        err, message = report.errors[0] if report.errors else (0, "the spawner ended before the command")
        if message.startswith("chdir ") and err:
            raise OSError(err, message)
        raise ExecError(message)
    return command

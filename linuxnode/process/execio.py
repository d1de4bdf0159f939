"""The launcher's side of exec: check the request, hand the spawner the init's pidfd and root
and the command's pipes, then drive those pipes on the event loop until the command's status
arrives, killing it on timeout or cancel. asyncio is imported only when exec runs, because
the spawner imports this package."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

from linuxnode.pipes import LoopPipes
from linuxnode.process import spawner
from linuxnode.process.lifecycle import open_init
from linuxnode.process.model import DEFAULT_ENV, ExecError, ExecResult, InitProcess
from linuxnode.process.protocol import ExecCommand, Signal
from linuxnode.process.reports import Report

OUTPUT_GRACE_S = 0.1  # after the command exits, how long a background process may hold its pipes


Pipe = tuple[int, int]  # (read end, write end)


def send_command(init: InitProcess, pipes: int, request: Callable[[int, int, list[Pipe]], object]) -> list[Pipe]:
    """Open the init's pidfd and root and `pipes` pipes, send the spawner the request
    `request(pidfd, root, pipes)` builds, and close the fds it now holds (the request's `FDS`);
    returns the pipes, whose other ends are ours. Nothing is left open when it fails."""
    pidfd, root = open_init(init)
    fds, made = [pidfd, root], []
    try:
        for _ in range(pipes):
            pair = os.pipe2(os.O_CLOEXEC)
            fds += pair
            made.append(pair)
        message = request(pidfd, root, made)
        spawner.send(message)
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, OSError):
            raise ExecError(f"cannot reach the spawner: {exc}") from exc
        raise
    for name in message.FDS:  # type: ignore[attr-defined]
        os.close(getattr(message, name))
    return made


async def exec(
    init: InitProcess,
    argv: list[str],
    *,
    cgroup_procs: list[str],
    apparmor: str = "",
    uid: int = -1,
    gid: int = -1,
    build: bool = False,
    env: dict[str, str] | None = None,
    cwd: str = "/workspace",
    stdin: bytes = b"",
    timeout_s: float = 60.0,
    max_output: int = 1 << 20,
) -> ExecResult:
    """Run argv in the sandbox in a new session. A missing cwd raises FileNotFoundError (or
    NotADirectoryError); a command that cannot be found exits 127, one that cannot run 126."""
    import asyncio

    full_env = {**DEFAULT_ENV, **(env or {})}
    check_command(argv, full_env, cwd)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    (report_r, _), (_, in_w), (out_r, _), (err_r, _) = send_command(init, 4, lambda pidfd, root, p: ExecCommand(
        cgroup_procs=tuple(cgroup_procs), cwd=cwd, argv=tuple(argv), env=full_env, apparmor=apparmor, uid=uid, gid=gid,
        build=build, report=p[0][1], pidfd=pidfd, root=root, stdin=p[1][0], stdout=p[2][1], stderr=p[3][1]))
    run = _Run(loop, report_r, out_r, err_r, in_w, stdin, max_output)
    try:
        return await run.result(deadline)
    finally:
        run.close()


def check_command(argv: list[str], env: dict[str, str], cwd: str) -> None:
    """ValueError unless argv, env and cwd can be handed to execve."""
    if not argv or not argv[0]:
        raise ValueError("argv is empty")
    if any("\0" in t for t in (*argv, *env, *env.values(), cwd)):
        raise ValueError("argv, env and cwd must not contain NUL bytes")
    if any(not k or "=" in k for k in env):
        raise ValueError("environment variable names must be non-empty and contain no '='")


class _Run(LoopPipes):
    """The launcher's side of one exec: its pipes, driven by the event loop."""

    def __init__(self, loop, report_r: int, out_r: int, err_r: int, in_w: int, stdin: bytes,
                 max_output: int) -> None:
        self.report_r = report_r
        self.report, self.out, self.err = bytearray(), bytearray(), bytearray()
        self.killed = self.kill_pending = False
        super().__init__(loop, {report_r: self.report, out_r: self.out, err_r: self.err}, in_w, stdin,
                         max_output, uncapped=frozenset({report_r}))

    def on_chunk(self, fd: int) -> bool:
        if fd != self.report_r:
            return False
        report = Report.parse(bytes(self.report))
        if self.kill_pending and report.pid is not None:
            self.kill()
        return report.status is not None or bool(report.errors)  # settled: no need to wait for the helper's teardown

    def kill(self) -> None:
        """Ask the spawner to kill the command's process group (it knows whether it is reaped);
        if the helper's pid has not arrived yet, as soon as it does."""
        pid = Report.parse(bytes(self.report)).pid
        self.kill_pending = pid is None
        if pid is not None and not self.killed:
            self.killed = True
            with contextlib.suppress(OSError):
                spawner.send(Signal(pid=pid, signal=int(signal.SIGTERM)))

    async def result(self, deadline: float) -> ExecResult:
        import asyncio

        done = self.eof[self.report_r]  # a status or an error arrived, or every writer closed the pipe
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(done), max(0.0, deadline - self.loop.time()))
        except TimeoutError:
            timed_out = True
            self.kill()
            await done
        report = Report.parse(bytes(self.report))
        if timed_out and report.status is None:
            report.status = signal.SIGKILL  # killed before the command started
        elif report.status is None:
            err, message = report.errors[0] if report.errors else (0, "the spawner ended before the command")
            if message.startswith("chdir ") and err:
                raise OSError(err, message)
            raise ExecError(message)
        # Output still open belongs to background processes of the command: a short grace.
        pending = [f for f in self.eof.values() if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=OUTPUT_GRACE_S)
        code = os.waitstatus_to_exitcode(report.status)
        return ExecResult(exit_code=128 - code if code < 0 else code, stdout=bytes(self.out),
                          stderr=bytes(self.err), timed_out=timed_out, truncated=self.truncated)

    def close(self) -> None:
        if not self.eof[self.report_r].done():
            self.kill()  # cancelled while running: the command must not outlive its exec
        for fd in list(self.eof):
            if not (fd == self.report_r and self.kill_pending):  # else read on until the pid comes
                self.close_reader(fd)
        self._close_stdin()

"""SWE-ReX on sandfleet: a deployment and a runtime that implement SWE-ReX's own interfaces
(`AbstractDeployment`, `AbstractRuntime`) with its own request, response and exception types,
on a sandbox's shell sessions, exec, files and uploads.

    deployment = SandfleetDeployment(url="nats://127.0.0.1:4222", isolation="container", layers=["py"])
    await deployment.start()
    runtime = deployment.runtime  # what SWE-agent drives

SWE-ReX's other deployments start a server (`swerex-remote`) inside the container and talk HTTP
to it. Here nothing runs inside the sandbox but the shell itself: every call goes over the bus
to the node, which enters the sandbox from outside (DESIGN.md, trust model).

A bash session is one SDK shell session (sandfleet/_shell.py): `bash` where the sandbox has it,
`sh` otherwise. Each run is checked first with the shell's `-n` (as SWE-ReX does with `bash -n`,
so a command with a syntax error runs nothing and raises BashIncorrectSyntaxError), then
evaluated in the session's shell with stderr joined to stdout (SWE-ReX reads one terminal).
What differs from SWE-ReX's pexpect sessions, and why:
- A run past its timeout is interrupted at once (SIGINT to its job) before CommandTimeoutError
  is raised, so the session is usable right after; a BashInterruptAction then finds nothing to stop.
- The shell is not interactive: commands read /dev/null, and there is no prompt. Actions for
  interactive programs (`is_interactive_command`, `is_interactive_quit`) and `expect` strings
  (which stop a run before its command ends) raise UnsupportedActionError.
"""

from __future__ import annotations

import asyncio
import io
import logging
import posixpath
import tempfile
import time
from pathlib import Path
from typing import Any

from sandfleet import errors
from sandfleet.extras import MissingExtra

try:
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import (
        BashIncorrectSyntaxError,
        CommandTimeoutError,
        DeploymentNotStartedError,
        NonZeroExitCodeError,
        SessionDoesNotExistError,
        SessionExistsError,
        SwerexException,
    )
    from swerex.runtime.abstract import (
        AbstractRuntime,
        BashAction,
        BashInterruptAction,
        BashObservation,
        CloseBashSessionResponse,
        CloseResponse,
        Command,
        CommandResponse,
        CreateBashSessionRequest,
        CreateBashSessionResponse,
        IsAliveResponse,
        ReadFileRequest,
        ReadFileResponse,
        UploadRequest,
        UploadResponse,
        WriteFileRequest,
        WriteFileResponse,
    )
except ImportError as exc:  # pragma: no cover - only without the extra
    raise MissingExtra("swerex", "sandfleet.integrations.swerex", ["swe-rex"]) from exc

from sandfleet._sandbox import Sandbox
from sandfleet._shell import Shell, quote
from schemas import node
from schemas.sandbox import State

__all__ = ["SandfleetDeployment", "SandfleetRuntime", "UnsupportedActionError"]

MAX_EXEC_S = 24 * 3600.0  # what the node accepts for one exec: SWE-ReX's "no timeout"


class UnsupportedActionError(SwerexException, NotImplementedError):
    """An action this runtime cannot carry out as SWE-ReX would (see the module's docstring)."""


def _text(data: bytes) -> str:
    return data.decode(errors="backslashreplace")


def _checked_run(command: str, shell: str) -> str:
    """The session script for one BashAction: `<shell> -n` first; if the syntax is good the
    command is evaluated in the session (so cd, exports and functions persist) with stderr
    joined to stdout, else the checker's complaint goes to stderr and nothing runs. So stderr is
    non-empty (and stdout empty) only for a syntax error."""
    q = quote(command)
    return (f"if __sandfleet_syntax=$(printf '%s\\n' {q} | {shell} -n 2>&1); then unset __sandfleet_syntax; "
            f"{{ eval {q}\n}} 2>&1; "
            f"else printf '%s\\n' \"$__sandfleet_syntax\" >&2; unset __sandfleet_syntax; false; fi")


class _BashSession:
    def __init__(self, name: str, shell: Shell, program: str) -> None:
        self.name, self.shell, self.program = name, shell, program

    async def run(self, action: BashAction) -> BashObservation:
        if action.is_interactive_command or action.is_interactive_quit or action.expect:
            raise UnsupportedActionError(
                f"session {self.name!r}: interactive programs and expect strings need a terminal; "
                "this runtime's sessions run each command to its end")
        started = time.monotonic()
        try:
            r = await self.shell.run(_checked_run(action.command, self.program), timeout_s=action.timeout)
        except errors.Conflict as exc:
            if not self.shell.closed:
                raise
            if action.timeout is not None and time.monotonic() - started >= action.timeout:
                raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                          f"{action.command!r} (it would not stop: {exc})") from None
            raise SessionDoesNotExistError(f"session {self.name!r} ended running {action.command!r}: {exc}") from None
        if r.timed_out:
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command {action.command!r}")
        output, complaint = _text(r.stdout), _text(r.stderr)
        if complaint and not output:
            raise BashIncorrectSyntaxError(
                f"Error (exit code 2) while checking bash command \n{action.command!r}\n"
                f"---- Stderr ----\n{complaint}\n---- Stdout ----\n",
                extra_info={"bash_stdout": "", "bash_stderr": complaint})
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None)
        if action.check == "raise" and r.exit_code != 0:
            msg = f"Command {action.command!r} failed with exit code {r.exit_code}. Here is the output:\n{output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=output, exit_code=r.exit_code)

    async def interrupt(self) -> BashObservation:
        # A run is only ever in flight inside run() (which interrupts it itself on its timeout);
        # another task's interrupt reaches its job as SWE-ReX's Ctrl-C would.
        if self.shell.lock.locked():
            await self.shell.process.signal(2)
        return BashObservation(output="", exit_code=0)


class SandfleetRuntime(AbstractRuntime):
    """SWE-ReX's runtime on one sandfleet sandbox (which it does not own: `close` ends its
    sessions, the deployment destroys the sandbox)."""

    def __init__(self, sandbox: Sandbox, *, cwd: str = "/workspace", logger: logging.Logger | None = None) -> None:
        self.sandbox = sandbox
        self.cwd = cwd
        self.logger = logger or logging.getLogger("sandfleet.swerex")
        self._sessions: dict[str, _BashSession] = {}
        self._shell_program: str | None = None

    async def _program(self) -> str:
        if self._shell_program is None:
            r = await self.sandbox.exec(["sh", "-c", "command -v bash"], cwd="/")
            self._shell_program = "bash" if r.exit_code == 0 else "sh"
        return self._shell_program

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            record = await asyncio.wait_for(self.sandbox.info(), timeout)
        except (errors.SandfleetError, TimeoutError) as exc:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id}: {exc or type(exc).__name__}")
        if record.state != State.RUNNING:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id} is {record.state.value}")
        return IsAliveResponse(is_alive=True)

    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        program = await self._program()
        shell = await self.sandbox.shell(program, cwd=self.cwd)
        session = _BashSession(request.session, shell, program)
        self._sessions[request.session] = session
        if program == "bash":  # as in SWE-ReX's interactive bash, aliases from sourced files work
            await shell.run("shopt -s expand_aliases")
        if not request.startup_source:
            return CreateBashSessionResponse()
        sources = " && ".join(f". {quote(path)}" for path in request.startup_source)
        r = await session.run(BashAction(command=sources, session=request.session, timeout=request.startup_timeout,
                                         check="silent"))
        return CreateBashSessionResponse(output=r.output)

    def _session(self, name: str) -> _BashSession:
        if name not in self._sessions:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return self._sessions[name]

    async def run_in_session(self, action: BashAction | BashInterruptAction) -> BashObservation:
        session = self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return await session.interrupt()
        try:
            return await session.run(action)
        except (SessionDoesNotExistError, CommandTimeoutError):
            if session.shell.closed:
                del self._sessions[action.session]
            raise

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        session = self._session(request.session)
        del self._sessions[request.session]
        await session.shell.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """Like SWE-ReX's `subprocess.run`: argv, or a string for `sh -c` with shell=True."""
        if isinstance(command.command, str):
            argv = ["sh", "-c", command.command] if command.shell else [command.command]
        else:
            argv = ["sh", "-c", *command.command] if command.shell else list(command.command)
        if command.merge_output_streams:
            argv = ["sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        timeout = MAX_EXEC_S if command.timeout is None else min(command.timeout, MAX_EXEC_S)
        r = await self.sandbox.exec(argv, timeout_s=timeout, env=command.env, cwd=command.cwd or self.cwd)
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        out = CommandResponse(stdout=_text(r.stdout), stderr=_text(r.stderr), exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{out.stdout!r}\nStderr:\n{out.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return out

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.cwd, path))

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """The file as `Path.read_text` would give it (universal newlines), of any size; missing
        is FileNotFoundError, a directory IsADirectoryError, as SWE-ReX's own runtime raises."""
        path = self._path(request.path)
        data = await self._read_bytes(path)
        text = io.TextIOWrapper(io.BytesIO(data), encoding=request.encoding or "utf-8", errors=request.errors)
        return ReadFileResponse(content=text.read())

    async def _read_bytes(self, path: str) -> bytes:
        try:
            return await self.sandbox.read_file(path)
        except errors.NotFound:
            raise FileNotFoundError(f"{path}: no such file or directory in sandbox {self.sandbox.id}") from None
        except errors.InvalidRequest:
            entry = await self.sandbox.files.stat(path)
            if entry.kind == "dir":
                raise IsADirectoryError(f"{path} is a directory in sandbox {self.sandbox.id}") from None
            if entry.size <= node.MAX_FILE_BYTES:
                raise
        with tempfile.TemporaryDirectory(prefix="sandfleet-swerex-") as local:  # larger than one message
            await self.sandbox.download(path, Path(local) / "file")
            return (Path(local) / "file").read_bytes()

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Any size; parent directories are made, as SWE-ReX's own runtime does."""
        path = self._path(request.path)
        await self.sandbox.files.mkdir(posixpath.dirname(path), parents=True)
        await self.sandbox.upload(request.content.encode(), path)
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory (modes and symlinks kept) to `target_path` in the sandbox."""
        source = Path(request.source_path)
        if not source.exists():
            raise ValueError(f"Source path {source} does not exist")
        target = self._path(request.target_path)
        await self.sandbox.files.mkdir(posixpath.dirname(target), parents=True)
        await self.sandbox.upload(source, target)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.shell.close()
        return CloseResponse()


class SandfleetDeployment(AbstractDeployment):
    """A sandbox made by `start()` and destroyed by `stop()`. `url` (or an open `fleet`) says
    which platform; every other keyword goes to `Fleet.create` (isolation, layers, memory_mb,
    cpu, timeout_s, allow, host_view, ...). `cwd` is where sessions and commands start."""

    def __init__(self, *, url: str | None = None, fleet: Any = None, cwd: str = "/workspace",
                 logger: logging.Logger | None = None, **create: Any) -> None:
        self.logger = logger or logging.getLogger("sandfleet.swerex")
        self._url, self._given_fleet, self._cwd, self._create = url, fleet, cwd, create
        self._fleet: Any = None
        self._runtime: SandfleetRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> Sandbox:
        return self.runtime.sandbox

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        import sandfleet

        self._fleet = self._given_fleet or await sandfleet.connect(self._url)
        self._hooks.on_custom_step("Creating a sandfleet sandbox")
        try:
            sb = await self._fleet.create(**self._create)
        except BaseException:
            await self._close_fleet()
            raise
        self.logger.info("sandbox %s on node %s", sb.id, sb.node)
        self._runtime = SandfleetRuntime(sb, cwd=self._cwd, logger=self.logger)

    async def stop(self) -> None:
        runtime, self._runtime = self._runtime, None
        try:
            if runtime is not None:
                try:
                    await runtime.close()
                finally:
                    try:
                        await runtime.sandbox.destroy()
                    except errors.NotFound:
                        pass  # it had ended (its timeout, an operator)
        finally:
            await self._close_fleet()

    async def _close_fleet(self) -> None:
        fleet, self._fleet = self._fleet, None
        if fleet is not None and fleet is not self._given_fleet:
            await fleet.close()

    @property
    def runtime(self) -> SandfleetRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

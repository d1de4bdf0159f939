"""SWE-ReX on sandfleet: a deployment and a runtime that implement SWE-ReX's own interfaces
(`AbstractDeployment`, `AbstractRuntime`) with its own request, response and exception types,
on a sandbox's shell sessions, exec, files and uploads.

    deployment = SandfleetDeployment(url="nats://127.0.0.1:4222", isolation="container", layers=["py"])
    await deployment.start()
    runtime = deployment.runtime  # what SWE-agent drives

SWE-ReX's other deployments start a server (`swerex-remote`) inside the container and talk HTTP
to it. Here nothing runs inside the sandbox but the shell itself: every call goes over the bus
to the node, which enters the sandbox from outside (DESIGN.md, trust model).
The deployment keeps its connection on an event loop of its own, so the runtime answers callers
on any loop: SWE-agent runs every call in a fresh `asyncio.run`.

A bash session is one SDK shell session (sandfleet/_shell.py): `bash` where the sandbox has it,
`sh` otherwise (a busybox layer); sandfleet/integrations/_swerex_session.py says how runs and
interactive programs work there. What differs from SWE-ReX's pexpect sessions, and why:
- A run past its timeout is interrupted at once (SIGINT to its job) before CommandTimeoutError
  is raised, so the session is usable right after; a BashInterruptAction then finds nothing to stop.
- There is no terminal: commands of a run read /dev/null, an interactive program reads a pipe,
  nothing is echoed, and no prompt exists (an interactive action whose program ended says
  expect_string ""). `expect` on an action that is not interactive raises UnsupportedActionError.
- `execute` of a program that does not exist gives exit code 127 (the node's exec), where
  `subprocess.run` raises FileNotFoundError; its `env` is added to the sandbox's environment
  rather than replacing it (so PATH stays).
"""

from __future__ import annotations

import asyncio
import io
import logging
import posixpath
import tempfile
from pathlib import Path
from typing import Any

from sandfleet import errors
from sandfleet.extras import MissingExtra

try:
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import (
        CommandTimeoutError,
        DeploymentNotStartedError,
        NonZeroExitCodeError,
        SessionDoesNotExistError,
        SessionExistsError,
    )
    from swerex.runtime.abstract import (
        AbstractRuntime,
        BashAction,
        BashInterruptAction,
        BashObservation,
        CloseBashSessionRequest,
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
from sandfleet._shell import quote
from sandfleet.integrations._home_loop import HomeLoop, at_home
from sandfleet.integrations._swerex_session import BashSession, UnsupportedActionError, text
from schemas import node
from schemas.sandbox import State

__all__ = ["SandfleetDeployment", "SandfleetRuntime", "UnsupportedActionError"]

MAX_EXEC_S = 24 * 3600.0  # what the node accepts for one exec: SWE-ReX's "no timeout"


class SandfleetRuntime(AbstractRuntime):
    """SWE-ReX's runtime on one sandfleet sandbox (which it does not own: `close` ends its
    sessions, the deployment destroys the sandbox)."""

    def __init__(self, sandbox: Sandbox, *, cwd: str = "/workspace", logger: logging.Logger | None = None,
                 home: HomeLoop | None = None) -> None:
        self.sandbox = sandbox
        self.home = home  # the loop the sandbox's connection lives on, if not the caller's
        self.cwd = cwd
        self.logger = logger or logging.getLogger("sandfleet.swerex")
        self._sessions: dict[str, BashSession] = {}
        self._shell_program: str | None = None

    async def _program(self) -> str:
        if self._shell_program is None:
            r = await self.sandbox.exec(["sh", "-c", "command -v bash"], cwd="/")
            self._shell_program = "bash" if r.exit_code == 0 else "sh"
        return self._shell_program

    @at_home
    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            record = await asyncio.wait_for(self.sandbox.info(), timeout)
        except (errors.SandfleetError, TimeoutError) as exc:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id}: {exc or type(exc).__name__}")
        if record.state != State.RUNNING:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id} is {record.state.value}")
        return IsAliveResponse(is_alive=True)

    @at_home
    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        program = await self._program()
        shell = await self.sandbox.shell(program, cwd=self.cwd)
        session = BashSession(request.session, shell, program)
        self._sessions[request.session] = session
        if program == "bash":  # as in SWE-ReX's interactive bash, aliases from sourced files work
            await shell.run("shopt -s expand_aliases")
        if not request.startup_source:
            return CreateBashSessionResponse()
        # Each sourced whatever the one before did, as SWE-ReX's `source a ; source b`; `command`
        # keeps a missing file from ending the list in a POSIX sh (where `.` is a special built-in)
        sources = "\n".join(f"command . {quote(path)}" for path in request.startup_source)
        r = await session.run(BashAction(command=sources, session=request.session, timeout=request.startup_timeout,
                                         check="silent"))
        return CreateBashSessionResponse(output=r.output)

    def _session(self, name: str) -> BashSession:
        if name not in self._sessions:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return self._sessions[name]

    @at_home
    async def run_in_session(self, action: BashAction | BashInterruptAction) -> BashObservation:
        session = self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return await session.interrupt(action)
        try:
            return await session.run(action)
        except (SessionDoesNotExistError, CommandTimeoutError):
            if session.shell.closed:
                del self._sessions[action.session]
            raise

    @at_home
    async def close_session(self, request: CloseBashSessionRequest) -> CloseBashSessionResponse:
        session = self._session(request.session)
        del self._sessions[request.session]
        await session.shell.close()
        return CloseBashSessionResponse()

    @at_home
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
        out = CommandResponse(stdout=text(r.stdout), stderr=text(r.stderr), exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{out.stdout!r}\nStderr:\n{out.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return out

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.cwd, path))

    @at_home
    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """The file as `Path.read_text` would give it (universal newlines), of any size; missing
        is FileNotFoundError, a directory IsADirectoryError, as SWE-ReX's own runtime raises."""
        path = self._path(request.path)
        data = await self._read_bytes(path)
        reader = io.TextIOWrapper(io.BytesIO(data), encoding=request.encoding or "utf-8", errors=request.errors)
        return ReadFileResponse(content=reader.read())

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

    @at_home
    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Any size; parent directories are made, as SWE-ReX's own runtime does."""
        path = self._path(request.path)
        await self.sandbox.files.mkdir(posixpath.dirname(path), parents=True)
        await self.sandbox.upload(request.content.encode(), path)
        return WriteFileResponse()

    @at_home
    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory (modes and symlinks kept) to `target_path` in the sandbox."""
        source = Path(request.source_path)
        if not source.exists():
            raise ValueError(f"Source path {source} does not exist")
        target = self._path(request.target_path)
        await self.sandbox.files.mkdir(posixpath.dirname(target), parents=True)
        await self.sandbox.upload(source, target)
        return UploadResponse()

    @at_home
    async def close(self) -> CloseResponse:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.shell.close()
        return CloseResponse()


class SandfleetDeployment(AbstractDeployment):
    """A sandbox made by `start()` and destroyed by `stop()`. `url` says which platform; every
    other keyword goes to `Fleet.create` (isolation, layers, memory_mb, cpu, timeout_s, allow,
    host_view, ...); `cwd` is where sessions and commands start. The deployment's connection
    lives on a loop of its own (sandfleet/integrations/_home_loop.py), so its runtime may be
    called from any loop, a fresh `asyncio.run` each time as SWE-agent does. With an open
    `fleet` instead of `url`, it uses that connection, and callers stay on its loop."""

    def __init__(self, *, url: str | None = None, fleet: Any = None, cwd: str = "/workspace",
                 logger: logging.Logger | None = None, **create: Any) -> None:
        self.logger = logger or logging.getLogger("sandfleet.swerex")
        self._url, self._given_fleet, self._cwd, self._create = url, fleet, cwd, create
        self._fleet: Any = None
        self.home: HomeLoop | None = None
        self._runtime: SandfleetRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> Sandbox:
        """The SDK's handle; its connection lives on `home` when that is set, so SDK calls go
        there: `await deployment.home.run(deployment.sandbox.metrics())`."""
        return self.runtime.sandbox

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._runtime is not None:
            return
        if self._given_fleet is None and self.home is None:
            self.home = HomeLoop("sandfleet-swerex")
        self._hooks.on_custom_step("Creating a sandfleet sandbox")
        try:
            await self._start()
        except BaseException:
            self._close_home()
            raise

    @at_home
    async def _start(self) -> None:
        import sandfleet

        self._fleet = self._given_fleet or await sandfleet.connect(self._url)
        try:
            sb = await self._fleet.create(**self._create)
        except BaseException:
            await self._close_fleet()
            raise
        self.logger.info("sandbox %s on node %s", sb.id, sb.node)
        self._runtime = SandfleetRuntime(sb, cwd=self._cwd, logger=self.logger, home=self.home)

    async def stop(self) -> None:
        try:
            await self._stop()
        finally:
            self._close_home()

    @at_home
    async def _stop(self) -> None:
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

    def _close_home(self) -> None:
        home, self.home = self.home, None
        if home is not None:
            home.close()

    @property
    def runtime(self) -> SandfleetRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

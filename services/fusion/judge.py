"""One `/run_code` call: a fresh sandbox with the language's layer, the request's files and code
written in, compile (if the language has a step) and run, the asked files read back, and the
sandbox destroyed whatever happened. A function of (request, deps); the platform is reached only
through the SDK."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sandfleet import errors, telemetry
from sandfleet.client import Fleet, Sandbox
from services.fusion import languages
from services.fusion.protocol import (
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    decoded_file,
    encoded_file,
    text,
)

log = logging.getLogger("sandfleet.fusion")
T = TypeVar("T")

WRITE_FILE_MAX = 4 * 1024 * 1024  # larger files go as a chunked upload
SETUP_SLACK_S = 120  # the sandbox's own end, past the request's timeouts: a backstop if we vanish


@dataclass(frozen=True)
class Deps:
    fleet: Fleet
    layers: dict[str, str]  # language -> layer
    isolation: str = "process"
    memory_mb: int = 1024  # for a request with memory_limit_MB -1
    cpu: float = 1.0
    slots: asyncio.Semaphore | None = None  # calls judged at once; the rest wait their turn


async def run_code(req: RunCodeRequest, deps: Deps) -> RunCodeResponse:
    plan = languages.plan(req.language, req.code)
    if plan is None:
        return _sandbox_error(f"language {req.language!r} is not judged here; "
                              f"this endpoint runs {', '.join(languages.LANGUAGES)}")
    async with turn(deps):
        return await _judge(req, plan, deps)


def turn(deps: Deps) -> contextlib.AbstractAsyncContextManager:
    """A call's turn among the endpoint's `slots` (at once, when there are none)."""
    return deps.slots if deps.slots is not None else contextlib.nullcontext()


async def _judge(req: RunCodeRequest, plan: languages.Plan, deps: Deps) -> RunCodeResponse:
    memory = req.memory_limit_MB if req.memory_limit_MB > 0 else deps.memory_mb
    lifetime = int(req.compile_timeout + req.run_timeout) + SETUP_SLACK_S
    return await in_fresh_sandbox(deps, req.language, memory, lifetime, lambda sb: _steps(sb, req, plan),
                                  _sandbox_error)


async def in_fresh_sandbox(deps: Deps, language: str, memory_mb: int, lifetime_s: int,
                           steps: Callable[[Sandbox], Awaitable[T]], failed: Callable[[str], T]) -> T:
    """`steps` in a new sandbox over the language's layer, destroyed whatever happens; `failed`
    makes the reply when the platform cannot give one."""
    layer = deps.layers[language]
    try:
        sb = await deps.fleet.create(isolation=deps.isolation, cpu=deps.cpu, memory_mb=memory_mb, layers=[layer],
                                     timeout_s=lifetime_s, labels={"client": "sandbox-fusion"})
    except errors.NotFound as exc:
        return failed(f"no layer {layer!r} for {language}: build it with "
                      f"`sandfleet fusion layers --only {language}` ({exc.message})")
    except errors.SandfleetError as exc:
        return failed(f"could not create a sandbox: {type(exc).__name__}: {exc.message}")
    # The sandbox goes whatever becomes of this call (a client that hangs up cancels it).
    running = asyncio.ensure_future(steps(sb))
    try:
        return await asyncio.shield(running)
    finally:
        await asyncio.shield(_destroy(sb, running))


async def _destroy(sb, steps: asyncio.Future) -> None:
    """Once its steps are over (each is bounded by its timeout), the sandbox goes."""
    if not steps.done():
        await asyncio.wait([steps])
    try:
        await sb.destroy()
    except errors.SandfleetError as exc:  # it ends by its own timeout anyway
        log.warning("destroy failed: %s", exc, extra={telemetry.SANDBOX_ID: sb.id})


async def _steps(sb, req: RunCodeRequest, plan: languages.Plan) -> RunCodeResponse:
    try:
        await _write_files(sb, req, plan)
        compiled = None
        if plan.compile is not None:
            compiled = await _command(sb, plan.compile, plan.env, req.compile_timeout, b"")
            if compiled.status != CommandRunStatus.FINISHED or compiled.return_code != 0:
                return RunCodeResponse(status=RunStatus.FAILED, compile_result=compiled,
                                       files=await fetch(sb, req.fetch_files), executor_pod_name=sb.id)
        stdin = (req.stdin or "").encode()
        ran = await _command(sb, plan.run, plan.env, req.run_timeout, stdin)
        ok = ran.status == CommandRunStatus.FINISHED and ran.return_code == 0
        return RunCodeResponse(status=RunStatus.SUCCESS if ok else RunStatus.FAILED, compile_result=compiled,
                               run_result=ran, files=await fetch(sb, req.fetch_files), executor_pod_name=sb.id)
    except errors.SandfleetError as exc:
        return _sandbox_error(f"{type(exc).__name__}: {exc.message}", sb.id)


async def _write_files(sb, req: RunCodeRequest, plan: languages.Plan) -> None:
    await write_files(sb, req.files, {plan.source: req.code.encode()})


async def write_files(sb, files: dict[str, str | None], more: dict[str, bytes]) -> None:
    """The request's files (base64, checked by decode_request) and `more`, relative paths in WORKDIR."""
    wanted = {languages.in_workdir(path): decoded_file(content) for path, content in files.items()
              if content is not None}
    wanted.update((languages.in_workdir(path), data) for path, data in more.items())
    parents = {posixpath.dirname(p) for p in wanted} - {languages.WORKDIR, "/tmp"}
    for parent in sorted(parents):
        await sb.files.mkdir(parent, parents=True)
    for path, data in wanted.items():
        assert data is not None  # decode_request refused what is not base64
        if len(data) <= WRITE_FILE_MAX:
            await sb.write_file(path, data)
        else:
            await sb.upload(data, path)


async def _command(sb, argv: list[str], env: dict[str, str], timeout: float, stdin: bytes) -> CommandRunResult:
    try:
        r = await sb.exec(argv, timeout_s=max(timeout, 0.001), env=env, cwd=languages.WORKDIR, stdin=stdin)
    except errors.NotFound as exc:  # the program is not in the layer
        return CommandRunResult(status=CommandRunStatus.ERROR, stderr=exc.message)
    status = CommandRunStatus.TIME_LIMIT_EXCEEDED if r.timed_out else CommandRunStatus.FINISHED
    return CommandRunResult(status=status, execution_time=r.duration_ms / 1000.0,
                            return_code=None if r.timed_out else r.exit_code,
                            stdout=text(r.stdout), stderr=text(r.stderr))


async def fetch(sb, paths: list[str]) -> dict[str, str]:
    """Each asked file that exists, by the path it was asked by; one that does not is left out,
    as SandboxFusion leaves it out."""
    found = {}
    for path in paths:
        try:
            found[path] = encoded_file(await sb.read_file(languages.in_workdir(path)))
        except (errors.NotFound, errors.InvalidRequest):
            continue
    return found


def _sandbox_error(message: str, sandbox_id: str | None = None) -> RunCodeResponse:
    return RunCodeResponse(status=RunStatus.SANDBOX_ERROR, message=message, executor_pod_name=sandbox_id)

"""Launcher endpoints: small functions of (request, launcher) that tag their span with the
sandbox and translate the drivers' typed errors into the bus's (ServiceError codes)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import Iterator

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.node import (
    MAX_FILE_BYTES,
    MAX_OUTPUT_BYTES,
    Checkpoint,
    CheckpointRequest,
    DestroyReply,
    DestroyRequest,
    ExecReply,
    ExecRequest,
    HintReply,
    HintRequest,
    LaunchReply,
    LaunchRequest,
    PauseReply,
    PauseRequest,
    QuarantineReply,
    QuarantineRequest,
    ReadFileReply,
    ReadFileRequest,
    ResumeReply,
    ResumeRequest,
    SelectedReply,
    SelectedRequest,
    WriteFileReply,
    WriteFileRequest,
)
from services.launcher import decisions, image_config, pausing
from services.launcher.drivers.base import Command, DriverFailure, ExecFailed, SandboxGone, Unsupported
from services.launcher.keys import tag
from services.launcher.lifecycle import Launcher
from services.launcher.starting import StartingMarks, placed_record
from services.launcher.state import Live


async def launch(launcher: Launcher, req: LaunchRequest) -> LaunchReply:
    tag(launcher.node_id, req.sandboxes[0].id if len(req.sandboxes) == 1 else None)
    launcher.intake.took(req.sandboxes)
    try:
        marks = StartingMarks(launcher.store, [item.id for item in req.sandboxes],
                              known={item.id: placed for item in req.sandboxes if (placed := placed_record(item))},
                              grace=launcher.settings.starting_grace_s)
        results = await asyncio.gather(*(launcher.launch(item, marks) for item in req.sandboxes))
    finally:
        launcher.intake.answered(req.sandboxes)
    return LaunchReply(results=list(results))


async def exec_(launcher: Launcher, req: ExecRequest) -> ExecReply:
    tag(launcher.node_id, req.sandbox_id)
    live = _unfrozen(launcher, req.sandbox_id)
    if live.paused:  # it would hang until a resume, and its timeout could not stop it
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is paused: resume it first")
    started = time.perf_counter()
    argv, env, cwd = image_config.resolve(live.rootfs, req.argv, req.env, req.cwd, req.image_command)
    command = Command(argv=argv, env=env, cwd=cwd, stdin=req.stdin, timeout_s=req.timeout_s,
                      max_output=MAX_OUTPUT_BYTES)
    # Tracked, so a quarantine can end it: a frozen command never answers a timeout's SIGTERM.
    running = asyncio.ensure_future(live.driver.exec(live.instance, command))
    live.execs.add(running)
    try:
        result = await running
    except asyncio.CancelledError:
        if live.quarantined and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} was quarantined while the command ran")
        raise
    except ExecFailed as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot run in sandbox {req.sandbox_id}: {exc}") from None
    except (OSError, SandboxGone) as exc:
        raise _file_error(exc, cwd) from None
    except ValueError as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    finally:
        live.execs.discard(running)
    return ExecReply(
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        timed_out=result.timed_out,
        truncated=result.truncated,
        duration_ms=(time.perf_counter() - started) * 1000,
    )


async def write_file(launcher: Launcher, req: WriteFileRequest) -> WriteFileReply:
    tag(launcher.node_id, req.sandbox_id)
    live = _unfrozen(launcher, req.sandbox_id)
    try:
        size = live.driver.write_file(live.instance, req.path, req.data, req.mode)
    except (OSError, ValueError, SandboxGone) as exc:
        raise _file_error(exc, req.path) from None
    return WriteFileReply(size=size)


async def read_file(launcher: Launcher, req: ReadFileRequest) -> ReadFileReply:
    tag(launcher.node_id, req.sandbox_id)
    live = launcher.get_live(req.sandbox_id)
    try:
        data = live.driver.read_file(live.instance, req.path, MAX_FILE_BYTES)
    except (OSError, ValueError, SandboxGone) as exc:
        raise _file_error(exc, req.path) from None
    return ReadFileReply(data=data)


async def destroy(launcher: Launcher, req: DestroyRequest) -> DestroyReply:
    tag(launcher.node_id, req.sandbox_id)
    refused = decisions.destroy_reason_refusal(req.reason)
    if refused is not None:
        raise refused
    return DestroyReply(record=await launcher.destroy(req.sandbox_id, req.reason, req.detail))


async def quarantine(launcher: Launcher, req: QuarantineRequest) -> QuarantineReply:
    tag(launcher.node_id, req.sandbox_id)
    with _freezing(f"freeze sandbox {req.sandbox_id}"):
        return QuarantineReply(record=await launcher.quarantine(req.sandbox_id, req.detail))


async def pause(launcher: Launcher, req: PauseRequest) -> PauseReply:
    tag(launcher.node_id, req.sandbox_id)
    with _freezing(f"freeze sandbox {req.sandbox_id}"):
        return PauseReply(record=await pausing.pause(launcher, req.sandbox_id, req.reason, req.detail))


async def resume(launcher: Launcher, req: ResumeRequest) -> ResumeReply:
    tag(launcher.node_id, req.sandbox_id)
    with _freezing(f"thaw sandbox {req.sandbox_id}"):
        return ResumeReply(record=await pausing.resume(launcher, req.sandbox_id))


async def pause_selected(launcher: Launcher, req: SelectedRequest) -> SelectedReply:
    tag(launcher.node_id)
    return await pausing.pause_selected(launcher, dict(req.labels))


async def resume_selected(launcher: Launcher, req: SelectedRequest) -> SelectedReply:
    tag(launcher.node_id)
    return await pausing.resume_selected(launcher, dict(req.labels))


async def hint(launcher: Launcher, req: HintRequest) -> HintReply:
    tag(launcher.node_id, req.sandbox_id)
    try:
        return pausing.hint(launcher, req.sandbox_id, req.hint)
    except Unsupported as exc:
        raise ServiceError(ErrorCode.UNSUPPORTED, str(exc)) from None
    except OSError as exc:
        why = f"cannot change the CPU weight of {req.sandbox_id}: {exc.strerror}"
        raise ServiceError(ErrorCode.CONFLICT, why) from None


async def checkpoint(launcher: Launcher, req: CheckpointRequest) -> Checkpoint:
    tag(launcher.node_id, req.sandbox_id)
    with _freezing(f"checkpoint {req.sandbox_id}"):
        return await pausing.checkpoint(launcher, req)


@contextlib.contextmanager
def _freezing(what: str) -> Iterator[None]:
    """Errors of a freeze or thaw: the sandbox's cgroup went away under us (it is ending) is the
    caller's conflict; a freeze that never settled is ours."""
    try:
        yield
    except DriverFailure as exc:
        raise ServiceError(ErrorCode.INTERNAL, str(exc)) from None
    except OSError as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot {what}: {exc.strerror}") from None


def _unfrozen(launcher: Launcher, sandbox_id: str) -> Live:
    """A quarantined sandbox keeps its files as evidence: it may be read, not run or written."""
    live = launcher.get_live(sandbox_id)
    if live.quarantined:
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is quarantined: read its files or destroy it")
    return live


def _file_error(exc: Exception, path: str) -> ServiceError:
    if isinstance(exc, (SandboxGone, ProcessLookupError)):
        return ServiceError(ErrorCode.CONFLICT, "the sandbox's init is gone")
    if isinstance(exc, FileNotFoundError):
        return ServiceError(ErrorCode.NOT_FOUND, f"{path}: no such file or directory")
    if isinstance(exc, ValueError):
        return ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: {exc}")
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, exc.errno)
        return ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: {name} {exc.strerror}")
    return ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: {type(exc).__name__}")

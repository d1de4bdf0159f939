"""Launcher endpoints: small functions of (request, launcher) that translate kernel errors."""

from __future__ import annotations

import asyncio
import errno
import time

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.node import (
    MAX_FILE_BYTES,
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
from schemas.sandbox import Reason
from linuxnode import process as process_runtime
from services.launcher import pausing
from services.launcher.lifecycle import Launcher, Live
from services.launcher.runtimes import ExecFailed
from services.launcher.starting import StartingMarks, placed_record


async def launch(launcher: Launcher, req: LaunchRequest) -> LaunchReply:
    marks = StartingMarks(launcher.store, [item.id for item in req.sandboxes],
                          known={item.id: placed for item in req.sandboxes if (placed := placed_record(item))})
    return LaunchReply(results=list(await asyncio.gather(*(launcher.launch(item, marks) for item in req.sandboxes))))


async def exec_(launcher: Launcher, req: ExecRequest) -> ExecReply:
    live = _unfrozen(launcher, req.sandbox_id)
    if live.paused:  # it would hang until a resume, and its timeout could not stop it
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is paused: resume it first")
    started = time.perf_counter()
    # Tracked, so a quarantine can end it: a frozen command never answers a timeout's SIGTERM.
    running = asyncio.ensure_future(
        launcher.runtimes.driver(live.spec.isolation).exec(live.id, live.init, live.confinement, req))
    live.execs.add(running)
    try:
        result = await running
    except asyncio.CancelledError:
        if live.quarantined and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} was quarantined while the command ran")
        raise
    except ExecFailed as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot run in sandbox {req.sandbox_id}: {exc}") from None
    except OSError as exc:
        raise _file_error(exc, req.cwd) from None
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
    live = _unfrozen(launcher, req.sandbox_id)
    try:
        size = process_runtime.write_file(live.init, req.path, req.data, req.mode)
    except (OSError, ValueError) as exc:
        raise _file_error(exc, req.path) from None
    return WriteFileReply(size=size)


async def read_file(launcher: Launcher, req: ReadFileRequest) -> ReadFileReply:
    live = launcher.get_live(req.sandbox_id)
    try:
        data = process_runtime.read_file(live.init, req.path, MAX_FILE_BYTES)
    except (OSError, ValueError) as exc:
        raise _file_error(exc, req.path) from None
    return ReadFileReply(data=data)


async def destroy(launcher: Launcher, req: DestroyRequest) -> DestroyReply:
    if req.reason not in (Reason.REQUESTED, Reason.VIOLATION):
        why = f"a destroy's reason is requested or violation, not {req.reason.value}"
        raise ServiceError(ErrorCode.INVALID_REQUEST, why)
    return DestroyReply(record=await launcher.destroy(req.sandbox_id, req.reason, req.detail))


async def quarantine(launcher: Launcher, req: QuarantineRequest) -> QuarantineReply:
    try:
        return QuarantineReply(record=await launcher.quarantine(req.sandbox_id, req.detail))
    except OSError as exc:  # its cgroup went away under us: the sandbox is ending
        raise ServiceError(ErrorCode.CONFLICT, f"cannot freeze sandbox {req.sandbox_id}: {exc.strerror}") from None


async def pause(launcher: Launcher, req: PauseRequest) -> PauseReply:
    try:
        return PauseReply(record=await pausing.pause(launcher, req.sandbox_id, req.reason, req.detail))
    except OSError as exc:  # its cgroup went away under us: the sandbox is ending
        raise ServiceError(ErrorCode.CONFLICT, f"cannot freeze sandbox {req.sandbox_id}: {exc.strerror}") from None


async def resume(launcher: Launcher, req: ResumeRequest) -> ResumeReply:
    try:
        return ResumeReply(record=await pausing.resume(launcher, req.sandbox_id))
    except OSError as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot thaw sandbox {req.sandbox_id}: {exc.strerror}") from None


async def pause_selected(launcher: Launcher, req: SelectedRequest) -> SelectedReply:
    return await pausing.pause_selected(launcher, dict(req.labels))


async def resume_selected(launcher: Launcher, req: SelectedRequest) -> SelectedReply:
    return await pausing.resume_selected(launcher, dict(req.labels))


async def hint(launcher: Launcher, req: HintRequest) -> HintReply:
    try:
        return pausing.hint(launcher, req.sandbox_id, req.hint)
    except OSError as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot change the CPU weight of {req.sandbox_id}: {exc.strerror}") from None


async def checkpoint(launcher: Launcher, req: CheckpointRequest) -> Checkpoint:
    try:
        return await pausing.checkpoint(launcher, req)
    except OSError as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot checkpoint {req.sandbox_id}: {exc.strerror}") from None


def _unfrozen(launcher: Launcher, sandbox_id: str) -> Live:
    """A quarantined sandbox keeps its files as evidence: it may be read, not run or written."""
    live = launcher.get_live(sandbox_id)
    if live.quarantined:
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is quarantined: read its files or destroy it")
    return live


def _file_error(exc: Exception, path: str) -> ServiceError:
    if isinstance(exc, ProcessLookupError):
        return ServiceError(ErrorCode.CONFLICT, "the sandbox's init is gone")
    if isinstance(exc, FileNotFoundError):
        return ServiceError(ErrorCode.NOT_FOUND, f"{path}: no such file or directory")
    if isinstance(exc, ValueError):
        return ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: {exc}")
    if isinstance(exc, OSError) and exc.errno is not None:
        return ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}")
    return ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: {type(exc).__name__}")

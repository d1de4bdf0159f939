"""Launcher endpoints: small functions of (request, launcher) that translate kernel errors."""

from __future__ import annotations

import asyncio
import errno
import time

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.node import (
    MAX_FILE_BYTES,
    DestroyReply,
    DestroyRequest,
    ExecReply,
    ExecRequest,
    LaunchReply,
    LaunchRequest,
    ReadFileReply,
    ReadFileRequest,
    WriteFileReply,
    WriteFileRequest,
)
from schemas.sandbox import Reason
from sandfleet.kernel import process as process_runtime
from services.launcher.lifecycle import Launcher
from services.launcher.runtimes import ExecFailed


async def launch(launcher: Launcher, req: LaunchRequest) -> LaunchReply:
    return LaunchReply(results=list(await asyncio.gather(*(launcher.launch(item) for item in req.sandboxes))))


async def exec_(launcher: Launcher, req: ExecRequest) -> ExecReply:
    live = launcher.get_live(req.sandbox_id)
    started = time.perf_counter()
    try:
        result = await launcher.runtimes.driver(live.spec.isolation).exec(live.id, live.init, live.confinement, req)
    except ExecFailed as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"cannot run in sandbox {req.sandbox_id}: {exc}") from None
    except OSError as exc:
        raise _file_error(exc, req.cwd) from None
    except ValueError as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    return ExecReply(
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        timed_out=result.timed_out,
        truncated=result.truncated,
        duration_ms=(time.perf_counter() - started) * 1000,
    )


async def write_file(launcher: Launcher, req: WriteFileRequest) -> WriteFileReply:
    live = launcher.get_live(req.sandbox_id)
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
    return DestroyReply(record=await launcher.destroy(req.sandbox_id, Reason.REQUESTED))


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

"""Launcher endpoints: small functions of (request, launcher) that tag their span with the
sandbox and translate the drivers' typed errors into the bus's (ServiceError codes)."""

from __future__ import annotations

import asyncio
import contextlib
import time

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
from services.launcher import decisions, image_config, machine_checkpoints, pausing
from services.launcher.driver_errors import DRIVER_ERRORS, service_error, translated
from services.launcher.drivers.base import Command
from services.launcher.keys import tag
from services.launcher.lifecycle import Launcher
from services.launcher.processes import KILLED_CHECK_S, KILLED_CHECKS, sandbox_gone
from services.launcher.starting import StartingMarks, placed_record
from services.launcher.state import Live


async def launch(launcher: Launcher, req: LaunchRequest) -> LaunchReply:
    items = req.items()
    if not items:
        raise ServiceError(ErrorCode.INVALID_REQUEST, "the launch names no sandbox")
    tag(launcher.node_id, items[0].id if len(items) == 1 else None)
    launcher.intake.took(items)
    try:
        marks = StartingMarks(launcher.store, [item.id for item in items],
                              known={item.id: placed for item in items if (placed := placed_record(item))},
                              grace=launcher.settings.starting_grace_s)
        results = await asyncio.gather(*(launcher.launch(item, marks) for item in items))
    finally:
        launcher.intake.answered(items)
    return LaunchReply(results=list(results))


async def exec_(launcher: Launcher, req: ExecRequest) -> ExecReply:
    tag(launcher.node_id, req.sandbox_id)
    live = _unfrozen(launcher, req.sandbox_id)
    if live.paused:  # it would hang until a resume, and its timeout could not stop it
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is paused: resume it first")
    started = time.perf_counter()
    argv, env, cwd = image_config.resolve(live.rootfs, req.argv, req.env, req.cwd, req.image_command)
    uid, gid = await image_config.image_ids(live)
    command = Command(argv=argv, env=env, cwd=cwd, stdin=req.stdin, timeout_s=req.timeout_s,
                      max_output=MAX_OUTPUT_BYTES, uid=uid, gid=gid)
    # Tracked, so a quarantine can end it: a frozen command never answers a timeout's SIGTERM.
    running = asyncio.ensure_future(live.driver.exec(live.instance, command))
    live.execs.add(running)
    try:
        result = await running
    except asyncio.CancelledError:
        if live.quarantined and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} was quarantined while the command ran")
        raise
    except DRIVER_ERRORS as exc:
        raise service_error(exc, cwd) from None
    finally:
        live.execs.discard(running)
    signalled = result.exit_code > 128 and not result.timed_out
    return ExecReply(
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        timed_out=result.timed_out,
        truncated=result.truncated,
        duration_ms=(time.perf_counter() - started) * 1000,
        sandbox_ended=signalled and await _ended_under(launcher, req.sandbox_id, killed=result.exit_code == 137),
    )


async def _ended_under(launcher: Launcher, sandbox_id: str, killed: bool) -> bool:
    """Whether a command that a signal ended went with its sandbox. A dying init first kills every
    process of its namespace and only then ends, so a SIGKILLed command whose init still looks
    alive is asked about again a moment later (as a background process's exit is)."""
    for _ in range(KILLED_CHECKS + 1 if killed else 1):
        if sandbox_gone(launcher, sandbox_id):
            return True
        await asyncio.sleep(KILLED_CHECK_S)
    return False


async def write_file(launcher: Launcher, req: WriteFileRequest) -> WriteFileReply:
    tag(launcher.node_id, req.sandbox_id)
    live = _unfrozen(launcher, req.sandbox_id)
    with translated(req.path):
        # Off the loop: a file of a VM level is a round trip to its guest agent, which the
        # driver makes on this loop from the worker thread.
        size = await asyncio.to_thread(live.driver.write_file, live.instance, req.path, req.data, req.mode)
    return WriteFileReply(size=size)


async def read_file(launcher: Launcher, req: ReadFileRequest) -> ReadFileReply:
    tag(launcher.node_id, req.sandbox_id)
    live = launcher.get_live(req.sandbox_id)
    with translated(req.path):
        data = await asyncio.to_thread(live.driver.read_file, live.instance, req.path, MAX_FILE_BYTES)
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
    with translated(f"cannot change the CPU weight of {req.sandbox_id}", path=False):
        return pausing.hint(launcher, req.sandbox_id, req.hint)


async def checkpoint(launcher: Launcher, req: CheckpointRequest) -> Checkpoint:
    tag(launcher.node_id, req.sandbox_id)
    with _freezing(f"checkpoint {req.sandbox_id}"):
        if req.memory:
            return await machine_checkpoints.checkpoint(launcher, req)
        return await pausing.checkpoint(launcher, req)


def _freezing(what: str) -> contextlib.AbstractContextManager[None]:
    """Errors of a freeze or thaw: the sandbox's cgroup went away under us (it is ending) is the
    caller's conflict; a freeze that never settled is ours (DriverFailure: INTERNAL)."""
    return translated(f"cannot {what}", path=False)


def _unfrozen(launcher: Launcher, sandbox_id: str) -> Live:
    """A quarantined sandbox keeps its files as evidence: it may be read, not run or written."""
    live = launcher.get_live(sandbox_id)
    if live.quarantined:
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is quarantined: read its files or destroy it")
    return live



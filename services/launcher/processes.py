"""Background processes of this node's sandboxes: the table of them and the `proc.*` endpoints,
small functions of (request, table).

A process is spawned through its sandbox's driver and outlives the request (and the client)
until it ends or its sandbox does. Its output goes into a bounded buffer (process_output.py)
that readers pull from with a long poll: a read answers as soon as there is output past its
offset, else after `wait_s`; so the node never holds more than the buffers whatever readers
do, a reader that went away costs nothing, and any client can re-attach from offset 0 later.
Why pull rather than push: backpressure and re-attach come for free, one request in flight per
reader keeps the first byte one round trip away, and there is no inbox to leak.

Pids are the table's, unique on the node (so a pid of another sandbox is an unknown pid there)
and never reused while the launcher runs. Processes end with the launcher (its spawner ends the
commands it can no longer read), like the sandbox's execs. A sandbox that ends takes its
processes with it (its pid namespace dies); their entries and buffers go as their exits
arrive, and `sweep_loop` drops what is left of sandboxes no longer live.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sandfleet.bus import Raw
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.process import (
    MAX_SPANS,
    Chunk,
    Exit,
    ListReply,
    ListRequest,
    ProcessInfo,
    RawReadReply,
    ReadReply,
    ReadRequest,
    SignalRequest,
    Span,
    SpawnRequest,
    WaitRequest,
    WriteReply,
    WriteRequest,
)
from services.launcher import image_config
from services.launcher.driver_errors import DRIVER_ERRORS, service_error
from services.launcher.drivers.base import Command, RunningCommand, StdinClosed
from services.launcher.keys import tag
from services.launcher.lifecycle import Launcher
from services.launcher.process_output import OutputBuffer

SWEEP_S = 2.0
KILLED_CHECKS, KILLED_CHECK_S = 3, 0.1


def sandbox_gone(launcher: Launcher, sandbox_id: str) -> bool:
    """Whether the sandbox has ended or is ending. An init that died on its own (killed, out of
    memory) is seen by the launcher's watch maybe only after a command's exit, so the kernel is
    asked too."""
    live = launcher.live.get(sandbox_id)
    return live is None or live.ending or not live.driver.alive(live.instance.anchor)


@dataclass
class Process:
    pid: int
    sandbox_id: str
    argv: list[str]
    buffer: OutputBuffer
    started_at: float = field(default_factory=time.time)
    running: RunningCommand | None = None
    exit: Exit | None = None
    timed_out: bool = False
    timer: asyncio.TimerHandle | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def info(self) -> ProcessInfo:
        return ProcessInfo(pid=self.pid, os_pid=self.running.os_pid if self.running and not self.exit else None,
                           argv=self.argv, started_at=self.started_at, exit=self.exit,
                           stdin_open=bool(self.running and self.running.stdin_open and not self.exit),
                           written=self.buffer.end, dropped=self.buffer.start)


class ProcessTable:
    """Every background process of this node's live sandboxes, by sandbox."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.settings = launcher.settings
        self.by_sandbox: dict[str, dict[int, Process]] = {}
        self._pids = itertools.count(1)

    def of(self, sandbox_id: str) -> dict[int, Process]:
        return self.by_sandbox.get(sandbox_id, {})

    def find(self, sandbox_id: str, pid: int) -> Process:
        self.launcher.get_live(sandbox_id)  # NOT_FOUND for a sandbox that is not (or no longer) here
        found = self.of(sandbox_id).get(pid)
        if found is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no process {pid} in sandbox {sandbox_id}")
        return found

    def running(self, sandbox_id: str) -> int:
        return sum(1 for p in self.of(sandbox_id).values() if p.exit is None)

    def add(self, process: Process) -> None:
        procs = self.by_sandbox.setdefault(process.sandbox_id, {})
        procs[process.pid] = process
        ended = [p for p in procs.values() if p.exit is not None]
        for old in ended[:max(0, len(ended) - self.settings.ended_processes_kept)]:
            self._forget(old)

    def _forget(self, process: Process) -> None:
        procs = self.by_sandbox.get(process.sandbox_id, {})
        if procs.get(process.pid) is process:
            del procs[process.pid]
            if not procs:
                self.by_sandbox.pop(process.sandbox_id, None)
        if process.timer is not None:
            process.timer.cancel()
        if process.running is not None:
            process.running.close()
        process.buffer.free()
        process.ended.set()

    def exited(self, process: Process, status: int, checks: int = KILLED_CHECKS) -> None:
        code = os.waitstatus_to_exitcode(status)
        # As a dying init first kills every process of its namespace and only then ends, a
        # process SIGKILLed while its init looks alive is asked about again a moment later
        # before its exit is told.
        gone = sandbox_gone(self.launcher, process.sandbox_id)
        if not gone and code == -9 and checks > 0:
            asyncio.get_running_loop().call_later(KILLED_CHECK_S, self.exited, process, status, checks - 1)
            return
        process.exit = Exit(exit_code=128 - code if code < 0 else code, signal=-code if code < 0 else None,
                            timed_out=process.timed_out, sandbox_ended=gone)
        if process.timer is not None:
            process.timer.cancel()
        process.ended.set()
        process.buffer.wake()
        if process.exit.sandbox_ended:
            self._forget(process)

    def drop_sandbox(self, sandbox_id: str) -> None:
        for process in list(self.of(sandbox_id).values()):
            self._forget(process)

    async def sweep_loop(self, period_s: float = SWEEP_S) -> None:
        """Drop the processes of sandboxes that ended without an exit reaching us (all of theirs
        had ended before)."""
        while True:
            await asyncio.sleep(period_s)
            for sandbox_id in [s for s in self.by_sandbox if s not in self.launcher.live]:
                self.drop_sandbox(sandbox_id)

    def close(self) -> None:
        for sandbox_id in list(self.by_sandbox):
            self.drop_sandbox(sandbox_id)


# -- endpoints -----------------------------------------------------------------------------


async def spawn(table: ProcessTable, req: SpawnRequest) -> ProcessInfo:
    return await start(table, req, lambda live, command, on_output, on_exit: live.driver.spawn(
        live.instance, command, on_output, on_exit), keep_stdin=req.stdin)


# How a request's command is started: (live sandbox, command, on_output, on_exit) -> RunningCommand.
Launch = Callable[[Any, Command, Callable[[int, bytes], None], Callable[[int], None]], Awaitable[RunningCommand]]


async def start(table: ProcessTable, req: Any, launch: Launch, keep_stdin: bool = True) -> ProcessInfo:
    """Start the command of `req` (a SpawnRequest or one with its fields: a terminal's) with
    `launch` and keep it in the table: the limits, the buffer, the timeout and every refusal
    as for any background process."""
    tag(table.launcher.node_id, req.sandbox_id)
    live = table.launcher.get_live(req.sandbox_id)
    if live.quarantined or live.paused:
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is frozen: resume it first")
    limit = table.settings.max_processes
    if table.running(req.sandbox_id) >= limit:
        raise ServiceError(ErrorCode.CAPACITY, f"sandbox {req.sandbox_id} already runs {limit} background "
                                               "processes (the node's limit): wait for or kill one")
    size = min(req.buffer_bytes or table.settings.process_buffer_bytes, table.settings.max_process_buffer_bytes)
    argv, env, cwd = image_config.resolve(live.rootfs, req.argv, req.env, req.cwd, req.image_command)
    process = Process(pid=next(table._pids), sandbox_id=req.sandbox_id, argv=argv, buffer=OutputBuffer(size))
    uid, gid = await image_config.image_ids(live)
    command = Command(argv=argv, env=env, cwd=cwd, stdin=b"", timeout_s=req.timeout_s or 0, max_output=size,
                      uid=uid, gid=gid)
    try:
        running = await launch(live, command, process.buffer.append, lambda status: table.exited(process, status))
    except DRIVER_ERRORS as exc:
        raise service_error(exc, cwd) from None
    process.running = running
    if not keep_stdin:
        running.close_stdin()
    if process.exit is not None and process.exit.sandbox_ended:
        running.close()
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} ended as the process started")
    table.add(process)
    if req.timeout_s is not None and process.exit is None:
        process.timer = asyncio.get_running_loop().call_later(req.timeout_s, _time_out, process)
    return process.info()


def _time_out(process: Process) -> None:
    if process.exit is None and process.running is not None:
        process.timed_out = True
        process.running.signal(9)


async def read(table: ProcessTable, req: ReadRequest) -> ReadReply | Raw:
    """Version 1 (ReadReply, base64 in JSON), or with `raw` version 2: a RawReadReply header and
    the output bytes as the body (schemas/process.py)."""
    tag(table.launcher.node_id, req.sandbox_id)
    process = table.find(req.sandbox_id, req.pid)
    buffer = process.buffer
    if buffer.end <= req.offset and process.exit is None and req.wait_s > 0:
        await buffer.changed(req.wait_s)
    chunks, next_offset, dropped = buffer.read(req.offset, req.max_bytes)
    if not req.raw:
        done = process.exit is not None and next_offset >= buffer.end
        return ReadReply(chunks=chunks, next_offset=next_offset, dropped=dropped, exit=process.exit if done else None)
    spans, chunks = _spans(chunks)
    if spans:
        next_offset = spans[-1].offset + spans[-1].size
    done = process.exit is not None and next_offset >= buffer.end
    body = [c.data for c in chunks]  # sent as they are, never joined (natspy_bulk.publish_bulk)
    return Raw(RawReadReply(spans=spans, next_offset=next_offset, dropped=dropped, exit=process.exit if done else None),
               body)


def _spans(chunks: list[Chunk]) -> tuple[list[Span], list[Chunk]]:
    """One span per run of one stream (the chunks are contiguous on the one count), at most
    MAX_SPANS (so the header stays small whatever the command's writes): (spans, chunks they cover)."""
    spans: list[Span] = []
    for i, chunk in enumerate(chunks):
        if spans and spans[-1].stream == chunk.stream:
            last = spans[-1]
            spans[-1] = Span(stream=last.stream, offset=last.offset, size=last.size + len(chunk.data))
        elif len(spans) == MAX_SPANS:
            return spans, chunks[:i]
        else:
            spans.append(Span(stream=chunk.stream, offset=chunk.offset, size=len(chunk.data)))
    return spans, chunks


async def write(table: ProcessTable, req: WriteRequest) -> WriteReply:
    tag(table.launcher.node_id, req.sandbox_id)
    process = table.find(req.sandbox_id, req.pid)
    if process.exit is not None or process.running is None:
        raise ServiceError(ErrorCode.CONFLICT, f"process {req.pid} has ended: its stdin is closed")
    if not process.running.stdin_open:
        raise ServiceError(ErrorCode.CONFLICT, f"process {req.pid}'s stdin is closed (or was never open: "
                                               "spawn it with stdin=True)")
    try:
        written = await process.running.write(req.data) if req.data else 0
    except StdinClosed as exc:
        raise ServiceError(ErrorCode.CONFLICT, f"process {req.pid}: {exc}") from None
    if req.close:
        process.running.close_stdin()
    return WriteReply(written=written)


async def signal(table: ProcessTable, req: SignalRequest) -> ProcessInfo:
    tag(table.launcher.node_id, req.sandbox_id)
    process = table.find(req.sandbox_id, req.pid)
    if process.exit is not None or process.running is None or not process.running.signal(req.signal):
        raise ServiceError(ErrorCode.CONFLICT, f"process {req.pid} has ended")
    return process.info()


async def wait(table: ProcessTable, req: WaitRequest) -> ProcessInfo:
    tag(table.launcher.node_id, req.sandbox_id)
    process = table.find(req.sandbox_id, req.pid)
    if process.exit is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.ended.wait(), req.wait_s)
    return process.info()


async def list_(table: ProcessTable, req: ListRequest) -> ListReply:
    tag(table.launcher.node_id, req.sandbox_id)
    table.launcher.get_live(req.sandbox_id)
    return ListReply(processes=[p.info() for p in table.of(req.sandbox_id).values()])

"""Background processes of a sandbox, from the client: the `Process` handle, streaming exec on
top of it, and telling a command that ended from a sandbox that did (`SandboxEnded`).

A handle is only a sandbox and a pid: any client process may make one (`sb.process(pid)`)
and read the output from offset 0, as far as the node's buffer still holds it. Reading is a
long poll (schemas/process.py): one `proc.read` in flight per reader, answered as output comes,
its bytes the raw body of the reply (version 2) split by the spans of its header.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import nats.errors

from sandfleet import errors
from schemas import node
from schemas import process as proc
from schemas.sandbox import State

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox

STREAMS = {proc.STDOUT: "stdout", proc.STDERR: "stderr"}
OutputCallback = Callable[[bytes], None | Awaitable[None]]
_ENDING = (State.STOPPING, State.STOPPED, State.FAILED)
REASON_TRIES, REASON_WAIT_S = 10, 0.2
# The node's buffer for a streamed exec (capped by the node: 16 MiB by default). A live reader
# holds the command back once it is half a buffer behind, so the buffer bounds a read reply:
# with 2 MiB (2 x MAX_OUTPUT_BYTES, as before) replies carried 0.6-0.9 MiB and `head -c 1G`
# cost 2.5-2.9 CPU-s over client, launcher and nats-server; with 16 MiB 3.2-3.7 MiB, 2.2-2.3
# CPU-s (fewer messages: nats-server 1.15 -> 0.9-0.98 of it). The node keeps at most this
# much of a command's newest output, as for any background process (ended ones: the newest
# few per sandbox, launcher settings).
STREAMED_BUFFER_BYTES = 4 * proc.MAX_READ_BYTES


@dataclass(frozen=True)
class Output:
    stream: str  # "stdout" or "stderr"
    data: bytes
    offset: int  # of data's first byte, on the process's one count over both streams
    dropped: int = 0  # bytes the node's buffer had dropped just before this (the oldest output)


async def sandbox_ended(sb: Sandbox) -> errors.SandboxEnded | None:
    """The error to raise if the sandbox has ended (or is ending), None if it still runs."""
    try:
        record = await sb._fleet.get(sb.id)
        state, reason = record.state, record.reason
    except errors.NotFound:  # a stopped sandbox's record is forgotten: its events are kept
        try:
            ending = [e for e in await sb._fleet.history(sb.id, idle_s=0.2, node=sb.node) if e.state in _ENDING]
        except (nats.errors.Error, errors.Unsupported):  # no stream to read (a tenant's has none): the NotFound stands
            return None
        if not ending:
            return None  # never was: the caller's NotFound stands
        state, reason = ending[-1].state, ending[-1].reason
    if state in _ENDING:
        return errors.SandboxEnded(f"sandbox {sb.id} ended ({reason.value}) under the command", reason=reason.value)
    return None


async def raise_ended(sb: Sandbox, what: str) -> NoReturn:
    """Raise SandboxEnded for a sandbox the node saw end under `what`, with the record's reason
    (an init that died on its own is recorded a moment after the node saw it)."""
    for _ in range(REASON_TRIES):
        ended = await sandbox_ended(sb)
        if ended is not None:
            raise ended
        await asyncio.sleep(REASON_WAIT_S)
    raise errors.SandboxEnded(f"sandbox {sb.id} ended under {what}")


async def ended_or(sb: Sandbox, exc: errors.SandfleetError) -> errors.SandfleetError:
    """`exc`, or SandboxEnded if what failed is that the sandbox ended."""
    if isinstance(exc, (errors.NotFound, errors.Conflict)) and not isinstance(exc, errors.SandboxEnded):
        ended = await sandbox_ended(sb)
        if ended is not None:
            return ended
    return exc


class Process:
    """A background process of a sandbox; cheap to make, holds nothing of its own."""

    def __init__(self, sb: Sandbox, pid: int, info: proc.ProcessInfo | None = None) -> None:
        self.sandbox = sb
        self.pid = pid
        self.last = info  # what the node last said of it
        self._exit: proc.Exit | None = None  # as a read told it

    def __repr__(self) -> str:
        return f"Process(sandbox={self.sandbox.id!r}, pid={self.pid})"

    @property
    def os_pid(self) -> int | None:
        return self.last.os_pid if self.last else None

    @property
    def exit(self) -> proc.Exit | None:
        """How it ended, once a read or wait saw it end; None before."""
        return self._exit or (self.last.exit if self.last else None)

    async def _request(self, verb: str, req, reply: type, timeout: float = 30.0):
        try:
            return await self.sandbox._fleet.bus.request(self.sandbox._subject(verb), req, reply, timeout=timeout)
        except errors.SandfleetError as exc:
            raise await ended_or(self.sandbox, exc) from None

    async def _request_raw(self, verb: str, req, reply: type, timeout: float):
        try:
            return await self.sandbox._fleet.bus.request_raw(self.sandbox._subject(verb), req, reply, timeout=timeout)
        except errors.SandfleetError as exc:
            raise await ended_or(self.sandbox, exc) from None

    async def _ended(self, exit: proc.Exit) -> None:
        if exit.sandbox_ended:
            await raise_ended(self.sandbox, f"process {self.pid}")

    async def info(self) -> proc.ProcessInfo:
        req = proc.WaitRequest(sandbox_id=self.sandbox.id, pid=self.pid, wait_s=0)
        self.last = await self._request(proc.WAIT, req, proc.ProcessInfo)
        return self.last

    async def output(self, offset: int = 0, *, follow: bool = True) -> AsyncIterator[Output]:
        """Its output from `offset` (0: all the node still holds) as it comes, until it ends (or,
        with follow=False, until what is there now is read). Raises SandboxEnded if the sandbox
        ended under it."""
        while True:
            req = proc.ReadRequest(sandbox_id=self.sandbox.id, pid=self.pid, offset=offset,
                                   max_bytes=proc.MAX_READ_BYTES, wait_s=10.0 if follow else 0.0, raw=True)
            r, body = await self._request_raw(proc.READ, req, proc.RawReadReply, timeout=req.wait_s + 20)
            dropped = r.dropped
            at, view = 0, memoryview(body)  # a bulk reply's body is a bytearray: each span becomes bytes once
            for span in r.spans:
                data = bytes(view[at:at + span.size])
                at += span.size
                yield Output(STREAMS.get(span.stream, "stdout"), data, span.offset, dropped)
                dropped = 0
            if dropped:
                yield Output("stdout", b"", r.next_offset, dropped)
            offset = r.next_offset
            if r.exit is not None:
                self._exit = r.exit
                await self._ended(r.exit)
                return
            if not follow and not r.spans:
                return

    async def send_stdin(self, data: bytes) -> int:
        """Write to its stdin (waits while the pipe is full); Conflict if stdin is closed or it ended."""
        req = proc.WriteRequest(sandbox_id=self.sandbox.id, pid=self.pid, data=data)
        return (await self._request(proc.WRITE, req, proc.WriteReply, timeout=60)).written

    async def close_stdin(self) -> None:
        await self._request(proc.WRITE, proc.WriteRequest(sandbox_id=self.sandbox.id, pid=self.pid, close=True),
                            proc.WriteReply)

    async def signal(self, number: int = 15) -> None:
        """Send signal `number` to its process group (it leads its own session)."""
        req = proc.SignalRequest(sandbox_id=self.sandbox.id, pid=self.pid, signal=int(number))
        self.last = await self._request(proc.SIGNAL, req, proc.ProcessInfo)

    async def kill(self) -> None:
        await self.signal(9)

    async def wait(self, timeout_s: float | None = None) -> proc.Exit:
        """Until it ends: its Exit (exit_code, signal). Raises SandboxEnded if the sandbox ended
        under it, Timeout after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = proc.MAX_WAIT_S if deadline is None else max(0.0, min(proc.MAX_WAIT_S, deadline - time.monotonic()))
            req = proc.WaitRequest(sandbox_id=self.sandbox.id, pid=self.pid, wait_s=left)
            self.last = await self._request(proc.WAIT, req, proc.ProcessInfo, timeout=left + 20)
            if self.last.exit is not None:
                await self._ended(self.last.exit)
                return self.last.exit
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.Timeout(f"process {self.pid} still runs after {timeout_s:g}s")


async def spawn(sb: Sandbox, argv: list[str] | None, *, env: dict[str, str] | None = None, cwd: str = "/workspace",
                stdin: bool = False, timeout_s: float | None = None, buffer_bytes: int = 0,
                image_command: bool = False) -> Process:
    req = proc.SpawnRequest(sandbox_id=sb.id, argv=None if argv is None else list(argv), image_command=image_command,
                            env=env or {}, cwd=cwd, stdin=stdin, timeout_s=timeout_s, buffer_bytes=buffer_bytes)
    try:
        info = await sb._fleet.bus.request(sb._subject(proc.SPAWN), req, proc.ProcessInfo, timeout=30)
    except errors.SandfleetError as exc:
        raise await ended_or(sb, exc) from None
    return Process(sb, info.pid, info)


async def processes(sb: Sandbox) -> list[proc.ProcessInfo]:
    try:
        reply = await sb._fleet.bus.request(sb._subject(proc.LIST), proc.ListRequest(sandbox_id=sb.id),
                                            proc.ListReply, timeout=30)
    except errors.SandfleetError as exc:
        raise await ended_or(sb, exc) from None
    return reply.processes


async def _call(callback: OutputCallback | None, data: bytes) -> None:
    if callback is not None:
        result = callback(data)
        if inspect.isawaitable(result):
            await result


async def streamed_exec(sb: Sandbox, argv: list[str] | None, *, timeout_s: float, env: dict[str, str] | None,
                        cwd: str, stdin: bytes, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                        image_command: bool = False) -> node.ExecReply:
    """exec with each chunk handed to its callback as the command writes it: a background
    process read until it ends, the node killing it at `timeout_s`; the whole result at the
    end, each stream capped at MAX_OUTPUT_BYTES as a plain exec's."""
    started = time.perf_counter()
    process = await spawn(sb, argv, env=env, cwd=cwd, stdin=bool(stdin), timeout_s=timeout_s,
                          buffer_bytes=STREAMED_BUFFER_BYTES, image_command=image_command)
    if stdin:
        with contextlib.suppress(errors.Conflict):  # it ended (or closed stdin) without reading it all
            await process.send_stdin(stdin)
            await process.close_stdin()
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = False
    async for out in process.output():
        truncated = truncated or out.dropped > 0
        buf = kept[out.stream]
        room = node.MAX_OUTPUT_BYTES - len(buf)
        truncated = truncated or len(out.data) > room
        buf += out.data[:max(0, room)]
        if out.data:
            await _call(on_stdout if out.stream == "stdout" else on_stderr, out.data)
    exit = process.exit or await process.wait()
    return node.ExecReply(exit_code=exit.exit_code, stdout=bytes(kept["stdout"]), stderr=bytes(kept["stderr"]),
                          timed_out=exit.timed_out, truncated=truncated,
                          duration_ms=(time.perf_counter() - started) * 1000)

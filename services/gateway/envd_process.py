"""envd's process service (`process.Process`, Connect RPC) on sandfleet's background processes:
`Start` spawns and streams, `Connect` re-attaches, input, signals and listing by pid. Messages
and the service's shape are the `e2b` package's generated modules; this is only the behaviour.

A stream's output is read by a task into a queue so that quiet stretches still send the
keepalive the SDK asks for (its `Keepalive-Ping-Interval` header), as envd does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from sandfleet import errors
from sandfleet._processes import Process
from services.gateway import shapes
from services.gateway.faults import connect_error
from services.gateway.sandboxes import Sandboxes

# The SDK runs every command as `/bin/bash -l -c CMD` (E2B's templates all have bash); a layer
# without bash (busybox, alpine) runs it with its /bin/sh instead of failing with 127.
SDK_SHELL = ["/bin/bash", "-l", "-c"]
BASH_OR_SH = 'if [ -x /bin/bash ]; then exec /bin/bash -l -c "$0"; else exec /bin/sh -c "$0"; fi'
SDK_TERMINAL = ["/bin/bash", "-i", "-l"]  # what `sandbox.pty.create` starts
BASH_OR_SH_TERMINAL = "if [ -x /bin/bash ]; then exec /bin/bash -i -l; else exec /bin/sh -i; fi"
KEEPALIVE_HEADER = "keepalive-ping-interval"
DEFAULT_KEEPALIVE_S = 50.0
_END = object()


def _event(**kind: Any) -> pb.ProcessEvent:
    (name, value), = kind.items()
    return pb.ProcessEvent(event=Oneof(name, value))


def end_event(exit: Any) -> pb.ProcessEvent:
    """How E2B reports an end: a signal's end is exit code -1 ("signal: killed"), as Go's os/exec."""
    if exit.signal:
        status = {9: "signal: killed", 15: "signal: terminated"}.get(exit.signal, f"signal: {exit.signal}")
        end = pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status)
    else:
        end = pb.ProcessEvent.EndEvent(exit_code=exit.exit_code, exited=True, status=f"exit status {exit.exit_code}")
    if exit.timed_out:
        end = pb.ProcessEvent.EndEvent(exit_code=end.exit_code, exited=end.exited, status=end.status,
                                       error="the command's timeout ended it")
    return _event(end=end)


def command_argv(cmd: str, args: list[str]) -> list[str]:
    if [cmd, *args[:2]] == SDK_SHELL and len(args) == 3:
        return ["/bin/sh", "-c", BASH_OR_SH, args[2]]
    if [cmd, *args] == SDK_TERMINAL:
        return ["/bin/sh", "-c", BASH_OR_SH_TERMINAL]
    return [cmd, *args]


def sdk_config(argv: list[str]) -> pb.ProcessConfig:
    """A process's command as the SDK started it (command_argv undone)."""
    if argv[:3] == ["/bin/sh", "-c", BASH_OR_SH] and len(argv) == 4:
        argv = [*SDK_SHELL, argv[3]]
    elif argv == ["/bin/sh", "-c", BASH_OR_SH_TERMINAL]:
        argv = SDK_TERMINAL
    return pb.ProcessConfig(cmd=argv[0] if argv else "", args=argv[1:])


def _keepalive_s(ctx: Any) -> float:
    try:
        return max(1.0, float(ctx.request_headers.get(KEEPALIVE_HEADER) or DEFAULT_KEEPALIVE_S))
    except ValueError:
        return DEFAULT_KEEPALIVE_S


async def follow(process: Process, offset: int, keepalive_s: float,
                 terminal: bool = False) -> AsyncIterator[pb.ProcessEvent]:
    """The process's output from `offset` as data events (a terminal's as `pty` data),
    keepalives while it is quiet, then its end."""
    queue: asyncio.Queue = asyncio.Queue(64)

    async def read() -> None:
        try:
            async for out in process.output(offset):
                if out.data:
                    await queue.put(out)
            await queue.put(_END)
        except Exception as exc:  # handed over, raised in the stream
            await queue.put(exc)

    reader = asyncio.create_task(read())
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), keepalive_s)
            except asyncio.TimeoutError:
                yield _event(keepalive=pb.ProcessEvent.KeepAlive())
                continue
            if item is _END:
                break
            if isinstance(item, Exception):
                raise item
            data = pb.ProcessEvent.DataEvent(output=Oneof("pty" if terminal else item.stream, item.data))
            yield _event(data=data)
        yield end_event(process.exit or await process.wait())
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def _pid(selector: pb.ProcessSelector | None) -> int:
    chosen = selector.selector if selector is not None else None
    if chosen is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "no process selected")
    if chosen.field != "pid":
        raise ConnectError(Code.NOT_FOUND, f"no process with tag {chosen.value!r}: processes are found by pid here")
    return int(chosen.value)


class ProcessService:
    """The `process.Process` service over the gateway's sandboxes."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self._sandboxes = sandboxes

    async def _sandbox(self, ctx: Any):  # type: ignore[no-untyped-def]
        headers = ctx.request_headers
        try:
            return await self._sandboxes.for_envd(headers.get("e2b-sandbox-id"), headers.get("x-access-token"))
        except Exception as exc:
            raise connect_error(exc) from None

    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        sb, envs = await self._sandbox(ctx)
        config = request.process or pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "no command")
        timeout_s = max(0.001, ctx.timeout_ms / 1000) if ctx.timeout_ms else None  # the SDK's whole-stream deadline
        argv, env = command_argv(config.cmd, list(config.args)), {**envs, **dict(config.envs)}
        try:
            cwd = shapes.sandbox_path(config.cwd) if config.has_field("cwd") and config.cwd else shapes.HOME
            if request.pty is not None:  # a terminal the node holds; its screen comes as `pty` data
                cols, rows = _size(request.pty)
                process = sb.process((await sb.pty(argv, cols=cols, rows=rows, env=env, cwd=cwd,
                                                   timeout_s=timeout_s)).pid)
            else:
                process = await sb.spawn(argv, env=env, cwd=cwd, stdin=bool(request.stdin), timeout_s=timeout_s)
        except Exception as exc:
            raise connect_error(exc) from None
        yield pb.StartResponse(event=_event(start=pb.ProcessEvent.StartEvent(pid=process.pid)))
        try:
            async for event in follow(process, 0, _keepalive_s(ctx), terminal=request.pty is not None):
                yield pb.StartResponse(event=event)
        except errors.SandfleetError as exc:
            raise connect_error(exc) from None

    async def connect(self, request: pb.ConnectRequest, ctx: Any) -> AsyncIterator[pb.ConnectResponse]:
        sb, _ = await self._sandbox(ctx)
        process = sb.process(_pid(request.process))
        try:
            info = await process.info()
        except Exception as exc:
            raise connect_error(exc) from None
        if info.exit is not None:  # envd forgets a process once it ended
            raise ConnectError(Code.NOT_FOUND, f"process with pid {process.pid} not found")
        yield pb.ConnectResponse(event=_event(start=pb.ProcessEvent.StartEvent(pid=process.pid)))
        try:
            async for event in follow(process, info.written, _keepalive_s(ctx)):
                yield pb.ConnectResponse(event=event)
        except errors.SandfleetError as exc:
            raise connect_error(exc) from None

    async def list(self, request: pb.ListRequest, ctx: Any) -> pb.ListResponse:
        sb, _ = await self._sandbox(ctx)
        try:
            found = await sb.processes()
        except Exception as exc:
            raise connect_error(exc) from None
        return pb.ListResponse(processes=[pb.ProcessInfo(pid=p.pid, config=sdk_config(p.argv))
                                          for p in found if p.exit is None])

    async def _on_process(self, ctx: Any, selector: pb.ProcessSelector | None, act) -> None:  # type: ignore[no-untyped-def]
        sb, _ = await self._sandbox(ctx)
        process = sb.process(_pid(selector))
        try:
            await act(process)
        except errors.Conflict as exc:
            if "has ended" in exc.message:  # envd forgets a process once it ended
                raise ConnectError(Code.NOT_FOUND, f"process with pid {process.pid} not found") from None
            raise connect_error(exc) from None
        except Exception as exc:
            raise connect_error(exc) from None

    async def send_input(self, request: pb.SendInputRequest, ctx: Any) -> pb.SendInputResponse:
        data = _stdin(request.input)
        await self._on_process(ctx, request.process, lambda p: p.send_stdin(data))
        return pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest], ctx: Any) -> pb.StreamInputResponse:
        selector = None
        async for message in request:
            event = message.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                selector = event.value.process
            elif selector is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "input before the start event naming the process")
            else:
                data = _stdin(event.value.input)
                await self._on_process(ctx, selector, lambda p: p.send_stdin(data))
        return pb.StreamInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any) -> pb.SendSignalResponse:
        signal = int(request.signal.value) if request.signal is not None else 0
        if signal not in (9, 15):
            raise ConnectError(Code.INVALID_ARGUMENT, "signal: SIGKILL or SIGTERM")
        await self._on_process(ctx, request.process, lambda p: p.signal(signal))
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Any) -> pb.CloseStdinResponse:
        await self._on_process(ctx, request.process, lambda p: p.close_stdin())
        return pb.CloseStdinResponse()

    async def update(self, request: pb.UpdateRequest, ctx: Any) -> pb.UpdateResponse:
        if request.pty is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "nothing to update: only a terminal's size can be")
        cols, rows = _size(request.pty)
        sb, _ = await self._sandbox(ctx)
        try:
            await sb.terminal(_pid(request.process)).resize(cols, rows)
        except Exception as exc:
            raise connect_error(exc) from None
        return pb.UpdateResponse()


def _size(pty: pb.PTY) -> tuple[int, int]:
    if pty.size is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "a terminal needs a size")
    return int(pty.size.cols), int(pty.size.rows)


def _stdin(input: pb.ProcessInput | None) -> bytes:
    """Keys for a terminal (`pty`) and stdin for a process are one stream here: a terminal's
    stdin is its keyboard."""
    chosen = input.input if input is not None else None
    if chosen is None or chosen.field not in ("stdin", "pty"):
        raise ConnectError(Code.INVALID_ARGUMENT, "no input")
    return bytes(chosen.value)

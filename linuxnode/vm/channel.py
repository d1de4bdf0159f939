"""The node's end of a guest agent's port (a unix socket QEMU serves for the virtserialport):
requests out, typed answers in (frames.py), and the rules that make a guest's word harmless.

A guest is trusted for nothing. Its answers must be one of the protocol's messages, for a
request or command the node made and still waits on, in an order that makes sense (output
only between `started` and `exited`); every request must be answered within `reply_timeout`.
The first breach ends the channel for good: `broken` says why, `on_broken(why)` is called once
(the driver kills the VM and fails the sandbox with that reason), and everything waiting on it
raises `GuestBroken`. A command's output is the command's business (as much as a process
sandbox's): it is handed on as it comes, each frame bounded, and what a caller keeps is the
caller's cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from linuxnode.vm import frames
from linuxnode.vm.frames import (Answer, Data, Done, Entries, Exited, Failed, GuestProtocolError, Hello, Output,
                                 PortAcked, PortClosed, PortData, PortEof, PortOpened, Pong, Started)
from linuxnode.vm.ports import GuestPort

REPLY_TIMEOUT_S = 30.0  # a request's answer: ms when quiet, seconds for a TCG guest on a loaded node


def _kind(answer: Answer) -> str:
    return str(answer.__struct_config__.tag)


class CommandFailed(OSError):
    """The agent could not start the command (no such program, not executable...)."""


class GuestBroken(Exception):
    """The guest broke the protocol, went silent or went away; the channel is closed."""


@dataclass
class GuestCommand:
    """A command the agent runs: its output and exit arrive through the callbacks."""

    id: int
    on_output: Callable[[int, bytes], None]
    on_exit: Callable[[int], None]
    pid: int = 0
    exited: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AgentChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_broken: Callable[[str], None], reply_timeout: float = REPLY_TIMEOUT_S) -> None:
        self._reader, self._writer = reader, writer
        self._on_broken = on_broken
        self.reply_timeout = reply_timeout
        self.broken = ""
        self._closing = False  # closed by the node: not the guest's doing
        # A channel to a guest an earlier launcher spoke to: until `reset` is answered, output
        # and exits of that launcher's commands may still arrive, and are dropped.
        self._resetting = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Answer]] = {}
        self._commands: dict[int, GuestCommand] = {}
        self._ports: dict[int, GuestPort] = {}  # forwarded connections (ports.py)
        # Cleared while a machine state is saved (quiesce): requests that would be answered wait.
        self.speaking = asyncio.Event()
        self.speaking.set()
        self._hello: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._frames = frames.FrameReader()
        self._pump = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, path: str, on_broken: Callable[[str], None], timeout: float = 10.0,
                      reply_timeout: float = REPLY_TIMEOUT_S) -> AgentChannel:
        """Connect to the socket QEMU serves (it appears a moment after QEMU starts)."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(path, limit=frames.MAX_FRAME)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(0.01)
        return cls(reader, writer, on_broken, reply_timeout)

    # -- reading --------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    raise GuestBroken("the guest's port closed (QEMU ended)")
                for answer in self._frames.feed(data):
                    self._dispatch(answer)
        except (GuestProtocolError, GuestBroken) as exc:
            self._break(str(exc))
        except (ConnectionError, OSError) as exc:
            self._break(f"the guest's port failed: {exc}")
        except asyncio.CancelledError:
            self._break("the channel was closed")
            raise
        except Exception as exc:  # a bug of ours: the channel still ends, and says so
            self._break(f"the node's reader failed: {type(exc).__name__}: {exc}")
            raise

    def _dispatch(self, answer: Answer) -> None:
        if isinstance(answer, Hello):
            if self._hello.done():
                raise GuestProtocolError("a second hello")
            self._hello.set_result(answer.release)
            return
        if isinstance(answer, (Output, Exited)):
            command = self._commands.get(answer.id)
            if command is None and self._resetting:
                return
            if command is None or not command.pid:
                raise GuestProtocolError(f"{_kind(answer)} for command {answer.id}, which is not running")
            if isinstance(answer, Output):
                command.on_output(answer.stream, answer.data)
            else:
                del self._commands[answer.id]
                command.exited.set_result(answer.status)
                command.on_exit(answer.status)
            return
        if isinstance(answer, (PortData, PortAcked, PortEof, PortClosed)):
            port = self._ports.get(answer.id)
            if port is None and self._resetting:
                return
            if port is None:
                raise GuestProtocolError(f"{_kind(answer)} for connection {answer.id}, which is not open")
            port.take(answer)
            if isinstance(answer, PortClosed):
                del self._ports[answer.id]
            return
        waiting = self._waiting.pop(answer.id, None)
        if waiting is None and self._resetting:
            return  # an answer to the earlier launcher
        if waiting is None:
            raise GuestProtocolError(f"{_kind(answer)} for request {answer.id}, which nobody asked")
        if isinstance(answer, Started) and answer.id in self._commands:
            self._commands[answer.id].pid = answer.pid  # before its output, which may be in this read
        waiting.set_result(answer)

    def _break(self, why: str) -> None:
        if self.broken:
            return
        self.broken = why
        with contextlib.suppress(Exception):
            self._writer.close()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(GuestBroken(why))
        self._waiting.clear()
        for command in self._commands.values():
            if not command.exited.done():
                command.exited.set_exception(GuestBroken(why))
                command.exited.exception()  # retrieved: nobody may be waiting on it
        self._commands.clear()
        for port in self._ports.values():
            port.broken(why)
        self._ports.clear()
        self.speaking.set()  # whoever waits to speak finds the channel broken
        if not self._hello.done():
            self._hello.set_exception(GuestBroken(why))
            self._hello.exception()
        if not self._closing:
            self._on_broken(why)

    # -- requests ---------------------------------------------------------------------------

    def _send(self, frame: bytes) -> None:
        if self.broken:
            raise GuestBroken(self.broken)
        self._writer.write(frame)

    async def _ask(self, request_id: int, frame: bytes, timeout: float | None = None, quiet_ok: bool = False) -> Answer:
        if not quiet_ok:
            await self.speaking.wait()
        waiting: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiting
        try:
            self._send(frame)
            async with asyncio.timeout(timeout or self.reply_timeout):
                return await asyncio.shield(waiting)
        except TimeoutError:
            self._waiting.pop(request_id, None)
            waiting.cancel()
            self._break(f"the guest agent did not answer in {timeout or self.reply_timeout:g} s")
            raise GuestBroken(self.broken) from None
        finally:
            self._waiting.pop(request_id, None)

    async def hello(self, timeout: float) -> str:
        """The release a cold-booted guest's agent greets with, once it runs."""
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._hello)
        except TimeoutError:
            self._break(f"the guest did not boot within {timeout:g} s")
            raise GuestBroken(self.broken) from None

    async def ping(self, timeout: float | None = None) -> str:
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.request(frames.Op.PING, request_id), timeout)
        if not isinstance(answer, Pong):
            raise self._lie(answer, "pong")
        return answer.release

    async def reset(self) -> int:
        """After a launcher restart: the guest kills what it ran for the old one; how many."""
        self._resetting = True
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.request(frames.Op.RESET, request_id))
        if not isinstance(answer, Done):
            raise self._lie(answer, "done")
        self._resetting = False
        return answer.count

    async def _done(self, op: frames.Op, quiet_ok: bool = False) -> int:
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.request(op, request_id), quiet_ok=quiet_ok)
        if not isinstance(answer, Done):
            raise self._lie(answer, "done")
        return answer.count

    async def quiesce(self) -> None:
        """The agent stops sending (its answer is its last frame): the port's stream stands at a
        frame's end while the machine's state is saved. Until `resume`, requests of the node that
        the agent would answer (and forwarded bytes it would acknowledge) wait."""
        self.speaking.clear()
        try:
            await self._done(frames.Op.QUIESCE, quiet_ok=True)
        except BaseException:
            self.speaking.set()
            raise

    async def resume(self) -> None:
        await self._done(frames.Op.RESUME, quiet_ok=True)
        self.speaking.set()

    async def detach(self) -> int:
        """In a machine restored from a saved running state: the commands of the node that saved
        it keep running for nobody; how many."""
        return await self._done(frames.Op.DETACH)

    async def setup(self, disk_mb: int) -> None:
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.setup_request(request_id, disk_mb))
        if isinstance(answer, Failed):
            raise OSError(answer.errno, f"the guest could not size its writable layer ({answer.what})")
        if not isinstance(answer, Done):
            raise self._lie(answer, "done")

    async def start(self, argv: list[str], env: dict[str, str], cwd: str,
                    on_output: Callable[[int, bytes], None], on_exit: Callable[[int], None],
                    terminal: tuple[int, int] | None = None) -> GuestCommand:
        """A command running in the guest (on a terminal of `terminal` (cols, rows)); OSError
        (its errno) if it could not start there."""
        request_id = next(self._ids)
        frame = frames.exec_request(request_id, argv, env, cwd, terminal)
        command = GuestCommand(request_id, on_output, on_exit)
        self._commands[request_id] = command  # its output may follow `started` in the same read
        try:
            answer = await self._ask(request_id, frame)
        except BaseException:
            self._commands.pop(request_id, None)
            raise
        if isinstance(answer, Failed):
            self._commands.pop(request_id, None)
            if answer.what == "chdir":
                raise OSError(answer.errno, f"chdir {cwd}")  # FileNotFoundError for ENOENT...
            raise CommandFailed(answer.errno, f"cannot run {argv[0]!r} in the guest")
        if not isinstance(answer, Started):
            raise self._lie(answer, "started")
        return command

    def stdin(self, command: GuestCommand, data: bytes) -> None:
        for at in range(0, len(data), frames.CHUNK):
            self._send(frames.request(frames.Op.STDIN, command.id, data[at:at + frames.CHUNK]))

    def close_stdin(self, command: GuestCommand) -> None:
        self._send(frames.request(frames.Op.CLOSE_STDIN, command.id))

    def signal(self, command: GuestCommand, number: int) -> None:
        self._send(frames.signal_request(command.id, number))

    def resize(self, command: GuestCommand, cols: int, rows: int) -> None:
        self._send(frames.request(frames.Op.RESIZE, command.id, frames.window(cols, rows)))

    async def write_file(self, path: str, data: bytes, mode: int, append: bool = False) -> int:
        """The file made (mode applied) or truncated, or with `append` added to, with `data`."""
        written, step = 0, frames.MAX_READ
        for at in range(0, max(len(data), 1), step):
            request_id = next(self._ids)
            answer = await self._ask(request_id, frames.write_request(request_id, path, data[at:at + step], mode,
                                                                      append=append or at > 0))
            if isinstance(answer, Failed):
                raise OSError(answer.errno, f"{answer.what}: {path}")
            if not isinstance(answer, Done) or answer.count != len(data[at:at + step]):
                raise self._lie(answer, "done")
            written += answer.count
        return written

    async def read_at(self, path: str, offset: int, count: int) -> tuple[bytes, bool]:
        """At most `count` bytes (up to MAX_READ) of the file from `offset`, and whether that was its end."""
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.read_request(request_id, path, offset, count))
        if isinstance(answer, Failed):
            raise OSError(answer.errno, f"{answer.what}: {path}")
        if not isinstance(answer, Data) or len(answer.data) > min(count, frames.MAX_READ):
            raise self._lie(answer, "data")
        return answer.data, answer.eof

    async def file_tree(self, op: frames.FsOp, *fields: int | str) -> Entries | None:
        """One operation on the sandbox's tree (frames.fs_request): the entries of a stat or a
        listing, None for a change; OSError with the guest's errno when it failed."""
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.fs_request(request_id, op, *fields))
        if isinstance(answer, Failed):
            raise OSError(answer.errno, os.strerror(answer.errno), answer.what)
        listing = op in (frames.FsOp.STAT, frames.FsOp.LIST)
        if not isinstance(answer, Entries if listing else Done) or (op == frames.FsOp.STAT and len(answer.entries) != 1):
            raise self._lie(answer, "entries" if listing else "done")
        return answer if isinstance(answer, Entries) else None

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        """The file's first `max_bytes` bytes; ValueError when it is longer."""
        out = bytearray()
        while True:
            request_id = next(self._ids)
            want = min(frames.MAX_READ, max_bytes + 1 - len(out))
            answer = await self._ask(request_id, frames.read_request(request_id, path, len(out), want))
            if isinstance(answer, Failed):
                raise OSError(answer.errno, f"{answer.what}: {path}")
            if not isinstance(answer, Data) or len(answer.data) > want:
                raise self._lie(answer, "data")
            out += answer.data
            if len(out) > max_bytes:
                raise ValueError(f"larger than {max_bytes} bytes")
            if answer.eof:
                return bytes(out)

    # -- port forwards (ports.py) ---------------------------------------------------------------

    async def open_port(self, ipv6: bool, port: int) -> GuestPort:
        """A connection the agent opened to the guest's loopback at `port`; ConnectionRefusedError
        (or another OSError of the guest's connect) when it could not."""
        request_id = next(self._ids)
        opened = GuestPort(request_id)
        self._ports[request_id] = opened  # its data may follow `opened` in the same read
        try:
            answer = await self._ask(request_id, frames.port_open_request(request_id, ipv6, port))
        except BaseException:
            self._ports.pop(request_id, None)
            raise
        if isinstance(answer, Failed):
            self._ports.pop(request_id, None)
            raise OSError(answer.errno, f"{answer.what} to port {port} in the guest")
        if not isinstance(answer, PortOpened):
            raise self._lie(answer, "opened")
        return opened

    def send_port(self, frame: bytes) -> None:
        self._send(frame)

    async def close_port(self, port: GuestPort) -> None:
        """Close the guest's end and wait for its `pclosed` (a guest that never sends it is silent)."""
        if self.broken or port.id not in self._ports or port.closing:
            return
        port.closing = True
        self._send(frames.request(frames.Op.PORT_CLOSE, port.id))
        try:
            async with asyncio.timeout(self.reply_timeout):
                await asyncio.shield(port.closed)
        except TimeoutError:
            self._break(f"the guest agent did not close connection {port.id} in {self.reply_timeout:g} s")

    async def port_listens(self, ipv6: bool, port: int) -> bool:
        request_id = next(self._ids)
        answer = await self._ask(request_id, frames.port_listens_request(request_id, ipv6, port))
        if isinstance(answer, Failed):
            raise OSError(answer.errno, f"{answer.what} in the guest")
        if not isinstance(answer, Done) or answer.count > 1:
            raise self._lie(answer, "done")
        return bool(answer.count)

    def fail(self, why: str) -> GuestBroken:
        """The node found the guest wanting (a killed command that never ended): cut it off."""
        self._break(why)
        return GuestBroken(self.broken)

    def _lie(self, answer: Answer, expected: str) -> GuestBroken:
        self._break(f"the guest answered {_kind(answer)} where {expected} was due")
        return GuestBroken(self.broken)

    def close(self) -> None:
        self._closing = True
        self._pump.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()

"""One end of one port-forward tunnel: a TCP stream on one side, the bus on the other.

Both ends are this code — the client's (a connection accepted by `sb.forward`, sandfleet/_ports.py)
and the node's (the launcher's socket inside the sandbox, services/launcher/tunnels.py) — since
the protocol (schemas/ports.py) is symmetric: each numbers its frames, sends no more than its
peer's credit, returns credit for what it wrote, half-closes with FIN, pings when quiet and resets
a tunnel it has not heard from.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from schemas import ports
from schemas.ports import MAX_DATA, BadFrame, Frame, Reset

log = logging.getLogger("sandfleet.ports")


class TunnelEnd:
    """One end of one tunnel. `feed` takes the peer's frames (a plain function, called as the bus
    delivers them); `run` moves bytes both ways until both directions are closed or the tunnel is
    reset, and returns the reset reason (None for a clean close)."""

    def __init__(self, nc: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send_subject: str, *,
                 window: int, keepalive_s: float, idle_s: float) -> None:
        self._nc, self._reader, self._writer, self._to = nc, reader, writer, send_subject
        self.window, self._keepalive_s, self._idle_s = window, keepalive_s, idle_s
        self._credit = window  # data bytes we may still send before the peer returns credit
        self._credit_ready = asyncio.Event()
        self._inbound: collections.deque[bytes | None] = collections.deque()  # None: the peer's FIN
        self._inbound_ready = asyncio.Event()
        self.buffered = 0  # the peer's bytes held here, not yet written to our socket (<= window)
        self._unreturned = 0  # bytes written to our socket whose credit the peer has not had back
        self._sent_seq = self._heard_seq = 0
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self._heard = self._sent = loop.time()
        self._ended = asyncio.Event()
        self.reset: Reset | None = None
        self._tell_peer = False

    # -- from the bus ----------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if self._ended.is_set():
            return
        self._heard = self._clock()
        try:
            kind, seq, value, body = ports.parse(data)
        except BadFrame:
            return self.abort(Reset.PROTOCOL)
        if seq != self._heard_seq + 1:  # a frame lost or replayed: the stream has a hole
            return self.abort(Reset.PROTOCOL)
        self._heard_seq = seq
        if kind is Frame.DATA:
            if self.buffered + len(body) > self.window:  # a peer ignoring its credit
                return self.abort(Reset.PROTOCOL)
            self.buffered += len(body)
            self._inbound.append(body)
            self._inbound_ready.set()
        elif kind is Frame.CREDIT:
            self._credit += value
            self._credit_ready.set()
        elif kind is Frame.FIN:
            self._inbound.append(None)
            self._inbound_ready.set()
        elif kind is Frame.RST:
            self._end(Reset(value) if value in Reset._value2member_map_ else Reset.PROTOCOL, tell_peer=False)

    def abort(self, reason: Reset) -> None:
        """Reset the tunnel (telling the peer); `run` tears the socket down."""
        self._end(reason, tell_peer=True)

    def _end(self, reason: Reset | None, tell_peer: bool) -> None:
        if not self._ended.is_set():
            self.reset, self._tell_peer = reason, tell_peer
            self._ended.set()

    # -- both directions -------------------------------------------------------------------

    async def run(self) -> Reset | None:
        tasks = [asyncio.create_task(self._guarded(self._socket_to_bus)),
                 asyncio.create_task(self._guarded(self._bus_to_socket))]
        both = asyncio.gather(*tasks)
        both.add_done_callback(lambda _: self._end(None, tell_peer=False))
        keepalive = asyncio.create_task(self._guarded(self._keepalive))
        try:
            await self._ended.wait()
        finally:
            for task in (*tasks, keepalive):
                task.cancel()
            await asyncio.gather(both, keepalive, return_exceptions=True)
            if self.reset is not None and self._tell_peer:
                with contextlib.suppress(Exception):
                    await self._send(Frame.RST, int(self.reset))
            if self.reset is not None:
                self._writer.transport.abort()  # the socket's peer sees a reset, not a clean end
            else:
                self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        return self.reset

    async def _guarded(self, pump: Callable[[], Awaitable[None]]) -> None:
        try:
            await pump()  # made here, so a task cancelled before it starts leaves no coroutine unawaited
        except (ConnectionError, OSError):  # our socket's peer went away abruptly
            self.abort(Reset.CLOSED)
        except Exception:  # the bus failed under us (closed, say): never taken for a clean close
            log.exception("tunnel to %s failed", self._to)
            self.abort(Reset.CLOSED)

    async def _socket_to_bus(self) -> None:
        while True:
            while self._credit <= 0:
                self._credit_ready.clear()
                await self._credit_ready.wait()
            data = await self._reader.read(min(self._credit, MAX_DATA))
            if not data:
                await self._send(Frame.FIN)
                return
            self._credit -= len(data)
            await self._send(Frame.DATA, body=data)

    async def _bus_to_socket(self) -> None:
        while True:
            while not self._inbound:
                self._inbound_ready.clear()
                await self._inbound_ready.wait()
            written, fin = 0, False
            while self._inbound:  # everything that came meanwhile, then one drain and one credit
                chunk = self._inbound.popleft()
                if chunk is None:
                    fin = True
                    break
                self._writer.write(chunk)
                written += len(chunk)
            if written:
                await self._writer.drain()
                self.buffered -= written
                # Credit goes back a quarter window at a time, not per frame: a small request and
                # its answer then cost one frame each way, and a peer that has sent a whole window
                # always gets some back (a quarter of it is written by then), so none waits forever.
                self._unreturned += written
                if self._unreturned >= self.window // 4:
                    await self._send(Frame.CREDIT, self._unreturned)
                    self._unreturned = 0
            if fin:
                if self._writer.can_write_eof():
                    self._writer.write_eof()
                return

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self._keepalive_s / 2)
            now = self._clock()
            if now - self._heard > self._idle_s:
                self.abort(Reset.IDLE)
                return
            if now - self._sent >= self._keepalive_s:
                await self._send(Frame.PING)

    async def _send(self, kind: Frame, value: int = 0, body: bytes = b"") -> None:
        # Numbered and handed to the connection in one step (nats-py queues it before it awaits),
        # so frames of the two pumps leave in the order of their numbers.
        self._sent_seq += 1
        self._sent = self._clock()
        await self._nc.publish(self._to, ports.frame(kind, self._sent_seq, value, body))

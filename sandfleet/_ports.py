"""Port forwarding: `async with sb.forward(8000) as (host, port)` listens on the client's
loopback and carries each connection to port 8000 of the sandbox over the bus (schemas/ports.py
has the protocol and why it is shaped so).

Each accepted connection is one `sandfleet.tunnel.TunnelEnd`, the same code as the node's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import TYPE_CHECKING, Any

from sandfleet import errors
from sandfleet.tunnel import TunnelEnd
from schemas import node, ports
from schemas.ports import Reset

if TYPE_CHECKING:
    from sandfleet._sandbox import Sandbox

log = logging.getLogger("sandfleet.ports")


class PortRefused(errors.Conflict):
    """Nobody listens on that port inside the sandbox: the forward's connection was refused."""


class Forward:
    """A local listener whose connections each open a tunnel to one port of one sandbox."""

    def __init__(self, sandbox: Sandbox, port: int, *, local_port: int = 0, host: str = "127.0.0.1",
                 open_timeout_s: float = 10.0) -> None:
        self._sandbox, self.port, self._local_port, self._host = sandbox, port, local_port, host
        self._open_timeout_s = open_timeout_s
        self._bus = sandbox._fleet.bus
        self._inbox = self._bus.nc.new_inbox()
        self._ends: dict[str, TunnelEnd] = {}
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self._sub: Any = None
        self._closing = False
        self.address: tuple[str, int] = ("127.0.0.1", 0)

    async def __aenter__(self) -> tuple[str, int]:
        # The node is asked first whether anything listens (it connects nothing to tell), so a
        # closed port is an error here, at `forward()`, not a reset found on a first connection.
        # A tenant's frames come under its own prefix (schemas/ports.py frames_subject).
        frames = ports.frames_subject(await self._sandbox._fleet.tenant(), self._inbox)
        self._sub = await self._bus.subscribe_direct(f"{frames}.*", self._deliver)
        try:
            await self._ask(probe=True)
            self._server = await asyncio.start_server(self._accepted, "127.0.0.1", self._local_port)
        except BaseException:
            await self._sub.unsubscribe()
            raise
        self.address = self._server.sockets[0].getsockname()[:2]
        return self.address

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for end in list(self._ends.values()):
            end.abort(Reset.CLOSED)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def _deliver(self, msg: Any) -> None:
        conn = msg.subject.rsplit(".", 1)[1]
        end = self._ends.get(conn)
        if end is not None:
            end.feed(msg.data)

    async def _ask(self, conn: str = "probe", probe: bool = False) -> ports.TunnelOpened | ports.PortListening:
        sb = self._sandbox
        subject = node.subject(sb.node, ports.PORT_OPEN)
        req = ports.PortOpenRequest(sandbox_id=sb.id, port=self.port, host=self._host,  # type: ignore[arg-type]
                                    reply_subject=f"{self._inbox}.{conn}", probe=probe)
        reply = await self._bus.request(subject, req, ports.PortOpenReply, timeout=self._open_timeout_s)
        if isinstance(reply, ports.PortRefused):
            raise PortRefused(reply.message, subject=subject)
        if isinstance(reply, ports.PortListening) != probe:
            raise errors.InternalError(f"a {type(reply).__name__} answer to a {'probe' if probe else 'tunnel'}",
                                       subject=subject)
        return reply

    async def open(self) -> tuple[_Opening, ports.TunnelOpened]:
        """Ask the node for a tunnel; PortRefused if nobody listens on the port."""
        conn = secrets.token_hex(8)
        opening = _Opening(self, conn)
        self._ends[conn] = opening  # type: ignore[assignment]  # frames may come before the reply
        try:
            reply = await self._ask(conn)
        except BaseException:
            self._ends.pop(conn, None)
            raise
        assert isinstance(reply, ports.TunnelOpened)
        opening.opened = reply
        return opening, reply

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                opening, opened = await self.open()
            except errors.SandfleetError as exc:
                log.warning("forward to port %d of %s: %s", self.port, self._sandbox.id, exc)
                writer.transport.abort()
                return
            end = opening.become(reader, writer)
            if self._closing:  # opened while the forward was closing: reset at once, never left running
                end.abort(Reset.CLOSED)
            await end.run()
        finally:
            self._tasks.discard(task)


class _Opening:
    """A tunnel asked for and not yet running: it keeps the node's first frames (the server may
    speak first) until the connection's `TunnelEnd` takes them."""

    def __init__(self, forward: Forward, conn: str) -> None:
        self._forward, self._conn = forward, conn
        self._early: list[bytes] = []
        self.opened: ports.TunnelOpened | None = None

    def feed(self, data: bytes) -> None:
        if len(self._early) < 64:  # a node that floods before we answer gets reset by the sequence check
            self._early.append(data)

    def abort(self, reason: Reset) -> None:
        self._forward._ends.pop(self._conn, None)

    def become(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> TunnelEnd:
        opened = self.opened
        assert opened is not None
        end = TunnelEnd(self._forward._bus.nc, reader, writer, opened.send_subject, window=opened.window,
                        keepalive_s=opened.keepalive_s, idle_s=opened.idle_s)
        self._forward._ends[self._conn] = end
        for data in self._early:
            end.feed(data)
        return end


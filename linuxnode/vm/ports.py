"""Port forwards into a microVM: a TCP connection the guest agent opens to the guest's own
loopback, carried over the agent's port (frames.py PORT_*) and handed to the node as one end of
a socket pair, so the launcher's tunnels treat it as any sandbox's socket.

The node keeps each connection's books and holds the guest to them: data only on a connection
the node opened and before the guest said it ended (`peof`), never more than PORT_WINDOW bytes
the node has not acknowledged, acknowledgements only of what the node sent, `pclosed` only as
the answer to the node's close. Anything else is a GuestProtocolError, which ends the channel
and the VM (channel.py). The node, in turn, sends at most a window the guest has not yet
acknowledged, so neither side buffers more than a window per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING

from linuxnode.vm import frames
from linuxnode.vm.frames import GuestProtocolError, PortAcked, PortClosed, PortData, PortEof

if TYPE_CHECKING:
    from linuxnode.vm.channel import AgentChannel


class GuestPort:
    """One forwarded connection as the node sees it."""

    def __init__(self, port_id: int) -> None:
        self.id = port_id
        self.inbound: asyncio.Queue[bytes | None] = asyncio.Queue()  # the guest's bytes; None: its end
        self.unacked_in = 0  # the guest's bytes the node has not acknowledged
        self.unacked_out = 0  # the node's bytes the guest has not acknowledged
        self.room = asyncio.Event()
        self.room.set()
        self.guest_ended = False
        self.closing = False  # the node sent PORT_CLOSE
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def take(self, answer: PortData | PortAcked | PortEof | PortClosed) -> None:
        """An answer of the guest's for this connection, checked against the books."""
        if isinstance(answer, PortData):
            if self.guest_ended:
                raise GuestProtocolError(f"data on connection {self.id} after its end")
            if self.unacked_in + len(answer.data) > frames.PORT_WINDOW:
                raise GuestProtocolError(f"connection {self.id} sent past its window")
            self.unacked_in += len(answer.data)
            if not self.closing:  # else dropped: nobody reads it any more
                self.inbound.put_nowait(answer.data)
        elif isinstance(answer, PortAcked):
            if answer.count > self.unacked_out:
                raise GuestProtocolError(f"connection {self.id} acknowledged bytes it was never sent")
            self.unacked_out -= answer.count
            self.room.set()
        elif isinstance(answer, PortEof):
            if self.guest_ended:
                raise GuestProtocolError(f"connection {self.id} ended twice")
            self.guest_ended = True
            self.inbound.put_nowait(None)
        else:
            if not self.closing:
                raise GuestProtocolError(f"connection {self.id} closed where the node did not close it")
            if not self.closed.done():
                self.closed.set_result(None)

    def broken(self, why: str) -> None:
        """The channel ended: everything waiting on this connection stops."""
        self.inbound.put_nowait(None)
        self.room.set()
        if not self.closed.done():
            self.closed.set_result(None)


async def forward(channel: AgentChannel, port: GuestPort, end: socket.socket) -> None:
    """Carry bytes between `end` (our half of the pair the launcher holds the other of) and the
    guest's connection until both sides have ended or either fails; then close both."""
    reader, writer = await asyncio.open_unix_connection(sock=end, limit=frames.CHUNK)

    async def to_guest() -> None:
        while True:
            while port.unacked_out >= frames.PORT_WINDOW and not channel.broken:
                port.room.clear()
                await port.room.wait()
            data = await reader.read(min(frames.CHUNK, frames.PORT_WINDOW - port.unacked_out))
            await channel.speaking.wait()  # the agent acknowledges data: not while a state is saved
            if channel.broken:
                return
            if not data:
                channel.send_port(frames.request(frames.Op.PORT_EOF, port.id))
                return
            port.unacked_out += len(data)
            channel.send_port(frames.request(frames.Op.PORT_DATA, port.id, data))

    async def to_host() -> None:
        while (data := await port.inbound.get()) is not None:
            writer.write(data)
            await writer.drain()
            port.unacked_in -= len(data)
            await channel.speaking.wait()
            if not channel.broken:
                channel.send_port(frames.port_ack_request(port.id, len(data)))
        if writer.can_write_eof():
            writer.write_eof()

    pumps = [asyncio.ensure_future(to_guest()), asyncio.ensure_future(to_host())]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        with contextlib.suppress(Exception):
            await channel.close_port(port)
        writer.close()


def make_pair() -> tuple[socket.socket, socket.socket]:
    """(the launcher's end, ours), both non-blocking."""
    theirs, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    ours.setblocking(False)
    return theirs, ours


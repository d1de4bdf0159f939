"""The node's end of port-forward tunnels (schemas/ports.py): opening one into a sandbox's own
port, carrying its frames, and ending them all when their sandbox ends.

A tunnel's socket is made by the sandbox's driver inside the sandbox's network namespace, so it
reaches that sandbox's ports and nothing else. Frames for every tunnel of the node come on one
wildcard subscription and go to their tunnel by its id; a tunnel ends on close, reset, idleness
(a vanished client) or with its sandbox (a hook the launcher runs before it stops a sandbox).
Open tunnels are bounded per node (settings.max_tunnels), each holding at most a window of
bytes per direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from sandfleet.tunnel import TunnelEnd
from sandfleet.bus import CALLER_TENANT, Bus, Endpoint
from sandfleet.errors import ServiceError
from schemas import node, ports
from schemas.errors import ErrorCode
from schemas.ports import PortListening, PortOpenReply, PortOpenRequest, PortRefused, Reset, TunnelOpened
from services.launcher.driver_errors import DRIVER_ERRORS, service_error, translated
from services.launcher.keys import LOGGER, tag
from services.launcher.lifecycle import Launcher
from services.launcher.state import Live

log = logging.getLogger(LOGGER)


@dataclass
class Tunnel:
    id: str
    sandbox_id: str
    port: int
    end: TunnelEnd
    task: asyncio.Task | None = None


NAME = "tunnels"  # its key in Live.attached


@dataclass
class Tunnels:
    """Every tunnel this node's launcher holds."""

    bus: Bus
    launcher: Launcher
    by_id: dict[str, Tunnel] = field(default_factory=dict)
    by_sandbox: dict[str, set[str]] = field(default_factory=dict)
    opening: int = 0  # connects under way (counted against the limit too)
    _sub: Any = None

    async def listen(self) -> None:
        self._sub = await self.bus.subscribe_direct(ports.tunnel_wildcard(self.launcher.node_id), self._deliver)

    def _deliver(self, msg: Any) -> None:
        tunnel = self.by_id.get(msg.subject.rsplit(".", 1)[1])
        if tunnel is not None:  # else a tunnel already gone (its last frames in flight) or made up
            tunnel.end.feed(msg.data)

    async def open(self, req: PortOpenRequest) -> PortOpenReply:
        launcher, settings = self.launcher, self.launcher.settings
        live = launcher.get_live(req.sandbox_id)
        if live.quarantined or live.paused:
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is frozen: resume it first")
        if req.probe:
            return await self._probe(live, req)
        if len(self.by_id) + self.opening >= settings.max_tunnels:
            raise ServiceError(ErrorCode.CAPACITY,
                               f"node {launcher.node_id} holds its maximum of {settings.max_tunnels} tunnels")
        self.opening += 1
        try:
            sock = await live.driver.connect_port(live.instance, req.host, req.port)
        except ConnectionRefusedError:
            return _refused(req)
        except DRIVER_ERRORS as exc:
            raise service_error(exc, f"port {req.port} of {req.sandbox_id}", path=False) from None
        finally:
            self.opening -= 1
        if live.ending:  # destroyed while we connected: its hook has run already
            sock.close()
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {req.sandbox_id} is being destroyed")
        reader, writer = await asyncio.open_connection(sock=sock)
        tunnel = Tunnel(id=secrets.token_hex(8), sandbox_id=req.sandbox_id, port=req.port,
                        end=TunnelEnd(self.bus.nc, reader, writer, ports.frames_subject(CALLER_TENANT.get(),
                                                                                        req.reply_subject),
                                      window=settings.tunnel_window_bytes, keepalive_s=settings.tunnel_keepalive_s,
                                      idle_s=settings.tunnel_idle_s))
        self.by_id[tunnel.id] = tunnel
        self.by_sandbox.setdefault(req.sandbox_id, set()).add(tunnel.id)
        live.attached.setdefault(NAME, _OfSandbox(self, req.sandbox_id))  # ended with the sandbox
        tunnel.task = asyncio.create_task(self._run(tunnel))
        return TunnelOpened(tunnel_id=tunnel.id, send_subject=ports.tunnel_subject(launcher.node_id, tunnel.id),
                            window=settings.tunnel_window_bytes, keepalive_s=settings.tunnel_keepalive_s,
                            idle_s=settings.tunnel_idle_s)

    async def _probe(self, live: Live, req: PortOpenRequest) -> PortOpenReply:
        with translated(f"port {req.port} of {req.sandbox_id}", path=False):
            listens = await live.driver.port_listens(live.instance, req.host, req.port)
        return PortListening(port=req.port) if listens else _refused(req)

    async def _run(self, tunnel: Tunnel) -> None:
        try:
            reason = await tunnel.end.run()
            if reason not in (None, Reset.CLOSED, Reset.SANDBOX_ENDED):
                log.info("tunnel %s to port %d of %s reset: %s", tunnel.id, tunnel.port, tunnel.sandbox_id,
                         reason.name.lower() if reason is not None else "")
        finally:
            self.by_id.pop(tunnel.id, None)
            ids = self.by_sandbox.get(tunnel.sandbox_id)
            if ids is not None:
                ids.discard(tunnel.id)
                if not ids:
                    del self.by_sandbox[tunnel.sandbox_id]

    def of(self, sandbox_id: str) -> list[Tunnel]:
        return [self.by_id[i] for i in self.by_sandbox.get(sandbox_id, ()) if i in self.by_id]

    async def end_sandbox(self, sandbox_id: str) -> None:
        """Reset every tunnel of the sandbox and wait until their sockets are closed."""
        tunnels = self.of(sandbox_id)
        for tunnel in tunnels:
            tunnel.end.abort(Reset.SANDBOX_ENDED)
        await asyncio.gather(*(t.task for t in tunnels if t.task is not None), return_exceptions=True)

    async def close(self) -> None:
        for sandbox_id in list(self.by_sandbox):
            await self.end_sandbox(sandbox_id)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


def _refused(req: PortOpenRequest) -> PortRefused:
    return PortRefused(port=req.port, message=f"connection refused: nothing listens on {req.host}:{req.port} "
                                              f"in sandbox {req.sandbox_id}")


async def port_open(tunnels: Tunnels, req: PortOpenRequest) -> PortOpenReply:
    tag(tunnels.launcher.node_id, req.sandbox_id)
    return await tunnels.open(req)


def endpoints(tunnels: Tunnels) -> list[Endpoint]:
    return [Endpoint("port_open", node.subject(tunnels.launcher.node_id, ports.PORT_OPEN), PortOpenRequest,
                     functools.partial(port_open, tunnels))]


@dataclass(frozen=True)
class _OfSandbox:
    """What a sandbox's live entry holds of the node-wide table: its end resets its tunnels."""

    tunnels: Tunnels
    sandbox_id: str

    async def end(self) -> None:
        await self.tunnels.end_sandbox(self.sandbox_id)

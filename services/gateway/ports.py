"""E2B's port proxy: an HTTP request whose Host is `<port>-<sandbox id>.<domain>` (what the SDK's
`get_host(port)` gives) goes to that port inside that sandbox, through a sandfleet port forward
(sandfleet/_ports.py: a loopback listener whose connections are tunnelled over the bus).

Forwards are kept per (sandbox, port) for the next request, up to MAX_FORWARDS; one that fails
(its sandbox ended, its tunnel reset) is closed and opened again once. A websocket upgrade is
relayed message by message to a websocket opened to the same port (`websocket`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sandfleet import errors
from sandfleet._ports import Forward, PortRefused
from services.gateway.faults import SandboxGone, http_status, message_of
from services.gateway.sandboxes import Sandboxes

log = logging.getLogger("sandfleet.gateway")
MAX_FORWARDS = 256
# Hop-by-hop headers (RFC 9110 §7.6.1) are the proxy's own, never passed along.
HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "transfer-encoding", "upgrade", "content-length"})
# A websocket's own handshake headers: the upstream handshake makes its own.
WS_OWN = HOP | {"host", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                "sec-websocket-protocol"}


def _proxy_error(sandbox_id: str, port: int, message: str, code: int = 502) -> JSONResponse:
    return JSONResponse({"sandboxId": sandbox_id, "port": port, "message": message, "code": code}, status_code=code)


class PortProxy:
    def __init__(self, sandboxes: Sandboxes) -> None:
        self._sandboxes = sandboxes
        self._forwards: OrderedDict[tuple[str, int], Forward] = OrderedDict()
        self._lock = asyncio.Lock()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), follow_redirects=False)

    async def close(self) -> None:
        for forward in list(self._forwards.values()):
            with contextlib.suppress(Exception):
                await forward.close()
        self._forwards.clear()
        await self._client.aclose()

    async def _forward(self, sandbox_id: str, port: int) -> tuple[str, int]:
        key = (sandbox_id, port)
        async with self._lock:
            forward = self._forwards.get(key)
            if forward is not None:
                self._forwards.move_to_end(key)
                return forward.address
            sb = await self._sandboxes.live(sandbox_id)
            forward = sb.forward(port)
            address = await forward.__aenter__()
            self._forwards[key] = forward
            while len(self._forwards) > MAX_FORWARDS:
                _, oldest = self._forwards.popitem(last=False)
                asyncio.ensure_future(oldest.close())
            return address

    async def _drop(self, sandbox_id: str, port: int) -> None:
        forward = self._forwards.pop((sandbox_id, port), None)
        if forward is not None:
            with contextlib.suppress(Exception):
                await forward.close()

    async def __call__(self, request: Request, port: int, sandbox_id: str) -> Response:
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        for attempt in (1, 2):
            try:
                host, local = await self._forward(sandbox_id, port)
            except PortRefused:
                return _proxy_error(sandbox_id, port, f"The sandbox {sandbox_id} is running but port is not open")
            except SandboxGone as exc:
                return _proxy_error(sandbox_id, port, message_of(exc))
            except errors.SandfleetError as exc:
                return _proxy_error(sandbox_id, port, message_of(exc), http_status(exc))
            try:
                upstream = await self._client.send(
                    self._client.build_request(request.method, f"http://{host}:{local}{target}", headers=headers,
                                               content=body), stream=True)
            except httpx.TransportError as exc:
                await self._drop(sandbox_id, port)
                if attempt == 2:
                    return _proxy_error(sandbox_id, port, f"the connection to port {port} failed: {exc}")
                continue
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
            return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out,
                                     background=_Close(upstream))
        raise AssertionError("unreachable")


    async def websocket(self, scope: dict, receive, send, port: int, sandbox_id: str) -> None:  # type: ignore[no-untyped-def]
        """Relay a websocket to the sandbox's port: accepted only once the sandbox's server has
        accepted (with the subprotocol it chose), closed as the other side closes."""
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            host, local = await self._forward(sandbox_id, port)
            target = scope["path"] + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", [])
                       if k.decode("latin-1").lower() not in WS_OWN]
            upstream = await ws_connect(f"ws://{host}:{local}{target}", subprotocols=scope.get("subprotocols") or None,
                                        additional_headers=headers, proxy=None, compression=None, max_size=None,
                                        ping_interval=None, user_agent_header=None)
        except Exception as exc:  # refused, gone, or not a websocket server: the handshake fails
            log.info("websocket to port %d of %s refused: %s", port, sandbox_id, exc)
            await send({"type": "websocket.close", "code": 1011})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        async def inbound() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes")
                await upstream.send(data if data is not None else message.get("text") or "")

        async def outbound() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for data in upstream:
                    kind = "bytes" if isinstance(data, bytes) else "text"
                    await send({"type": "websocket.send", kind: data})
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": upstream.close_code or 1000})

        relays = [asyncio.create_task(inbound()), asyncio.create_task(outbound())]
        try:
            await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for relay in relays:
                relay.cancel()
            await asyncio.gather(*relays, return_exceptions=True)
            await upstream.close()


class _Close:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    async def __call__(self) -> None:
        await self._response.aclose()


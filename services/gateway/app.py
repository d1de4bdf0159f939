"""The gateway's one ASGI app: every request goes to one of three planes, told apart as E2B's own
edge tells them:
- Host `<port>-<sandbox id>.<domain>` for a port other than envd's → that port in that sandbox;
- an `E2b-Sandbox-Id` header (the SDK sends it with every envd call when pointed at one sandbox
  URL), or Host `49983-<id>.<domain>` → envd: Connect RPC services, `/files`, `/health`;
- anything else → the REST control plane.
"""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.codec import proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.gateway import control, envd_http, shapes
from services.gateway.envd_files import FilesystemService
from services.gateway.envd_process import ProcessService
from services.gateway.ports import PortProxy

SANDBOX_HEADER = b"e2b-sandbox-id"


class _Strict:
    """connectrpc's own codec, with a body it cannot decode answered `invalid_argument` (as envd
    does) instead of an `unknown` failure of the server."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except Exception as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"the request is not a {message_class.__name__}: {exc}") from None


CODECS = [_Strict(proto_binary_codec()), _Strict(proto_json_codec())]


async def _rest_not_found(request: Request, exc: Exception) -> JSONResponse:
    code = exc.status_code if isinstance(exc, HTTPException) else 500
    what = "no such path in the E2B API" if code == 404 else "method not allowed here" if code == 405 else "error"
    return JSONResponse(shapes.error_body(code, f"{request.method} {request.url.path}: {what}"), status_code=code)


class Gateway:
    def __init__(self, deps: control.Deps) -> None:
        self.deps = deps
        sandboxes = deps.sandboxes
        self.proxy = PortProxy(sandboxes)
        self.rest = Starlette(routes=control.routes(deps),
                              exception_handlers={404: _rest_not_found, 405: _rest_not_found})
        self.process = ProcessASGIApplication(ProcessService(sandboxes), codecs=CODECS)
        self.filesystem = FilesystemASGIApplication(FilesystemService(sandboxes), codecs=CODECS)

        def envd_route(handler) -> Any:  # type: ignore[no-untyped-def]
            async def endpoint(request: Request) -> Any:
                return await handler(request, sandboxes)
            return endpoint

        self.envd_http = Starlette(routes=[
            Route("/files", envd_route(envd_http.read_file), methods=["GET"]),
            Route("/files", envd_route(envd_http.write_file), methods=["POST"]),
            Route("/health", envd_route(envd_http.health), methods=["GET"]),
        ], exception_handlers={404: _rest_not_found, 405: _rest_not_found})

    async def close(self) -> None:
        await self.proxy.close()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan is off
            return
        headers = dict(scope.get("headers") or [])
        target = shapes.port_host(headers.get(b"host", b"").decode("latin-1"), self.deps.settings.sandbox_domain)
        if scope["type"] == "websocket":  # only a sandbox's port speaks websockets here
            if target is not None and target[0] != shapes.ENVD_PORT:
                await self.proxy.websocket(scope, receive, send, *target)
            else:
                await receive()
                await send({"type": "websocket.close", "code": 1003})
            return
        if target is not None and target[0] != shapes.ENVD_PORT:
            request = Request(scope, receive)
            response = await self.proxy(request, *target)
            await response(scope, receive, send)
            return
        if target is not None and SANDBOX_HEADER not in headers:
            scope = {**scope, "headers": [*scope.get("headers", []), (SANDBOX_HEADER, target[1].encode())]}
        elif target is None and SANDBOX_HEADER not in headers:
            await self.rest(scope, receive, send)
            return
        path = scope.get("path", "")
        if path.startswith(self.process.path + "/"):
            await self.process(scope, receive, send)
        elif path.startswith(self.filesystem.path + "/"):
            await self.filesystem(scope, receive, send)
        else:
            await self.envd_http(scope, receive, send)

"""The HTTP face: an ASGI app (starlette routing) that turns SandboxFusion's POSTs (`/run_code`,
`/run_jupyter`) into judge calls and answers in its shapes: 200 with a `RunCodeResponse` or
`RunJupyterResponse` (whatever the program did, and also
`SandboxError` when the platform could not judge it), 422 `{"detail": [...]}` for a malformed
request, 404/405 `{"detail": "..."}` for an unknown route or method, as its FastAPI server does."""

from __future__ import annotations

import logging

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.fusion import judge, jupyter
from services.fusion.protocol import BadRequest, RunJupyterRequest, decode_request

log = logging.getLogger("sandfleet.fusion")
MAX_BODY = 64 * 1024 * 1024


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def build_app(deps: judge.Deps) -> Starlette:
    async def body_of(request: Request) -> bytes | Response:
        chunks, size = [], 0
        async for chunk in request.stream():  # read no further than the limit
            size += len(chunk)
            if size > MAX_BODY:
                return _json({"detail": f"request body over {MAX_BODY} bytes"}, 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def run_code(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        try:
            req = decode_request(body)
        except BadRequest as exc:
            return _json({"detail": exc.detail}, 422)
        reply = await judge.run_code(req, deps)
        if reply.message:
            log.info("run_code %s: %s %s", req.language, reply.status.value, reply.message)
        return _json(reply)

    async def run_jupyter(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        try:
            req = decode_request(body, RunJupyterRequest)
        except BadRequest as exc:
            return _json({"detail": exc.detail}, 422)
        reply = await jupyter.run_jupyter(req, deps)
        if reply.message:
            log.info("run_jupyter: %s %s", reply.status.value, reply.message)
        return _json(reply)

    async def ping(request: Request) -> Response:
        return Response("pong", media_type="text/plain")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _json({"detail": exc.detail}, exc.status_code)

    return Starlette(
        routes=[Route("/run_code", run_code, methods=["POST"]), Route("/run_jupyter", run_jupyter, methods=["POST"]),
                Route("/v1/ping", ping, methods=["GET"])],
        exception_handlers={HTTPException: http_error},
    )

"""E2B's REST control plane (the paths and bodies of the SDK's generated OpenAPI client under
e2b/api/): create from a template, list, get, kill, set_timeout, connect, pause/resume. Each
handler is a function of (request, deps) carried out through the sandfleet SDK; a tenant sees
only the sandboxes labelled with it."""

from __future__ import annotations

import json
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sandfleet import errors
from schemas.sandbox import State
from services.gateway import shapes
from services.gateway.faults import SandboxGone, http_status, message_of
from services.gateway.idempotency import IdempotentCreates, KeyReused
from services.gateway.sandboxes import Sandboxes
from services.gateway.settings import GatewaySettings

log = logging.getLogger("sandfleet.gateway")
MAX_PAGE = 1000


@dataclass(frozen=True)
class Deps:
    sandboxes: Sandboxes
    settings: GatewaySettings
    creates: IdempotentCreates = field(default_factory=IdempotentCreates)


def error(code: int, message: str) -> JSONResponse:
    return JSONResponse(shapes.error_body(code, message), status_code=code)


def failure(exc: Exception) -> JSONResponse:
    status = http_status(exc)
    if status == 500:
        log.error("gateway request failed: %s", message_of(exc))
        return error(500, "internal error")
    return error(status, message_of(exc))


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise shapes.BadRequest(f"the body is not JSON: {exc}") from None


def _tenant(request: Request, deps: Deps) -> str:
    key = request.headers.get("x-api-key")
    if key is None and request.headers.get("authorization", "").lower().startswith("bearer "):
        key = request.headers["authorization"][7:].strip()
    return deps.sandboxes.tenant(key)


def _timeout(body: Any, name: str = "timeout") -> int | None:
    if not isinstance(body, dict) or body.get(name) is None:
        return None
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise shapes.BadRequest(f"{name} must be a whole number of seconds, at least 1")
    return value


async def create(request: Request, deps: Deps) -> Response:
    tenant = _tenant(request, deps)
    body = await _json(request)
    kwargs = shapes.create_spec(body, tenant=tenant, templates=deps.settings.templates,
                                isolation=deps.settings.isolation)

    async def make() -> str:
        return (await (await deps.sandboxes.fleet_of(tenant)).create(**kwargs)).id

    try:
        sandbox_id = await deps.creates.once(tenant, request.headers.get("idempotency-key"), body, make)
    except KeyReused as exc:
        return JSONResponse({**shapes.error_body(422, str(exc)), "error_code": "idempotency_request_mismatch"},
                            status_code=422)
    record = await deps.sandboxes.record(sandbox_id, tenant)
    answer = shapes.sandbox_json(record, domain=deps.settings.sandbox_domain, token=deps.sandboxes.token(sandbox_id))
    return JSONResponse(answer, status_code=201)


async def list_sandboxes(request: Request, deps: Deps) -> Response:
    tenant = _tenant(request, deps)
    q = request.query_params
    metadata = {urllib.parse.unquote(k): urllib.parse.unquote(v)
                for k, v in urllib.parse.parse_qsl(q.get("metadata", ""), keep_blank_values=True)}
    states = {s for s in q.get("state", "running,paused").split(",") if s}
    if not states <= {"running", "paused"}:
        raise shapes.BadRequest(f"state: running and/or paused, not {sorted(states - {'running', 'paused'})}")
    try:
        limit = int(q.get("limit") or 100)
        start = int(q.get("nextToken") or 0)
    except ValueError:
        raise shapes.BadRequest("limit and nextToken are whole numbers") from None
    if not 1 <= limit <= MAX_PAGE or start < 0:
        raise shapes.BadRequest(f"limit is 1 to {MAX_PAGE}")
    found = shapes.list_filter(await (await deps.sandboxes.fleet_of(tenant)).list(), tenant, metadata=metadata,
                               states=states)
    if q.get("order") == "desc":
        found.reverse()
    page = found[start:start + limit]
    headers = {"x-next-token": str(start + limit)} if start + limit < len(found) else {}
    return JSONResponse([shapes.listed_json(r) for r in page], headers=headers)


async def get_sandbox(request: Request, deps: Deps) -> Response:
    tenant = _tenant(request, deps)
    record = await deps.sandboxes.record(request.path_params["sandbox_id"], tenant)
    return JSONResponse(shapes.detail_json(record, domain=deps.settings.sandbox_domain,
                                           token=deps.sandboxes.token(record.id)))


async def kill(request: Request, deps: Deps) -> Response:
    sb = await deps.sandboxes.handle(request.path_params["sandbox_id"], _tenant(request, deps))
    try:
        await sb.destroy()
    except errors.NotFound:  # it ended meanwhile: killed either way
        pass
    deps.sandboxes.forget(sb.id)
    return Response(status_code=204)


async def set_timeout(request: Request, deps: Deps) -> Response:
    sb = await deps.sandboxes.handle(request.path_params["sandbox_id"], _tenant(request, deps))
    timeout = _timeout(await _json(request))
    if timeout is None:
        raise shapes.BadRequest("timeout is required")
    await sb.set_timeout(timeout)
    return Response(status_code=204)


async def refresh(request: Request, deps: Deps) -> Response:
    sb = await deps.sandboxes.handle(request.path_params["sandbox_id"], _tenant(request, deps))
    await sb.set_timeout(_timeout(await _json(request), "duration") or shapes.DEFAULT_TIMEOUT_S)
    return Response(status_code=204)


async def connect(request: Request, deps: Deps) -> Response:
    """E2B's connect resumes a paused sandbox and may give it a new timeout."""
    tenant = _tenant(request, deps)
    sandbox_id = request.path_params["sandbox_id"]
    timeout = _timeout(await _json(request))
    record = await deps.sandboxes.record(sandbox_id, tenant)
    sb = await deps.sandboxes.handle(sandbox_id, tenant)
    if record.state is State.PAUSED:
        await sb.resume()
    if timeout is not None:
        await sb.set_timeout(timeout)
    record = await deps.sandboxes.record(sandbox_id, tenant)
    body = shapes.sandbox_json(record, domain=deps.settings.sandbox_domain, token=deps.sandboxes.token(record.id))
    return JSONResponse(body, status_code=200)


async def metrics(request: Request, deps: Deps) -> Response:
    tenant = _tenant(request, deps)
    record = await deps.sandboxes.record(request.path_params["sandbox_id"], tenant)
    reading = await (await deps.sandboxes.handle(record.id, tenant)).metrics()
    return JSONResponse([shapes.metric_json(record, reading)])


async def pause(request: Request, deps: Deps) -> Response:
    tenant = _tenant(request, deps)
    record = await deps.sandboxes.record(request.path_params["sandbox_id"], tenant)
    if record.state is State.PAUSED:
        return error(409, f"sandbox {record.id} is already paused")
    await (await deps.sandboxes.handle(record.id, tenant)).pause()
    return Response(status_code=204)


async def resume(request: Request, deps: Deps) -> Response:
    tenant = _tenant(request, deps)
    record = await deps.sandboxes.record(request.path_params["sandbox_id"], tenant)
    if record.state is not State.PAUSED:
        return error(409, f"sandbox {record.id} is not paused")
    await (await deps.sandboxes.handle(record.id, tenant)).resume()
    record = await deps.sandboxes.record(record.id, tenant)
    body = shapes.sandbox_json(record, domain=deps.settings.sandbox_domain, token=deps.sandboxes.token(record.id))
    return JSONResponse(body, status_code=201)


def _guarded(handler, deps: Deps):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, deps)
        except (errors.SandfleetError, shapes.BadRequest) as exc:
            if isinstance(exc, SandboxGone):
                return error(404, message_of(exc))
            return failure(exc)
        except Exception:  # never a traceback to the caller: E2B's 500, the detail in our log
            log.exception("%s %s failed", request.method, request.url.path)
            return error(500, "internal error")
    return endpoint


def routes(deps: Deps) -> list[Route]:
    table = [
        ("/sandboxes", create, ["POST"]),
        ("/v2/sandboxes", create, ["POST"]),
        ("/sandboxes", list_sandboxes, ["GET"]),
        ("/v2/sandboxes", list_sandboxes, ["GET"]),
        ("/sandboxes/{sandbox_id}", get_sandbox, ["GET"]),
        ("/sandboxes/{sandbox_id}", kill, ["DELETE"]),
        ("/sandboxes/{sandbox_id}/timeout", set_timeout, ["POST"]),
        ("/sandboxes/{sandbox_id}/refreshes", refresh, ["POST"]),
        ("/sandboxes/{sandbox_id}/connect", connect, ["POST"]),
        ("/v2/sandboxes/{sandbox_id}/connect", connect, ["POST"]),
        ("/sandboxes/{sandbox_id}/metrics", metrics, ["GET"]),
        ("/sandboxes/{sandbox_id}/pause", pause, ["POST"]),
        ("/sandboxes/{sandbox_id}/resume", resume, ["POST"]),
    ]
    return [Route(path, _guarded(handler, deps), methods=methods) for path, handler, methods in table]

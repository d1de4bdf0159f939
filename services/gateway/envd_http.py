"""envd's plain HTTP endpoints: `/files` (read a file of any size; write one or several, as
multipart, or a streamed octet-stream body, gzipped or not) and `/health`, on the SDK's
transfers. Errors are envd's JSON body with its status (404 FileNotFound, 502 a gone sandbox)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import shutil
import tempfile
import zlib

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from sandfleet import errors
from sandfleet.client import Sandbox
from services.gateway import shapes
from services.gateway.envd_files import gone_or
from services.gateway.faults import SandboxGone, http_status, message_of
from services.gateway.sandboxes import Sandboxes

SMALL_READ = 1 << 20  # read in one request up to this; larger files go through a download
MAX_UPLOAD = 16 << 30  # a bound on what one upload may spool (a gzip bomb stops here)


class TooLarge(shapes.BadRequest):
    """An upload past MAX_UPLOAD (413)."""


def http_error(code: int, message: str) -> JSONResponse:
    """envd's HTTP error body: the SDK reads `message` and maps the status code."""
    return JSONResponse({"code": code, "message": message}, status_code=code)


def _failure(exc: Exception) -> JSONResponse:
    if isinstance(exc, TooLarge):
        return http_error(413, message_of(exc))
    if isinstance(exc, SandboxGone):
        return http_error(502, message_of(exc))
    return http_error(http_status(exc), message_of(exc) if http_status(exc) != 500 else "internal error")


async def _envd_sandbox(request: Request, sandboxes: Sandboxes) -> Sandbox:
    sb, _ = await sandboxes.for_envd(request.headers.get("e2b-sandbox-id"), request.headers.get("x-access-token"))
    return sb


async def health(request: Request, sandboxes: Sandboxes) -> Response:
    try:
        sb = await _envd_sandbox(request, sandboxes)
        record = await sandboxes.fleet.get(sb.id)
        if record.state not in shapes.LIVE:
            raise SandboxGone(sb.id)
    except errors.NotFound:
        return http_error(502, f"The sandbox {request.headers.get('e2b-sandbox-id')} was not found")
    except errors.SandfleetError as exc:
        return _failure(exc)
    return Response(status_code=204)


async def read_file(request: Request, sandboxes: Sandboxes) -> Response:
    try:
        sb = await _envd_sandbox(request, sandboxes)
        path = shapes.sandbox_path(request.query_params.get("path", ""))
        try:
            entry = await sb.files.stat(path)
            if entry.kind == "dir":
                raise shapes.BadRequest(f"{path} is a directory")
            if entry.size <= SMALL_READ:
                return Response(await sb.read_file(path), media_type="application/octet-stream")
            where = tempfile.mkdtemp(prefix="sandfleet-gateway-")
            try:
                await sb.download(path, os.path.join(where, "file"))
            except BaseException:
                shutil.rmtree(where, ignore_errors=True)
                raise
            return FileResponse(os.path.join(where, "file"), media_type="application/octet-stream",
                                background=BackgroundTask(shutil.rmtree, where, ignore_errors=True))
        except errors.SandfleetError as exc:
            raise await gone_or(sandboxes, sb, exc) from None
    except (errors.SandfleetError, shapes.BadRequest) as exc:
        return _failure(exc)


async def _spool(request: Request, where: str) -> str:
    """An octet-stream body (gunzipped if it says so) into a file under `where`, as it arrives: a
    streamed upload of any size never sits in the gateway's memory. At most MAX_UPLOAD bytes."""
    path = os.path.join(where, "body")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if request.headers.get("content-encoding", "").lower() == "gzip" \
        else None
    size = 0
    with open(path, "wb") as f:
        async for chunk in request.stream():
            try:
                data = inflate.decompress(chunk) if inflate is not None else chunk
            except zlib.error as exc:
                raise shapes.BadRequest(f"the gzip body does not decompress: {exc}") from None
            size += len(data)
            if size > MAX_UPLOAD:
                raise TooLarge(f"an upload is at most {MAX_UPLOAD >> 30} GiB here")
            await asyncio.to_thread(f.write, data)
        if inflate is not None and not inflate.eof:
            raise shapes.BadRequest("the gzip body ends early")
    return path


async def _bodies(request: Request, where: str) -> list[tuple[str | None, bytes | str]]:
    """(its part's file name, or None for a bare body; its bytes, or the file holding them) of
    each file an upload carries."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":  # the SDK's way for data it holds in memory anyway
        form = await request.form(max_files=1000, max_part_size=MAX_UPLOAD)
        files = [(v.filename, await v.read()) for _, v in form.multi_items() if not isinstance(v, str)]
        await form.close()
        return files
    return [(None, await _spool(request, where))]


async def write_file(request: Request, sandboxes: Sandboxes) -> Response:
    try:
        sb = await _envd_sandbox(request, sandboxes)
        query_path = request.query_params.get("path", "")
        where = tempfile.mkdtemp(prefix="sandfleet-gateway-")
        try:
            return await _write(sb, sandboxes, query_path, await _bodies(request, where))
        finally:
            await asyncio.to_thread(shutil.rmtree, where, True)
    except (errors.SandfleetError, shapes.BadRequest) as exc:
        return _failure(exc)


async def _write(sb: Sandbox, sandboxes: Sandboxes, query_path: str,
                 bodies: list[tuple[str | None, bytes | str]]) -> Response:
    written = []
    for name, data in bodies:
        # One file goes to the query's path; several each to their own (their part's file name).
        path = shapes.sandbox_path(query_path if query_path and len(bodies) == 1 else name or "")
        try:
            with contextlib.suppress(errors.SandfleetError):  # the upload says what is wrong, if anything
                await sb.files.mkdir(posixpath.dirname(path), parents=True)
            await sb.upload(data, path, mode=0o644)
        except errors.SandfleetError as exc:
            raise await gone_or(sandboxes, sb, exc) from None
        written.append({"name": posixpath.basename(path), "type": "file", "path": path})
    if not written:
        raise shapes.BadRequest("no file in the request")
    return JSONResponse(written)

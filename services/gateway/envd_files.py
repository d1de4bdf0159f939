"""envd's filesystem: the `filesystem.Filesystem` Connect service (stat, list, make_dir, move,
remove, watches streamed or polled) on the sandfleet SDK's file tree and watches (envd's plain
HTTP endpoints, `/files` and `/health`, are envd_http.py).

Paths are the sandbox's own (E2B's relative ones start at shapes.HOME). A watcher id of the
polled flavour carries its directory (`<watch id>:<path>`), so nothing is kept between polls.
"""

from __future__ import annotations

import contextlib
import posixpath
import stat as st
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb
from protobuf import Oneof
from protobuf.wkt import Timestamp

from sandfleet import errors
from sandfleet._files import Watch
from sandfleet.client import Sandbox
from schemas import files as wire
from services.gateway import shapes
from services.gateway.faults import SandboxGone, connect_error
from services.gateway.sandboxes import Sandboxes

_KINDS = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY, "symlink": pb.FileType.SYMLINK}
_EVENTS = {"created": pb.EventType.CREATE, "modified": pb.EventType.WRITE, "removed": pb.EventType.REMOVE}


def entry_info(entry: wire.Entry) -> pb.EntryInfo:
    mode = entry.mode
    return pb.EntryInfo(
        name=posixpath.basename(entry.path.rstrip("/")) or "/", type=_KINDS.get(entry.kind, pb.FileType.UNSPECIFIED),
        path=entry.path, size=entry.size, mode=st.S_IMODE(mode), permissions=st.filemode(mode)[1:],
        owner="root", group="root", is_symlink=entry.kind == "symlink",
        modified_time=Timestamp.from_datetime(datetime.fromtimestamp(entry.mtime, tz=timezone.utc)),
        **({"symlink_target": entry.target} if entry.kind == "symlink" else {}))


def event_name(watched: str, path: str) -> str:
    """E2B names a watch event by its path below the watched directory."""
    if path.startswith(watched.rstrip("/") + "/"):
        return path[len(watched.rstrip("/")) + 1:]
    return path.lstrip("/") if path.startswith("/") and watched == "/" else path


async def gone_or(sandboxes: Sandboxes, sb: Sandbox, exc: Exception) -> Exception:
    """`exc`, or SandboxGone when what is not found is the sandbox itself."""
    if isinstance(exc, errors.NotFound):
        try:
            record = await sandboxes.fleet.get(sb.id)
            alive = record.state in shapes.LIVE
        except errors.NotFound:
            alive = False
        if not alive:
            sandboxes.forget(sb.id)
            return SandboxGone(sb.id)
    return exc


class FilesystemService:
    """The `filesystem.Filesystem` service over the gateway's sandboxes."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self._sandboxes = sandboxes

    async def _sandbox(self, ctx: Any) -> Sandbox:
        headers = ctx.request_headers
        try:
            sb, _ = await self._sandboxes.for_envd(headers.get("e2b-sandbox-id"), headers.get("x-access-token"))
        except Exception as exc:
            raise connect_error(exc) from None
        return sb

    async def _run(self, ctx: Any, act):  # type: ignore[no-untyped-def]
        sb = await self._sandbox(ctx)
        try:
            return await act(sb)
        except ConnectError:
            raise
        except Exception as exc:
            raise connect_error(await gone_or(self._sandboxes, sb, exc)) from None

    async def stat(self, request: pb.StatRequest, ctx: Any) -> pb.StatResponse:
        path = _path(request.path)
        return await self._run(ctx, lambda sb: _stat(sb, path))

    async def list_dir(self, request: pb.ListDirRequest, ctx: Any) -> pb.ListDirResponse:
        path, depth = _path(request.path), max(1, min(int(request.depth or 1), 32))

        async def act(sb: Sandbox) -> pb.ListDirResponse:
            entries = await sb.files.list(path, depth=depth)
            return pb.ListDirResponse(entries=[entry_info(e) for e in entries if e.path != path])
        return await self._run(ctx, act)

    async def make_dir(self, request: pb.MakeDirRequest, ctx: Any) -> pb.MakeDirResponse:
        path = _path(request.path)

        async def act(sb: Sandbox) -> pb.MakeDirResponse:
            if await sb.files.exists(path):
                raise ConnectError(Code.ALREADY_EXISTS, f"{path} already exists")
            await sb.files.mkdir(path, parents=True)
            return pb.MakeDirResponse(entry=entry_info(await sb.files.stat(path)))
        return await self._run(ctx, act)

    async def move(self, request: pb.MoveRequest, ctx: Any) -> pb.MoveResponse:
        src, dst = _path(request.source), _path(request.destination)

        async def act(sb: Sandbox) -> pb.MoveResponse:
            await sb.files.rename(src, dst)
            return pb.MoveResponse(entry=entry_info(await sb.files.stat(dst)))
        return await self._run(ctx, act)

    async def remove(self, request: pb.RemoveRequest, ctx: Any) -> pb.RemoveResponse:
        path = _path(request.path)

        async def act(sb: Sandbox) -> pb.RemoveResponse:
            await sb.files.remove(path, recursive=True)
            return pb.RemoveResponse()
        return await self._run(ctx, act)

    async def watch_dir(self, request: pb.WatchDirRequest, ctx: Any) -> AsyncIterator[pb.WatchDirResponse]:
        path = _path(request.path)
        sb = await self._sandbox(ctx)
        watch = await self._run(ctx, lambda sb: sb.files.watch(path, recursive=request.recursive).start())
        keepalive_s = _keepalive_s(ctx)
        try:
            yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
            quiet = 0.0
            while not watch.ended:
                wait_s = min(10.0, keepalive_s)
                try:
                    events = await watch.poll(wait_s=wait_s)
                except errors.SandfleetError as exc:
                    raise connect_error(await gone_or(self._sandboxes, sb, exc)) from None
                quiet = 0.0 if events else quiet + wait_s
                for event in events:
                    found = await self._event(sb, watch, event, request.include_entry)
                    yield pb.WatchDirResponse(event=Oneof("filesystem", found))
                if quiet >= keepalive_s:
                    quiet = 0.0
                    yield pb.WatchDirResponse(event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))
        finally:
            await watch.close()

    async def _event(self, sb: Sandbox, watch: Watch, event: wire.FileEvent,
                     include_entry: bool) -> pb.FilesystemEvent:
        fields: dict[str, Any] = {"name": event_name(watch.path, event.path), "type": _EVENTS[event.kind]}
        if include_entry and event.kind != "removed":
            with contextlib.suppress(errors.SandfleetError):
                fields["entry"] = entry_info(await sb.files.stat(_absolute(watch.path, event.path)))
        return pb.FilesystemEvent(**fields)

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: Any) -> pb.CreateWatcherResponse:
        path = _path(request.path)
        watch = await self._run(ctx, lambda sb: sb.files.watch(path, recursive=request.recursive).start())
        return pb.CreateWatcherResponse(watcher_id=f"{watch.watch_id}:{path}")

    def _watch(self, sb: Sandbox, watcher_id: str) -> Watch:
        watch_id, sep, path = watcher_id.partition(":")
        if not sep or not watch_id:
            raise ConnectError(Code.NOT_FOUND, f"no watcher {watcher_id!r}")
        watch = Watch(sb, path, False, 60.0)
        watch.watch_id = watch_id
        return watch

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, ctx: Any) -> pb.GetWatcherEventsResponse:
        async def act(sb: Sandbox) -> pb.GetWatcherEventsResponse:
            watch = self._watch(sb, request.watcher_id)
            events = await watch.poll(wait_s=0)
            if watch.ended and not events:
                raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id} has ended")
            return pb.GetWatcherEventsResponse(events=[await self._event(sb, watch, e, False) for e in events])
        return await self._run(ctx, act)

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: Any) -> pb.RemoveWatcherResponse:
        async def act(sb: Sandbox) -> pb.RemoveWatcherResponse:
            await self._watch(sb, request.watcher_id).close()
            return pb.RemoveWatcherResponse()
        return await self._run(ctx, act)


def _keepalive_s(ctx: Any) -> float:
    try:
        return max(1.0, float(ctx.request_headers.get("keepalive-ping-interval") or 50))
    except ValueError:
        return 50.0


def _path(path: str) -> str:
    try:
        return shapes.sandbox_path(path)
    except shapes.BadRequest as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None


def _absolute(watched: str, name: str) -> str:
    return name if name.startswith("/") else posixpath.join(watched, name)


async def _stat(sb: Sandbox, path: str) -> pb.StatResponse:
    return pb.StatResponse(entry=entry_info(await sb.files.stat(path)))

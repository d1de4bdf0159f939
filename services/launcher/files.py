"""Launcher endpoints for files of any size: upload and download in chunks (see schemas/files.py),
small functions of (request, launcher) over the sandbox's transfer table (transfers.py).

Errors: a path that is not there is `not_found`; one escaping the root, a bad chunk, a hash
that does not match are `invalid_request`; a full disk (ENOSPC past `disk_mb`) is `capacity`;
a sandbox gone or quarantined (for writes) is `conflict`. A failed upload leaves nothing.
"""

from __future__ import annotations

import asyncio
import errno
import functools

from sandfleet.bus import Endpoint, Raw
from sandfleet.errors import ServiceError
from schemas import files as wire
from schemas.errors import ErrorCode
from schemas.node import subject as node_subject
from services.launcher import transfers, watches
from services.launcher.driver_errors import DRIVER_ERRORS, service_error
from services.launcher.handlers import _unfrozen
from services.launcher.keys import tag
from services.launcher.lifecycle import Launcher
from services.launcher.state import Live
from services.launcher.transfers import Transfer, Transfers
from services.launcher.watches import Watches

_PIPE_DEPTH = wire.WINDOW  # chunks queued between the bus and a tree's tar thread


def _table(launcher: Launcher, live: Live) -> Transfers:
    table = live.attached.get(transfers.NAME)
    if table is None:
        table = live.attached[transfers.NAME] = Transfers(per_sandbox=launcher.settings.transfers_per_sandbox)
    return table  # type: ignore[return-value]


def _error(exc: Exception, path: str) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ServiceError(ErrorCode.CAPACITY, f"{path}: ENOSPC the sandbox's disk (disk_mb) is full; "
                                                "nothing of the upload was kept")
    if isinstance(exc, BrokenPipeError):
        return ServiceError(ErrorCode.NOT_FOUND, f"{path}: the transfer was closed")
    return service_error(exc, path)


async def _still_live(launcher: Launcher, live: Live, undo) -> None:
    """After opening something off the loop: if the sandbox began to end meanwhile, its attached
    state was already ended, so what was just opened is undone here instead of kept."""
    if live.ending or launcher.live.get(live.id) is not live:
        await asyncio.to_thread(undo)
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {live.id} ended meanwhile")


async def _fail(table: Transfers, transfer: Transfer, exc: Exception, path: str) -> ServiceError:
    failure = _error(exc, path)
    transfer.failed = failure
    await table.close(transfer.id)
    return failure


async def upload(launcher: Launcher, req: wire.UploadRequest) -> wire.Transfer:
    tag(launcher.node_id, req.sandbox_id)
    live = _unfrozen(launcher, req.sandbox_id)
    table = _table(launcher, live)
    table.room()
    try:
        sink = await asyncio.to_thread(live.driver.open_upload, live.instance, req.path, req.kind, req.mode,
                                       _PIPE_DEPTH)
    except DRIVER_ERRORS as exc:
        raise _error(exc, req.path) from None
    await _still_live(launcher, live, sink.abort)
    transfer = table.add(sink, req.check, req.idle_s, req.path)
    return wire.Transfer(transfer_id=transfer.id, kind=req.kind, mode=req.mode, check=req.check)


async def upload_chunk(launcher: Launcher, req: wire.UploadChunk, data: bytes) -> wire.ChunkAck:
    tag(launcher.node_id, req.sandbox_id)
    table = _table(launcher, _unfrozen(launcher, req.sandbox_id))
    transfer = table.get(req.transfer_id)
    transfers.in_window(transfer, req.seq, transfer.next_seq)
    # Acked once written, as soon as it is (not with those written after it); a chunk whose
    # predecessor has not come yet is acked at once, held, as it always was.
    waits = all(seq in transfer.held for seq in range(transfer.next_seq, req.seq))
    written = transfer.hold(req.seq, data, waits)
    if transfer.writer is None or transfer.writer.done():
        transfer.writer = asyncio.get_running_loop().create_task(_write_in_order(transfer))
    if written is None:
        return wire.ChunkAck(seq=req.seq)
    try:
        await written
    except ServiceError:
        await table.close(transfer.id)  # a failed write: what was written goes (once the transfer ended: nothing)
        raise
    return wire.ChunkAck(seq=req.seq)


async def _write_in_order(transfer: Transfer) -> None:
    """Write every held chunk that is next, in order, each one's ack let go as soon as it is
    written. A task of its own, not the handler of whichever chunk came first: written by that
    handler, a chunk's ack waited for the chunks that came while it was written, and the acks
    came in bunches of two or three, stalling the client's window (upload 1 GiB, load ~3:
    see the commit)."""
    async with transfer.lock:
        while transfer.next_seq in transfer.held and transfer.failed is None:
            seq = transfer.next_seq
            data = transfer.held.pop(seq)
            transfer.next_seq += 1
            try:
                await transfer.run(transfer.write, data)
            except DRIVER_ERRORS as exc:
                transfer.failed = _error(exc, transfer.path)  # before any later chunk is let in
                transfer.written(seq, transfer.failed)
            except ServiceError as exc:  # the transfer ended meanwhile (its NotFound)
                transfer.written(seq, exc)
            except asyncio.CancelledError:
                transfer.written(seq, ServiceError(ErrorCode.CONFLICT, f"{transfer.path}: the upload was stopped"))
                raise
            else:
                transfer.written(seq)


async def upload_end(launcher: Launcher, req: wire.UploadEnd) -> wire.TransferDone:
    tag(launcher.node_id, req.sandbox_id)
    table = _table(launcher, _unfrozen(launcher, req.sandbox_id))
    transfer = table.get(req.transfer_id)
    path = transfer.path
    sink = transfer.end
    async with transfer.lock:
        if transfer.held or transfer.next_seq != req.chunks or sink.size != req.size:  # type: ignore[union-attr]
            why = (f"{path}: the node has {transfer.next_seq} chunks ({sink.size} bytes) of the "  # type: ignore[union-attr]
                   f"{req.chunks} ({req.size} bytes) sent; nothing was kept")
            failure: Exception = ServiceError(ErrorCode.INVALID_REQUEST, why)
        elif (digest := transfer.digest.hexdigest()) != req.digest:
            failure = ServiceError(ErrorCode.INVALID_REQUEST, f"{path}: digest {digest} on the node, "
                                                              f"{req.digest} sent; nothing was kept")
        else:
            try:
                await transfer.run(sink.commit)  # type: ignore[union-attr]
            except DRIVER_ERRORS as exc:
                failure = exc
            else:
                table.live.pop(transfer.id, None)
                transfer.closed = True
                return wire.TransferDone(size=req.size, digest=req.digest, check=transfer.check)
    raise await _fail(table, transfer, failure, path)


async def download(launcher: Launcher, req: wire.DownloadRequest) -> wire.Transfer:
    tag(launcher.node_id, req.sandbox_id)
    live = launcher.get_live(req.sandbox_id)
    table = _table(launcher, live)
    table.room()
    try:
        source = await asyncio.to_thread(live.driver.open_download, live.instance, req.path, wire.CHUNK_BYTES,
                                         _PIPE_DEPTH)
    except DRIVER_ERRORS as exc:
        raise _error(exc, req.path) from None
    await _still_live(launcher, live, source.close)
    transfer = table.add(source, req.check, req.idle_s, req.path)
    return wire.Transfer(transfer_id=transfer.id, kind=source.kind, size=source.size, mode=source.mode,  # type: ignore[arg-type]
                         check=req.check)


async def download_chunk(launcher: Launcher, req: wire.DownloadChunkRequest) -> Raw:
    tag(launcher.node_id, req.sandbox_id)
    table = _table(launcher, launcher.get_live(req.sandbox_id))
    transfer = table.get(req.transfer_id)
    source = transfer.end
    if transfer.eof_seq < 0 or req.seq < transfer.eof_seq:
        transfers.in_window(transfer, req.seq, transfer.delivered)
    async with transfer.lock:  # chunks are read in order, ahead of the one asked for if need be
        while transfer.next_seq <= req.seq and transfer.eof_seq < 0:
            try:
                data = await transfer.run(transfer.read)
            except DRIVER_ERRORS as exc:
                raise await _fail_unlocked(table, transfer, exc) from None
            transfer.held[transfer.next_seq] = data
            if not data:
                transfer.eof_seq = transfer.next_seq
                await transfer.run(source.close)  # type: ignore[union-attr]
            transfer.next_seq += 1
    if transfer.eof_seq >= 0 and req.seq >= transfer.eof_seq:
        transfer.held.pop(req.seq, None)
        return Raw(wire.DownloadChunk(seq=req.seq, eof=True, size=source.sent,  # type: ignore[union-attr]
                                      digest=transfer.digest.hexdigest()))
    data = transfer.held.pop(req.seq, None)
    if data is None:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"chunk {req.seq} was already sent")
    transfer.delivered = max(transfer.delivered, req.seq + 1)
    return Raw(wire.DownloadChunk(seq=req.seq), data)


async def _fail_unlocked(table: Transfers, transfer: Transfer, exc: Exception) -> ServiceError:
    """A download's read failed while its lock is held: mark it, and close it once released."""
    failure = _error(exc, transfer.path)
    transfer.failed = failure
    asyncio.get_running_loop().create_task(table.close(transfer.id))
    return failure


async def close(launcher: Launcher, req: wire.CloseRequest) -> wire.Closed:
    tag(launcher.node_id, req.sandbox_id)
    table = _table(launcher, launcher.get_live(req.sandbox_id))
    return wire.Closed(closed=await table.close(req.transfer_id))


# -- the tree: list, stat, mkdir, remove, rename ------------------------------------------------

async def _op(launcher: Launcher, sandbox_id: str, path: str, op: str, *args, writes: bool = True):
    tag(launcher.node_id, sandbox_id)
    live = _unfrozen(launcher, sandbox_id) if writes else launcher.get_live(sandbox_id)
    try:
        return await asyncio.to_thread(live.driver.file_op, live.instance, op, *args)
    except DRIVER_ERRORS as exc:
        raise _error(exc, path) from None


async def list_(launcher: Launcher, req: wire.ListRequest) -> wire.Listing:
    entries, truncated = await _op(launcher, req.sandbox_id, req.path, "list", req.path, req.depth, wire.MAX_LISTED,
                                   writes=False)
    return wire.Listing(entries=[wire.Entry(**e) for e in entries], truncated=truncated)


async def stat(launcher: Launcher, req: wire.StatRequest) -> wire.Entry:
    return wire.Entry(**await _op(launcher, req.sandbox_id, req.path, "stat", req.path, writes=False))


async def mkdir(launcher: Launcher, req: wire.MkdirRequest) -> wire.Done:
    await _op(launcher, req.sandbox_id, req.path, "mkdir", req.path, req.parents, req.mode)
    return wire.Done(path=req.path)


async def remove(launcher: Launcher, req: wire.RemoveRequest) -> wire.Done:
    await _op(launcher, req.sandbox_id, req.path, "remove", req.path, req.recursive)
    return wire.Done(path=req.path)


async def rename(launcher: Launcher, req: wire.RenameRequest) -> wire.Done:
    await _op(launcher, req.sandbox_id, req.src, "rename", req.src, req.dst)
    return wire.Done(path=req.dst)


# -- watches --------------------------------------------------------------------------------------

def _watches(launcher: Launcher, live: Live) -> Watches:
    table = live.attached.get(watches.NAME)
    if table is None:
        settings = launcher.settings
        table = live.attached[watches.NAME] = Watches(per_sandbox=settings.watches_per_sandbox,
                                                      capacity=settings.watch_buffer)
    return table  # type: ignore[return-value]


async def watch(launcher: Launcher, req: wire.WatchRequest) -> wire.Watching:
    tag(launcher.node_id, req.sandbox_id)
    live = launcher.get_live(req.sandbox_id)
    table = _watches(launcher, live)
    try:
        source = await asyncio.to_thread(live.driver.open_watch, live.instance, req.path, req.recursive,
                                         launcher.settings.watch_max_dirs)
    except DRIVER_ERRORS as exc:
        raise _error(exc, req.path) from None
    await _still_live(launcher, live, source.close)
    return wire.Watching(watch_id=table.add(source, req.idle_s).id, path=req.path)


async def watch_next(launcher: Launcher, req: wire.WatchNextRequest) -> wire.WatchEvents:
    tag(launcher.node_id, req.sandbox_id)
    return await _watches(launcher, launcher.get_live(req.sandbox_id)).next(req.watch_id, req.wait_s, req.max_events)


async def watch_close(launcher: Launcher, req: wire.WatchCloseRequest) -> wire.Closed:
    tag(launcher.node_id, req.sandbox_id)
    return wire.Closed(closed=_watches(launcher, launcher.get_live(req.sandbox_id)).close(req.watch_id))


def endpoints(launcher: Launcher) -> list[Endpoint]:
    """Registered by the composition root (__main__.endpoints)."""
    n, h, s, w = launcher.node_id, functools.partial, node_subject, wire
    return [
        Endpoint("files_upload", s(n, w.UPLOAD), w.UploadRequest, h(upload, launcher)),
        Endpoint("files_upload_chunk", s(n, w.UPLOAD_CHUNK), w.UploadChunk, h(upload_chunk, launcher),
                 max_bytes=w.CHUNK_BYTES, raw=True),
        Endpoint("files_upload_end", s(n, w.UPLOAD_END), w.UploadEnd, h(upload_end, launcher)),
        Endpoint("files_download", s(n, w.DOWNLOAD), w.DownloadRequest, h(download, launcher)),
        Endpoint("files_download_chunk", s(n, w.DOWNLOAD_CHUNK), w.DownloadChunkRequest, h(download_chunk, launcher)),
        Endpoint("files_close", s(n, w.CLOSE), w.CloseRequest, h(close, launcher)),
        Endpoint("files_list", s(n, w.LIST), w.ListRequest, h(list_, launcher)),
        Endpoint("files_stat", s(n, w.STAT), w.StatRequest, h(stat, launcher)),
        Endpoint("files_mkdir", s(n, w.MKDIR), w.MkdirRequest, h(mkdir, launcher)),
        Endpoint("files_remove", s(n, w.REMOVE), w.RemoveRequest, h(remove, launcher)),
        Endpoint("files_rename", s(n, w.RENAME), w.RenameRequest, h(rename, launcher)),
        Endpoint("files_watch", s(n, w.WATCH), w.WatchRequest, h(watch, launcher)),
        Endpoint("files_watch_next", s(n, w.WATCH_NEXT), w.WatchNextRequest, h(watch_next, launcher)),
        Endpoint("files_watch_close", s(n, w.WATCH_CLOSE), w.WatchCloseRequest, h(watch_close, launcher)),
    ]

"""Terminals of this node's sandboxes: the `pty.*` endpoints, small functions of (request, table).

A terminal is a background process whose stdin, stdout and stderr are one pty (the driver's
`spawn_terminal`): it lives in the process table (processes.py) beside the others, under the
same limits (processes per sandbox, output kept per process), is read, written, signalled,
waited for and listed through the `proc.*` endpoints, and ends with its sandbox like any. Only
its window size is its own.
"""

from __future__ import annotations

import functools

from sandfleet.bus import Endpoint
from sandfleet.errors import ServiceError
from schemas import node as node_schema
from schemas import pty
from schemas.errors import ErrorCode
from schemas.process import ProcessInfo
from services.launcher.keys import tag
from services.launcher.processes import ProcessTable, start


async def spawn(table: ProcessTable, req: pty.PtySpawnRequest) -> ProcessInfo:
    return await start(table, req, lambda live, command, on_output, on_exit: live.driver.spawn_terminal(
        live.instance, command, req.cols, req.rows, on_output, on_exit))


async def resize(table: ProcessTable, req: pty.ResizeRequest) -> ProcessInfo:
    tag(table.launcher.node_id, req.sandbox_id)
    process = table.find(req.sandbox_id, req.pid)
    resize_to = getattr(process.running, "resize", None)
    if resize_to is None:
        raise ServiceError(ErrorCode.CONFLICT, f"process {req.pid} has no terminal to resize")
    if process.exit is not None or not resize_to(req.cols, req.rows):
        raise ServiceError(ErrorCode.CONFLICT, f"process {req.pid} has ended: its terminal is gone")
    return process.info()


def endpoints(node_id: str, table: ProcessTable) -> list[Endpoint]:
    h, s = functools.partial, node_schema
    return [
        Endpoint("pty_spawn", s.subject(node_id, pty.PTY_SPAWN), pty.PtySpawnRequest, h(spawn, table)),
        Endpoint("pty_resize", s.subject(node_id, pty.PTY_RESIZE), pty.ResizeRequest, h(resize, table)),
    ]

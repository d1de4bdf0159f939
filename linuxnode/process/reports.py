"""Reports on the pipes between launcher, spawner and children: how they are written and
parsed back into one Report.

Records are tagged, of fixed layout: "P" pid (the spawner forked it), "R" (the init is about
to exec), "X" the command's wait status (from its exec helper), "C" the
command's own pid (a background command's helper, once it is spawned), "E" errno + message (a step
failed, or the spawner refused the request: protocol.py). Each record is one write of less
than PIPE_BUF bytes, so records from different writers never interleave. They stay binary,
not JSON as the requests are: children write them between fork and exec, where the least
code should run. They need no version of their own: their writers are the spawner that
accepted the request's version and its children.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

PID, READY, STATUS, ERROR, COMMAND = b"P", b"R", b"X", b"E", b"C"  # the tags; READY is a whole record
_INT = struct.Struct("<i")  # after PID and STATUS
_ERR = struct.Struct("<iH")  # after ERROR: errno, then the length of the message that follows


def pid_record(pid: int) -> bytes:
    return PID + _INT.pack(pid)


def command_record(pid: int) -> bytes:
    return COMMAND + _INT.pack(pid)


def status_record(status: int) -> bytes:
    return STATUS + _INT.pack(status)


def error_record(err: int, message: str) -> bytes:
    data = message.encode(errors="replace")[:1000]
    return ERROR + _ERR.pack(err, len(data)) + data


def report_failure(fd: int, step: str, exc: BaseException) -> None:
    """A child's last words before os._exit."""
    if isinstance(exc, OSError) and exc.errno:
        where = f" {exc.filename}" if exc.filename else ""
        record = error_record(exc.errno, f"{step}: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}{where}")
    else:
        record = error_record(0, f"{step}: {type(exc).__name__}: {exc}")
    try:
        os.write(fd, record)
    except OSError:
        pass


@dataclass
class Report:
    pid: int | None = None
    ready: bool = False
    status: int | None = None
    command: int | None = None  # the command's host pid (background commands only)
    errors: tuple[tuple[int, str], ...] = ()

    @classmethod
    def parse(cls, data: bytes) -> Report:
        report, errors_, i = cls(), [], 0
        while i < len(data):
            kind = data[i:i + 1]
            if kind == READY:
                report.ready, i = True, i + 1
            elif kind in (PID, STATUS, COMMAND) and i + 1 + _INT.size <= len(data):
                (value,) = _INT.unpack_from(data, i + 1)
                if kind == PID:
                    report.pid = value
                elif kind == COMMAND:
                    report.command = value
                else:
                    report.status = value
                i += 1 + _INT.size
            elif kind == ERROR and i + 1 + _ERR.size <= len(data):
                err, length = _ERR.unpack_from(data, i + 1)
                start = i + 1 + _ERR.size
                errors_.append((err, data[start:start + length].decode(errors="replace")))
                i = start + length
            else:
                errors_.append((0, f"garbled report {data[i:]!r}"))
                break
        report.errors = tuple(errors_)
        return report

"""Reports on the pipes between launcher, spawner and children: how they are written and
parsed back into one Report.

Records: "P" pid (the spawner forked it), "R" (the init is about to exec), "X" the command's
wait status (from its exec helper), "E" errno + message (a step failed). Each record is one
write of less than PIPE_BUF bytes, so records from different writers never interleave.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

_INT = struct.Struct("<i")
_ERR = struct.Struct("<iH")
READY = b"R"


def pid_record(pid: int) -> bytes:
    return b"P" + _INT.pack(pid)


def status_record(status: int) -> bytes:
    return b"X" + _INT.pack(status)


def error_record(err: int, message: str) -> bytes:
    data = message.encode(errors="replace")[:1000]
    return b"E" + _ERR.pack(err, len(data)) + data


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
    errors: tuple[tuple[int, str], ...] = ()

    @classmethod
    def parse(cls, data: bytes) -> Report:
        report, errors_, i = cls(), [], 0
        while i < len(data):
            kind = data[i:i + 1]
            if kind == b"R":
                report.ready, i = True, i + 1
            elif kind in (b"P", b"X") and i + 1 + _INT.size <= len(data):
                (value,) = _INT.unpack_from(data, i + 1)
                if kind == b"P":
                    report.pid = value
                else:
                    report.status = value
                i += 1 + _INT.size
            elif kind == b"E" and i + 1 + _ERR.size <= len(data):
                err, length = _ERR.unpack_from(data, i + 1)
                start = i + 1 + _ERR.size
                errors_.append((err, data[start:start + length].decode(errors="replace")))
                i = start + length
            else:
                errors_.append((0, f"garbled report {data[i:]!r}"))
                break
        report.errors = tuple(errors_)
        return report

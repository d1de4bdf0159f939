"""The runtime seam's errors as the bus's: one translation for every endpoint.

A driver (services/launcher/drivers/) raises its own typed errors and the kernel's OSErrors;
an endpoint names what it was doing (`what`: a path, a port, "freeze sb-…") and gets the
ServiceError a caller sees. An OSError about a path the caller named is the caller's: no
such file is NOT_FOUND, a full disk CAPACITY, anything else (a directory, a name too long)
INVALID_REQUEST. One about the sandbox's own state (its cgroup went away under a freeze, its
netns refused a connect) is CONFLICT: the sandbox is not in a state to do it.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from services.launcher.drivers.base import DriverFailure, ExecFailed, SandboxGone, Unsupported

# What an endpoint's driver call may raise that is not a bug of ours.
DRIVER_ERRORS = (OSError, ValueError, SandboxGone, ExecFailed, DriverFailure, Unsupported)


def service_error(exc: BaseException, what: str, *, path: bool = True) -> ServiceError:
    """`path`: `what` is a path the caller named (see the module's docstring)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, (SandboxGone, ProcessLookupError)):
        return ServiceError(ErrorCode.CONFLICT, "the sandbox's init is gone")
    if isinstance(exc, Unsupported):
        return ServiceError(ErrorCode.UNSUPPORTED, str(exc))
    if isinstance(exc, ExecFailed):
        return ServiceError(ErrorCode.CONFLICT, f"cannot run: {exc}")
    if isinstance(exc, DriverFailure):  # the node failed at its own work (a freeze that never settled)
        return ServiceError(ErrorCode.INTERNAL, str(exc))
    if isinstance(exc, ValueError):
        return ServiceError(ErrorCode.INVALID_REQUEST, f"{what}: {exc}")
    if isinstance(exc, TimeoutError):
        return ServiceError(ErrorCode.TIMEOUT, f"{what}: no answer in time")
    if path and isinstance(exc, FileNotFoundError):
        return ServiceError(ErrorCode.NOT_FOUND, f"{what}: no such file or directory")
    if path and isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ServiceError(ErrorCode.CAPACITY, f"{what}: ENOSPC the sandbox's disk (disk_mb) is full")
    code = ErrorCode.INVALID_REQUEST if path else ErrorCode.CONFLICT
    if isinstance(exc, OSError) and exc.errno is not None:
        return ServiceError(code, f"{what}: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}")
    return ServiceError(code, f"{what}: {type(exc).__name__}")


@contextlib.contextmanager
def translated(what: str, *, path: bool = True) -> Iterator[None]:
    """Around a driver call: what it raises leaves as the bus's error (see `service_error`)."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise service_error(exc, what, path=path) from None

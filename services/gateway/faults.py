"""sandfleet's typed errors translated at the boundary into E2B's: an HTTP status and E2B's JSON
body for the REST plane and `/files`, a Connect error code for envd's RPCs. The messages the SDK
looks for are kept (a sandbox that is gone "was not found", so it raises SandboxNotRunning)."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from sandfleet import errors
from services.gateway.shapes import BadRequest

class Unauthenticated(errors.SandfleetError):
    """No API key, an unknown one, or a wrong envd access token."""


_STATUS: list[tuple[type[Exception], int]] = [
    (Unauthenticated, 401),
    (BadRequest, 400),
    (errors.InvalidRequest, 400),
    (errors.NotFound, 404),
    (errors.Forbidden, 403),
    (errors.Conflict, 409),
    (errors.Capacity, 429),
    (errors.Unsupported, 400),
    (errors.Timeout, 504),
    (errors.NoResponders, 503),
]
_CODE: list[tuple[type[Exception], Code]] = [
    (Unauthenticated, Code.UNAUTHENTICATED),
    (BadRequest, Code.INVALID_ARGUMENT),
    (errors.InvalidRequest, Code.INVALID_ARGUMENT),
    (errors.NotFound, Code.NOT_FOUND),
    (errors.Forbidden, Code.PERMISSION_DENIED),
    (errors.Conflict, Code.FAILED_PRECONDITION),
    (errors.Capacity, Code.RESOURCE_EXHAUSTED),
    (errors.Unsupported, Code.UNIMPLEMENTED),
    (errors.Timeout, Code.DEADLINE_EXCEEDED),
    (errors.NoResponders, Code.UNAVAILABLE),
]


class SandboxGone(errors.NotFound):
    """The sandbox a request names does not run (never did, ended, or is another tenant's)."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"The sandbox {sandbox_id} was not found")
        self.sandbox_id = sandbox_id


def http_status(exc: Exception) -> int:
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def message_of(exc: Exception) -> str:
    return getattr(exc, "message", "") or str(exc) or type(exc).__name__


def connect_error(exc: Exception) -> ConnectError:
    """The Connect error for a failure of an envd call; a gone sandbox is UNAVAILABLE, as E2B's
    proxy answers, with the message the SDK recognises."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, (SandboxGone, errors.SandboxEnded)):
        sandbox_id = getattr(exc, "sandbox_id", "")
        text = message_of(exc) if isinstance(exc, SandboxGone) else f"The sandbox {sandbox_id} was not found: {exc}"
        return ConnectError(Code.UNAVAILABLE, text)
    for kind, code in _CODE:
        if isinstance(exc, kind):
            return ConnectError(code, message_of(exc))
    return ConnectError(Code.INTERNAL, message_of(exc))

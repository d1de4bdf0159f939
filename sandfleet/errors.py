"""The one exception tree a caller sees, and the one exception a handler raises.

    SandfleetError
    ├── NoResponders      nothing subscribes to the subject (platform down, node gone)
    ├── Timeout           nobody answered in time
    └── ServiceFailure    a service answered with an error body
        ├── InvalidRequest    the request broke the schema or a limit
        ├── NotFound          no such sandbox (or it has ended)
        │   └── SandboxEnded  the sandbox ended under a command or process (`reason` says why)
        ├── Capacity          no node has room right now
        ├── Unsupported       no node can run what was asked (e.g. an isolation level)
        ├── Conflict          the sandbox is in a state that forbids the operation
        ├── Forbidden         the caller may not do this: a tenant asking for the platform's work
        │                     (also what the SDK raises for a request the bus server refused to
        │                     carry for these credentials); another tenant's sandbox is NotFound
        └── InternalError     a service failed; the message says what, never a traceback
"""

from __future__ import annotations

from schemas.errors import STATUS, ErrorBody, ErrorCode


class SandfleetError(Exception):
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", *, subject: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.subject = subject


class NoResponders(SandfleetError):
    pass


class Timeout(SandfleetError):
    code = ErrorCode.TIMEOUT


class ServiceFailure(SandfleetError):
    pass


class InvalidRequest(ServiceFailure):
    code = ErrorCode.INVALID_REQUEST


class NotFound(ServiceFailure):
    code = ErrorCode.NOT_FOUND


class SandboxEnded(NotFound):
    """The sandbox ended while a command or background process ran in it, so the command's
    result says nothing about the command: `reason` (a schemas.sandbox.Reason value: expired,
    requested, process_exited (its init died: out of memory, killed), node_lost, node_shutdown,
    violation...) tells a trainer to mask the rollout instead of scoring it."""

    def __init__(self, message: str = "", *, reason: str = "none", subject: str = "") -> None:
        super().__init__(message, subject=subject)
        self.reason = reason


class Capacity(ServiceFailure):
    code = ErrorCode.CAPACITY


class Unsupported(ServiceFailure):
    code = ErrorCode.UNSUPPORTED


class Conflict(ServiceFailure):
    code = ErrorCode.CONFLICT


class Forbidden(ServiceFailure):
    code = ErrorCode.FORBIDDEN


class InternalError(ServiceFailure):
    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[ServiceFailure]] = {
    cls.code: cls for cls in (InvalidRequest, NotFound, Capacity, Unsupported, Conflict, Forbidden, InternalError)
}
_BY_CODE[ErrorCode.TIMEOUT] = InternalError


def from_body(body: ErrorBody, subject: str = "") -> ServiceFailure:
    return _BY_CODE.get(body.code, InternalError)(body.message, subject=subject)


class ServiceError(Exception):
    """Raised by a handler; the bus adapter turns it into an error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def body(self) -> ErrorBody:
        return ErrorBody(code=self.code, message=self.message)

"""Typed error bodies that every service reply may carry instead of a result.

An error reply has the NATS micro headers (`Nats-Service-Error`, `Nats-Service-Error-Code`)
and this body, so a client in any language can tell the kind of failure without parsing text.
"""

from __future__ import annotations

import enum

import msgspec


class ErrorCode(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    CAPACITY = "capacity"
    UNSUPPORTED = "unsupported"
    CONFLICT = "conflict"
    FORBIDDEN = "forbidden"  # the caller may not do this (a tenant asking for what is the platform's)
    TIMEOUT = "timeout"
    INTERNAL = "internal"


# The numeric code that goes in the `Nats-Service-Error-Code` header (HTTP-like, as nats.micro does).
STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.UNSUPPORTED: 422,
    ErrorCode.CAPACITY: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.INTERNAL: 500,
}


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    code: ErrorCode
    message: str

"""Requests checked on the caller's side: a bad value raises `InvalidRequest` before anything is sent,
exactly as the service would refuse it."""

from __future__ import annotations

from typing import Any

import msgspec

from sandfleet import errors
from sandfleet.allow_rules import parse_allow
from schemas import sandbox
from schemas.sandbox import Isolation


def _spec(
    isolation: Isolation = "process",
    cpu: float = 1.0,
    memory_mb: int = 512,
    pids: int = 512,
    timeout_s: int = 600,
    labels: dict[str, str] | None = None,
    layers: list[str] | None = None,
    allow: list[str] | None = None,
    disk_mb: int = 1024,
    host_view: bool = False,
    desktop: sandbox.DesktopSpec | None = None,
    build: bool = False,
) -> sandbox.CreateRequest:
    # Build through JSON so a bad value raises InvalidRequest here, as the service would.
    raw = dict(
        isolation=isolation, cpu=cpu, memory_mb=memory_mb, pids=pids, timeout_s=timeout_s,
        labels=labels or {}, layers=layers or [], allow=allow or [], disk_mb=disk_mb, host_view=host_view,
        desktop=msgspec.to_builtins(desktop), build=build,
    )
    try:
        spec = msgspec.convert(raw, sandbox.CreateRequest)
        parse_allow(spec.allow)  # a bad rule fails here, before anything is sent
    except (msgspec.ValidationError, ValueError) as exc:
        raise errors.InvalidRequest(str(exc)) from None
    return spec


def _convert(raw: dict[str, Any], kind: type[Any]) -> Any:
    """Check a request here, so bad input raises InvalidRequest before anything is sent."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise errors.InvalidRequest(str(exc)) from None

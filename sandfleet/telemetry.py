"""OpenTelemetry: the tracer, and W3C trace context in NATS headers.

Only the OpenTelemetry API is imported here, so a client installs no SDK: with no
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_TRACES_EXPORTER=none`) tracing is the API's no-op,
and an incoming `traceparent` still passes through to the next hop. Spans leave the process
only after `setup` (every service calls it, through `runner`), which then brings in the SDK
(`telemetry_export`, the `tracing` extra) and exports over OTLP/HTTP in batches. Inside a hop,
`phase` spans its steps and `state_changed` marks a sandbox's transitions as span events; with
no tracer both cost a context switch and nothing more (a service with metrics on and no
collector has `metrics.BusHopTracer`, which only times the bus hops).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context, propagate, trace

from sandfleet.extras import require

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

# Canonical attribute keys shared by spans and logs.
SANDBOX_ID = "sandbox.id"
NODE_ID = "node.id"
SUBJECT = "messaging.destination.name"
CANONICAL_KEYS = (SANDBOX_ID, NODE_ID)  # on log records as well as spans
# On the spans of a sandbox's phases too, so a trace is found (and read) by what it built.
TENANT = "sandfleet.tenant"  # the sandbox's `tenant` label, as quotas count it
ISOLATION = "sandfleet.isolation"
LAYERS = "sandfleet.layers"
ERROR_CODE = "sandfleet.error.code"  # a handler's error reply: the code its caller gets

_provider: TracerProvider | None = None
_phases = trace.get_tracer("sandfleet")  # a proxy: the provider `setup` installs, once it does


def exporting() -> bool:
    """A collector is configured: spans are to leave the process."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) and os.environ.get(
        "OTEL_TRACES_EXPORTER", "otlp"
    ) != "none"


def setup(service_name: str, extra_processor: SpanProcessor | None = None) -> TracerProvider | None:
    """Install the process's tracer provider once, if spans have somewhere to go (a collector,
    or `extra_processor`); otherwise the API's no-op tracer stays and the SDK is never imported."""
    global _provider
    if _provider is None and (exporting() or extra_processor is not None):
        require("tracing", "exporting spans")
        from sandfleet import telemetry_export  # the SDK: only in a process whose spans leave it

        _provider = telemetry_export.provider(service_name, otlp=exporting())
        trace.set_tracer_provider(_provider)
    if _provider is not None and extra_processor is not None:
        _provider.add_span_processor(extra_processor)
    return _provider


def shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str = "sandfleet") -> trace.Tracer:
    return trace.get_tracer(name)


def phase(name: str, attributes: dict[str, Any] | None = None) -> Any:
    """A span for one phase inside a hop (`placement.decide`, `layer.fetch`, `launcher.spawn`),
    a child of the current span: `with telemetry.phase("layer.fetch", {...}):`."""
    return _phases.start_as_current_span(name, attributes=attributes)


def current_attributes(attributes: dict[str, Any]) -> None:
    """Name what the current span is about (`sandbox_attributes`), once it is known."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def state_changed(state: str, **attributes: Any) -> None:
    """A sandbox's state change, as an event on the current span (the hop that made it)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("sandbox.state", {"sandbox.state": state, **attributes})


def sandbox_attributes(sandbox_id: str, node_id: str, spec: Any = None) -> dict[str, Any]:
    """The canonical attributes of a span about one sandbox; `spec` (a SandboxSpec) adds its
    tenant, isolation and layers."""
    found: dict[str, Any] = {SANDBOX_ID: sandbox_id, NODE_ID: node_id}
    if spec is not None:
        found[TENANT] = spec.labels.get("tenant", "")
        found[ISOLATION] = spec.isolation
        found[LAYERS] = list(spec.layers)
    return found


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's context (`traceparent`, `tracestate`)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(headers or {}))

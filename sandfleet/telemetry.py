"""OpenTelemetry set-up and W3C trace context in NATS headers.

With no `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_TRACES_EXPORTER=none`) tracing is the API's
no-op; with it, spans leave over OTLP/HTTP in batches.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

# Canonical attribute keys shared by spans and logs.
SANDBOX_ID = "sandbox.id"
NODE_ID = "node.id"
SUBJECT = "messaging.destination.name"

_provider: TracerProvider | None = None


def setup(service_name: str, extra_processor: SpanProcessor | None = None) -> TracerProvider | None:
    """Install the process's tracer provider once, if spans have somewhere to go.

    Without an exporter the API's no-op tracer stays: spans cost next to nothing, and an
    incoming `traceparent` still passes through to the next hop unchanged.
    """
    global _provider
    exporting = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) and os.environ.get(
        "OTEL_TRACES_EXPORTER", "otlp"
    ) != "none"
    if _provider is None and (exporting or extra_processor is not None):
        _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporting:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(_provider)
    if _provider is not None and extra_processor is not None:
        _provider.add_span_processor(extra_processor)
    return _provider


def shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str = "sandfleet") -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's context (`traceparent`, `tracestate`)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(headers or {}))

"""The OpenTelemetry SDK side of `telemetry`: a tracer provider that batches spans to OTLP/HTTP.

Imported only by `telemetry.setup` once spans are to leave the process (the services, through
`runner`; a client that exports its own spans). It needs the `tracing` extra, which `node`
includes; a client's install has only the API.
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def provider(service_name: str, otlp: bool) -> TracerProvider:
    """The process's provider, named for its service; with `otlp`, spans go to the collector
    `OTEL_EXPORTER_OTLP_ENDPOINT` names, in batches."""
    made = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        made.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return made

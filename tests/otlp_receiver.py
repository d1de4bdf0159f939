"""A real OTLP/HTTP trace receiver on loopback, so tests see the spans every service exported."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: tuple = ()  # (name, attributes) of each span event, in order


def _attributes(pairs) -> dict:  # type: ignore[no-untyped-def]
    """OTLP key-values as Python: strings, ints, and arrays of strings (a span's layers)."""
    found: dict = {}
    for a in pairs:
        if a.value.HasField("array_value"):
            found[a.key] = [v.string_value for v in a.value.array_value.values]
        else:
            found[a.key] = a.value.string_value or a.value.int_value
    return found


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    events = tuple((e.name, _attributes(e.attributes)) for e in s.events)
                    found.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                              s.parent_span_id.hex(), _attributes(s.attributes), events))
        with self._lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

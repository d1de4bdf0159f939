"""Prometheus metrics: every instrument of the platform, declared once, and a service's exporter.

API-light like `telemetry`: a service records at the place an event happens
(`metrics.LAUNCHES.observe(seconds, isolation="process", outcome="ok")`), and until `setup`
binds them every instrument is a no-op costing one attribute test, so the SDK and CLI never
import `prometheus_client` and a platform run with SANDFLEET_METRICS=off pays nothing more.
`setup` (every service, through `runner`) binds them to collectors in a registry of the
process's own and serves it on the loopback port the supervisor chose for the service
(SANDFLEET_METRICS_PORT); without a port there is nothing to serve and nothing is bound.

Labels are closed sets (an isolation level, an outcome, an error code, a violation kind, a
subject family), never a sandbox id: a fleet of thousands of sandboxes has the same series
as a fleet of one. Which service and node a series comes from is the scrape target's labels
(`sandfleet.prometheus` writes them), not the process's. Latency histograms carry the
current trace as an exemplar, so a latency panel links to the traces behind a bucket.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from sandfleet import telemetry
from schemas import node as node_schema
from schemas.ports import TUNNEL

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

log = logging.getLogger("sandfleet.metrics")

PORT_ENV = "SANDFLEET_METRICS_PORT"
SWITCH_ENV = "SANDFLEET_METRICS"  # "off": record nothing, serve nothing (the cost benchmark's baseline)

# Seconds: a create is tens of ms to tens of s (a cold layer fetch); a bus hop is sub-ms to s.
CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BUS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class Instrument:
    """One metric family: its kind, name, help and label names; a no-op until bound."""

    __slots__ = ("kind", "name", "help", "labels", "buckets", "initial", "owner", "_real", "_functions")

    def __init__(self, kind: str, name: str, help: str, labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = (), initial: tuple[dict[str, str], ...] = (),
                 owner: str | None = None) -> None:
        self.kind, self.name, self.help, self.labels, self.buckets = kind, name, help, labels, buckets
        self.owner = owner  # the one service that records it (None: every service), the only one exporting it
        self.initial = initial  # label sets exported at 0 from the start, so a rate is defined before the first event
        self._real: Any = None
        self._functions: list[tuple[dict[str, str], Callable[[], float]]] = []

    def inc(self, amount: float = 1, **labels: str) -> None:
        if self._real is not None:
            (self._real.labels(**labels) if labels else self._real).inc(amount)

    def observe(self, value: float, **labels: str) -> None:
        """A histogram observation, with the current span's trace as its exemplar."""
        if self._real is not None:
            (self._real.labels(**labels) if labels else self._real).observe(value, _exemplar())

    def set(self, value: float, **labels: str) -> None:
        if self._real is not None:
            (self._real.labels(**labels) if labels else self._real).set(value)

    def set_function(self, function: Callable[[], float], **labels: str) -> None:
        """A gauge read when scraped (a count the service already keeps: no bookkeeping twice)."""
        self._functions.append((labels, function))
        if self._real is not None:
            _bind_function(self._real, labels, function)

    def bind(self, registry: Any) -> None:
        import prometheus_client as prom

        kinds = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
        options: dict[str, Any] = {"buckets": self.buckets} if self.buckets else {}
        self._real = kinds[self.kind](self.name, self.help, self.labels, registry=registry, **options)
        for labels in self.initial:
            self._real.labels(**labels)
        for labels, function in self._functions:
            _bind_function(self._real, labels, function)

    def unbind(self) -> None:
        """Back to a no-op (a test that bound it to a registry of its own)."""
        self._real = None


def _bind_function(real: Any, labels: dict[str, str], function: Callable[[], float]) -> None:
    def read() -> float:
        try:  # read from the exporter's thread while the loop works: a moment's inconsistency is fine
            return float(function())
        except Exception:  # a bad read must not fail the whole scrape
            return float("nan")

    (real.labels(**labels) if labels else real).set_function(read)


def _exemplar() -> dict[str, str] | None:
    context = trace.get_current_span().get_span_context()
    return {"trace_id": format(context.trace_id, "032x")} if context.is_valid and context.trace_flags.sampled else None


OUTCOMES = ("ok", "failed")

CREATES = Instrument(
    "histogram", "sandfleet_create_seconds",
    "Sandbox creations answered by placement, and how long from request to running (its count is the creations)",
    ("isolation", "outcome"), CREATE_BUCKETS, owner="placement")
LAUNCHES = Instrument(
    "histogram", "sandfleet_launch_seconds",
    "Sandboxes a node's launcher built, and how long from launch request to running (queue, confine, root, start)",
    ("isolation", "outcome"), CREATE_BUCKETS, owner="launcher")
RUNNING = Instrument("gauge", "sandfleet_node_running_sandboxes", "Sandboxes live on the node", owner="launcher")
CAPACITY = Instrument("gauge", "sandfleet_node_capacity_sandboxes", "Sandboxes the node takes at most",
                      owner="launcher")
LAUNCH_QUEUE = Instrument("gauge", "sandfleet_launch_queue_depth",
                          "Launches the node accepted and has not begun to build (waiting for a build slot)",
                          owner="launcher")
WARM_SPARES = Instrument("gauge", "sandfleet_node_warm_spares",
                         "Warm-pool spares built and waiting for a create on the node (all pools)", owner="launcher")
WARM_CLAIMS = Instrument("counter", "sandfleet_warm_claims_total",
                         "Claims of a spare the node answered: taken, or empty (none left: the create went cold)",
                         ("result",), initial=({"result": "taken"}, {"result": "empty"}), owner="launcher")
ERRORS = Instrument("counter", "sandfleet_errors_total", "Requests a service answered with an error, by error code",
                    ("code",))
VIOLATIONS = Instrument("counter", "sandfleet_violations_total",
                        "Violations the node agent published, by kind (`<layer>.<what>`)", ("kind",),
                        owner="agent")
POLICY_ACTIONS = Instrument("counter", "sandfleet_policy_actions_total",
                            "Actions the security monitor carried out on a sandbox's node, by action and outcome",
                            ("action", "outcome"),
                            initial=tuple({"action": a, "outcome": o} for a in ("kill", "quarantine")
                                          for o in ("done", "not_done")), owner="security-monitor")
RECLAIM_ACTIONS = Instrument("counter", "sandfleet_reclaim_actions_total", "Reclaimer actions taken, by action",
                             ("action",), initial=tuple({"action": a} for a in ("merge", "page_out", "freeze")),
                             owner="reclaimer")
RECLAIMED = Instrument("counter", "sandfleet_reclaimed_bytes_total", "Bytes the reclaimer's actions took back",
                       ("action",), initial=tuple({"action": a} for a in ("merge", "page_out", "freeze")),
                       owner="reclaimer")
SANDBOX_MEMORY = Instrument("gauge", "sandfleet_node_sandbox_memory_bytes",
                            "Memory charged to the node's sandboxes' cgroups, at the reclaimer's last pass",
                            owner="reclaimer")
MERGED = Instrument("gauge", "sandfleet_node_merged_bytes", "Sandbox memory KSM shares, at the reclaimer's last pass",
                    owner="reclaimer")
SWAPPED = Instrument("gauge", "sandfleet_node_swapped_bytes",
                     "Sandbox memory paged out to the node's zram, uncompressed", owner="reclaimer")
LAYER_LOOKUPS = Instrument("counter", "sandfleet_layer_cache_lookups_total",
                           "Images a compose needed, found on the node (hit) or fetched from the store (miss)",
                           ("result",), initial=({"result": "hit"}, {"result": "miss"}), owner="layer-cache")
LAYER_FETCHED = Instrument("counter", "sandfleet_layer_fetched_bytes_total",
                           "Image bytes fetched from the store as whole images (fetch mode `full`)",
                           owner="layer-cache")
LAYER_CACHE_BYTES = Instrument("gauge", "sandfleet_layer_cache_bytes",
                               "The node's image cache: bytes fetched from the store so far (lazy images count "
                               "their chunks read), and bytes on disk", ("kind",), owner="layer-cache")
BUS_REQUESTS = Instrument("histogram", "sandfleet_bus_request_seconds",
                          "Bus requests, by subject family (a node's id is `*`) and side: `client` is the round "
                          "trip a caller waited, `server` the handling", ("family", "side"), BUS_BUCKETS)

INSTRUMENTS = (CREATES, LAUNCHES, RUNNING, CAPACITY, LAUNCH_QUEUE, WARM_SPARES, WARM_CLAIMS, ERRORS, VIOLATIONS, POLICY_ACTIONS,
               RECLAIM_ACTIONS, RECLAIMED, SANDBOX_MEMORY, MERGED, SWAPPED, LAYER_LOOKUPS, LAYER_FETCHED,
               LAYER_CACHE_BYTES, BUS_REQUESTS)

_server: Any = None


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "on").lower() not in ("off", "0", "false", "no")


def setup(service_name: str) -> bool:
    """Bind every instrument and serve them on SANDFLEET_METRICS_PORT (loopback), once; False
    (and every instrument stays a no-op) when metrics are off or no port was given."""
    global _server
    port = os.environ.get(PORT_ENV)
    if _server is not None or not port or not enabled():
        return _server is not None
    import prometheus_client as prom

    prom.disable_created_metrics()  # a `_created` series beside every counter: twice the series, no use here
    registry = prom.CollectorRegistry(auto_describe=True)
    try:
        _server, _ = prom.start_http_server(int(port), addr="127.0.0.1", registry=registry)
    except OSError as exc:  # the port was taken between the supervisor's choice and now
        log.warning("metrics of %s not served on port %s: %s", service_name, port, exc)
        return False
    for instrument in INSTRUMENTS:
        if instrument.owner in (None, service_name):
            instrument.bind(registry)
    return True


def shutdown() -> None:
    global _server
    if _server is not None:
        _server.shutdown()
        _server = None


def span_recorder() -> Any:
    """A span processor that times every bus hop the bus adapter already spans (`send <subject>`
    on the caller's side, `<subject>` on the handler's) into BUS_REQUESTS and counts the error
    replies into ERRORS: the adapter needs no second set of timers. For a process whose spans
    are exported anyway (the SDK is there); without a collector, `time_bus_hops` does the same
    for a fraction of the cost."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import SpanKind, StatusCode

    class BusHops(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            side = {SpanKind.CLIENT: "client", SpanKind.SERVER: "server"}.get(span.kind)
            subject = (span.attributes or {}).get(telemetry.SUBJECT)
            if side is None or not isinstance(subject, str) or span.end_time is None or span.start_time is None:
                return
            seconds = (span.end_time - span.start_time) / 1e9
            context = span.get_span_context()
            exemplar = {"trace_id": format(context.trace_id, "032x")} if context.trace_flags.sampled else None
            real = BUS_REQUESTS._real
            if real is not None:
                real.labels(family=subject_family(subject), side=side).observe(seconds, exemplar)
            if side == "server" and span.status.status_code is StatusCode.ERROR:
                ERRORS.inc(code=str((span.attributes or {}).get(telemetry.ERROR_CODE, "internal")))

    return BusHops()


@functools.lru_cache(maxsize=4096)  # per bus hop; subjects repeat (a tunnel's id makes new ones: bounded)
def subject_family(subject: str) -> str:
    """A subject without its ids: `node.v1.<node>.<verb>` → `node.v1.*.<verb>` (a verb has up to
    three tokens: `layers.cache.drop`; a tunnel's id after `tunnel` goes too); others keep their
    first four tokens (`sandbox.v1.create`, `sandbox.v1.quota.set`)."""
    tokens = subject.split(".")
    shape = node_schema.subject("\0", "\1").split(".")
    at = shape.index("\0")
    if tokens[:at] == shape[:at] and len(tokens) > at + 1:
        verb = tokens[at + 1:at + 2] if tokens[at + 1] == TUNNEL else tokens[at + 1:at + 4]
        return ".".join([*tokens[:at], "*", *verb])
    return ".".join(tokens[:4])


class BusHopSpan(trace.NonRecordingSpan):
    """A bus hop timed into BUS_REQUESTS (and its error reply counted), and nothing more: it
    carries its parent's span context, so trace context passes through as with no tracer at all,
    and keeps only the subject, the error code and whether it failed."""

    def __init__(self, parent: trace.SpanContext, side: str, subject: object) -> None:
        super().__init__(parent)
        self._side, self._subject = side, subject
        self._code: object = None
        self._failed = False
        self._started = time.perf_counter()

    def set_attribute(self, key: str, value: Any) -> None:
        if key == telemetry.SUBJECT:
            self._subject = value
        elif key == telemetry.ERROR_CODE:
            self._code = value

    def set_status(self, status: Any, description: str | None = None) -> None:
        code = getattr(status, "status_code", status)
        self._failed = self._failed or code is trace.StatusCode.ERROR

    def end(self, end_time: int | None = None) -> None:
        if not isinstance(self._subject, str):
            return
        BUS_REQUESTS.observe(time.perf_counter() - self._started, family=subject_family(self._subject), side=self._side)
        if self._side == "server" and self._failed:
            ERRORS.inc(code=str(self._code or "internal"))


class BusHopTracer(trace.NoOpTracer):
    """The tracer of a service whose spans go nowhere: the bus adapter's client and server spans
    become `BusHopSpan`s; every other span (a phase) is the API's no-op, passing context through."""

    def start_span(self, name: str, context: Any = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
                   attributes: Any = None, *args: Any, **kwargs: Any) -> trace.Span:
        side = _SIDES.get(kind)
        parent = trace.get_current_span(context).get_span_context()
        if side is None:
            return trace.NonRecordingSpan(parent)
        return BusHopSpan(parent, side, (attributes or {}).get(telemetry.SUBJECT))


class BusHopTracers(trace.TracerProvider):
    def __init__(self) -> None:
        self._tracer = BusHopTracer()

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self._tracer


_SIDES = {trace.SpanKind.CLIENT: "client", trace.SpanKind.SERVER: "server"}


def time_bus_hops() -> None:
    """Install `BusHopTracers` as the process's tracer provider: the bus hops are timed without
    the tracing SDK (a real span costs several times more, and no span leaves this process)."""
    trace.set_tracer_provider(BusHopTracers())

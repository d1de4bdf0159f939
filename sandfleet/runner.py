"""What every service's `__main__` shares: logging, telemetry and metrics, the bus, and a clean stop on SIGTERM.

Service side (it needs the `node` extra: uvloop, and the SDK once spans are exported): no client or
CLI path imports it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import uvloop

from sandfleet import metrics, telemetry
from sandfleet.bus import Bus
from sandfleet.config import ServiceConfig
from sandfleet.store import ensure_state


class CanonicalFormatter(logging.Formatter):
    """key=value lines; a record about one sandbox or node ends with the canonical keys that span
    attributes use too (`log.info(..., extra={telemetry.SANDBOX_ID: sid})`), and a node service's
    every line with its node's id, so one grep for `sandbox.id=sb-…` finds a sandbox's whole story."""

    def __init__(self, service: str, node_id: str | None = None) -> None:
        super().__init__(f"%(asctime)s service={service} level=%(levelname)s logger=%(name)s %(message)s")
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        keys = [(key, getattr(record, key, None)) for key in telemetry.CANONICAL_KEYS]
        if self.node_id is not None and not getattr(record, telemetry.NODE_ID, None):
            keys = [(k, self.node_id if k == telemetry.NODE_ID else v) for k, v in keys]
        tail = " ".join(f"{k}={v}" for k, v in keys if v)
        return f"{line} {tail}" if tail else line


def setup_logging(service: str, node_id: str | None = None) -> None:
    """`node_id`: the node a node service works for, on every line it writes."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(CanonicalFormatter(service, node_id))
    logging.basicConfig(level=os.environ.get("SANDFLEET_LOG_LEVEL", "INFO").upper(), handlers=[handler])


@contextlib.asynccontextmanager
async def service_bus(name: str, config: ServiceConfig) -> AsyncIterator[Bus]:
    bus = await Bus.connect(config.nats_url, name)
    try:
        await ensure_state(bus)
        yield bus
    finally:
        await bus.close()


def run(name: str, main: Callable[[ServiceConfig, asyncio.Event], Awaitable[None]], node_scoped: bool = False) -> None:
    """Run `main(config, stop)` until SIGTERM/SIGINT sets `stop`; exit 0 on a clean stop.
    `node_scoped`: one of a node's own services (its log lines carry the node's id)."""
    config = ServiceConfig.from_env()
    setup_logging(name, config.node_id if node_scoped else None)
    # Bus hops are timed from the spans the bus adapter makes: by the SDK's spans when they are
    # exported anyway, else by a tracer that does nothing but time them.
    recording = metrics.setup(name)
    exported = telemetry.setup(name, extra_processor=metrics.span_recorder() if recording and telemetry.exporting()
                               else None)
    if recording and exported is None:
        metrics.time_bus_hops()

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(config, stop)

    try:
        run_loop(_main())
    finally:
        telemetry.shutdown()
        metrics.shutdown()


def run_loop(main: Awaitable[None]) -> None:
    """Run a long-lived process's main coroutine: on uvloop (the services are bus-bound and spend
    much of their CPU in the event loop), with the cyclic collector tuned for them (`tune_gc`)."""
    tune_gc()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop_runner:
        loop_runner.run(main)  # type: ignore[arg-type]


# Collect the young generation every 20,000 net allocations instead of CPython's 700.
GC_THRESHOLD = (20_000, 10, 10)


def tune_gc() -> None:
    """A service allocates by the thousand per request (decoded records, events, acks) and keeps
    tens of thousands of objects for long (its sandboxes, cached records). With CPython's default
    thresholds the collector runs every few requests and its older generations walk all of them:
    in the control-plane benchmark a simulated node spent a quarter of its CPU there. What was
    made before serving (modules, tables) is frozen out of its walks; the rest is collected as
    before, less often (garbage without cycles is freed at once either way)."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)

"""What every service's `__main__` shares: logging, telemetry, the bus, and a clean stop on SIGTERM.

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

from sandfleet import telemetry
from sandfleet.bus import Bus
from sandfleet.config import ServiceConfig
from sandfleet.store import ensure_state


def setup_logging(service: str) -> None:
    level = os.environ.get("SANDFLEET_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s service={service} level=%(levelname)s logger=%(name)s %(message)s",
    )


@contextlib.asynccontextmanager
async def service_bus(name: str, config: ServiceConfig) -> AsyncIterator[Bus]:
    bus = await Bus.connect(config.nats_url, name)
    try:
        await ensure_state(bus)
        yield bus
    finally:
        await bus.close()


def run(name: str, main: Callable[[ServiceConfig, asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(config, stop)` until SIGTERM/SIGINT sets `stop`; exit 0 on a clean stop."""
    setup_logging(name)
    telemetry.setup(name)
    config = ServiceConfig.from_env()

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

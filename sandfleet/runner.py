"""What every service's `__main__` shares: logging, telemetry, the bus, and a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
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
        # uvloop: the services are bus-bound and spend much of their CPU in the event loop.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop_runner:
            loop_runner.run(_main())
    finally:
        telemetry.shutdown()

"""Composition root of the SandboxFusion endpoint (cluster scope; any number, each on its own port):
its settings, an SDK connection to the bus, the ASGI app, and uvicorn serving it until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

import sandfleet
from sandfleet import runner
from sandfleet.config import ServiceConfig
from services.fusion import judge
from services.fusion.app import build_app
from services.fusion.config import FusionConfig

log = logging.getLogger("sandfleet.fusion")
NAME = "fusion"


class _Server(uvicorn.Server):
    # The runner owns SIGTERM/SIGINT (they set `stop`); uvicorn's own handlers would take them over.
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


async def main(_: ServiceConfig, stop: asyncio.Event) -> None:
    config = FusionConfig.from_env()
    async with sandfleet.connect(config.nats_url) as fleet:
        deps = judge.Deps(fleet=fleet, layers=config.layers, isolation=config.isolation,
                          memory_mb=config.memory_mb, slots=asyncio.Semaphore(config.concurrency))
        server = _Server(uvicorn.Config(build_app(deps), host=config.host, port=config.port, lifespan="off",
                                        log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve())
        log.info("SandboxFusion endpoint on http://%s:%d", config.host, config.port)
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving  # a server that could not listen raises here, and the supervisor restarts us


if __name__ == "__main__":
    runner.run(NAME, main)

"""Composition root of the E2B gateway: settings, a bus connection through the SDK, the ASGI app
on uvicorn; on SIGTERM the server drains, then the app's forwards close, then the bus, in
reverse order. Settings: services/gateway/settings.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

import sandfleet
from sandfleet import runner
from sandfleet.bus_accounts import AuthDir
from sandfleet.config import ServiceConfig
from services.gateway.app import Gateway
from services.gateway.control import Deps
from services.gateway.sandboxes import Sandboxes
from services.gateway.settings import GatewaySettings
from services.gateway.tenants import TenantKeys

log = logging.getLogger("sandfleet.gateway")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the runner's stop event ends it."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    settings = GatewaySettings.from_env()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request otherwise
    auth = AuthDir.of(config.data_dir)  # the tenants' keys and credentials, where `tenant add` wrote them
    if not settings.api_keys and not auth.e2b_keys():
        log.warning("no API keys (`sandfleet tenant add NAME --e2b-key`, or SANDFLEET_GATEWAY_API_KEYS=KEY=TENANT): "
                    "every call is refused until one is added")
    tenant_keys = TenantKeys(auth, config.nats_url)
    async with sandfleet.connect(config.nats_url, name="gateway") as fleet:
        sandboxes = Sandboxes(fleet, settings.secret, settings.api_keys, tenant_keys)
        app = Gateway(Deps(sandboxes=sandboxes, settings=settings))
        server = _Server(uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="off",
                                        log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve())
        log.info("E2B API on http://%s:%d, sandbox domain %s", settings.host, settings.port, settings.sandbox_domain)
        try:
            await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        finally:
            server.should_exit = True
            await serving
            await app.close()
            await tenant_keys.close()


if __name__ == "__main__":
    runner.run("gateway", main)

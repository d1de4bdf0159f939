"""Whose events a connection may see: the tenant the bus server says it signed in as.

A tenant's account has no JetStream and imports the events of its own sandboxes only, on
subjects that carry its name (schemas/events.py, violations.py, security.py); the platform's
users read the stream. The SDK asks the server (`$SYS.REQ.USER.INFO`, answered by nats-server
itself for every user about itself) once per connection, so the same `fleet.events()` call
follows either view without being told which credentials it holds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.msg import Msg

from sandfleet.bus import Bus
from sandfleet.credentials import USER_INFO, tenant_of_account

ASK_TIMEOUT_S = 2.0


async def signed_in_tenant(bus: Bus) -> str | None:
    """The tenant `bus` signed in as; None for a user of the platform's account, or a bus that
    does not say (no auth: everyone is the platform)."""
    try:
        reply = await bus.nc.request(USER_INFO, b"", timeout=ASK_TIMEOUT_S)
        account = json.loads(reply.data).get("data", {}).get("account", "")
    except (nats.errors.Error, asyncio.TimeoutError, ValueError, AttributeError):
        return None
    return tenant_of_account(account) if isinstance(account, str) else None


async def live(bus: Bus, subjects: list[str]) -> AsyncIterator[Msg]:
    """Messages on `subjects` as they arrive (core subscriptions: a tenant's view has no replay)."""
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def arrived(msg: Msg) -> None:
        queue.put_nowait(msg)

    subs = [await bus.nc.subscribe(subject, cb=arrived) for subject in subjects]
    try:
        await bus.nc.flush()  # the server has the interest before the caller goes on to cause events
        while True:
            yield await queue.get()
    finally:
        for sub in subs:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

"""The monitor's one durable JetStream pull consumer on `events.v1.violation.>`.

Every replica pulls from the same durable consumer, so each violation goes to one of them; a
violation is acknowledged only after it is counted and any action it triggered is done, so
a monitor killed mid-way loses nothing: the server redelivers after `ACK_WAIT_S`, and the
counting in `policy.count` makes the redelivery harmless. The consumer starts at the
violations published after it was first created and keeps its place across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from sandfleet import errors
from sandfleet.bus import Bus, decode
from sandfleet.telemetry import SANDBOX_ID
from schemas import events, security, violations
from schemas.violations import Violation
from services.security_monitor import handlers

log = logging.getLogger("sandfleet.security")

ACK_WAIT_S = 10.0
IN_PROGRESS_S = 4.0  # tell the server a slow action is still being worked on, well inside ACK_WAIT_S
MAX_IN_FLIGHT = 64
MAX_DELIVER = 50
RETRY_DELAY_S = 1.0


async def subscribe(bus: Bus) -> JetStreamContext.PullSubscription:
    config = ConsumerConfig(
        durable_name=security.CONSUMER,
        description="security monitor: violations to count and act on",
        deliver_policy=DeliverPolicy.NEW,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT_S,
        max_deliver=MAX_DELIVER,
        max_ack_pending=MAX_IN_FLIGHT * 4,
        filter_subject=violations.ALL,
    )
    return await bus.js.pull_subscribe(violations.ALL, durable=security.CONSUMER, stream=events.STREAM, config=config)


async def consume(bus: Bus, deps: handlers.Deps) -> None:
    """Pull and handle violations until cancelled; at most MAX_IN_FLIGHT at once."""
    psub = await subscribe(bus)
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    locks = SandboxLocks()
    tasks: set[asyncio.Task] = set()
    try:
        while True:
            try:
                msgs = await psub.fetch(batch=16, timeout=1.0)
            except asyncio.TimeoutError:  # idle (nats-py raises its own subclass or the plain one)
                continue
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("fetching violations failed (%s); retrying", exc)
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            for msg in msgs:
                await slots.acquire()
                task = asyncio.create_task(_handle(deps, msg, locks))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: slots.release())
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(nats.errors.Error):
            await psub.unsubscribe()


class SandboxLocks:
    """One sandbox's violations are handled one at a time in a replica (replicas race through
    the ledger's revision checks instead), so a burst from one sandbox does not spin on conflicts."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def hold(self, sandbox_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        self._users[sandbox_id] += 1
        try:
            async with lock:
                yield
        finally:
            self._users[sandbox_id] -= 1
            if not self._users[sandbox_id]:
                del self._users[sandbox_id], self._locks[sandbox_id]


async def _handle(deps: handlers.Deps, msg: Msg, locks: SandboxLocks) -> None:
    try:
        violation = decode(msg.data, Violation)
    except msgspec.MsgspecError as exc:
        log.error("undecodable violation on %s dropped: %s", msg.subject, exc)
        await msg.term()
        return
    keepalive = asyncio.create_task(_in_progress(msg))
    try:
        async with locks.hold(violation.sandbox_id):
            await handlers.on_violation(deps, violation, msg.metadata.sequence.stream)
    except (errors.SandfleetError, errors.ServiceError, nats.errors.Error, nats.js.errors.Error) as exc:
        log.warning("violation of %s not handled yet (%s); it will be redelivered", violation.sandbox_id,
                    getattr(exc, "message", None) or exc, extra={SANDBOX_ID: violation.sandbox_id})
        await _quietly(msg.nak(delay=RETRY_DELAY_S))
        return
    except Exception:  # a bug must not stop the consumer; the message comes back later
        log.exception("handling a violation of %s failed", violation.sandbox_id, extra={SANDBOX_ID: violation.sandbox_id})
        await _quietly(msg.nak(delay=5 * RETRY_DELAY_S))
        return
    finally:
        keepalive.cancel()
    await _quietly(msg.ack())


async def _in_progress(msg: Msg) -> None:
    while True:
        await asyncio.sleep(IN_PROGRESS_S)
        await _quietly(msg.in_progress())


async def _quietly(call) -> None:  # type: ignore[no-untyped-def]
    try:
        await call
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        log.warning("ack to JetStream failed: %s", exc)

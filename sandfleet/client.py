"""The asyncio SDK: `connect()` → `Fleet` → `Sandbox`, and the one public surface of its parts.

Creation goes to placement (`sandbox.v1.*`); everything done to a sandbox afterwards goes
straight to the node that holds it (`node.v1.<node>.*`), the node named in the create reply.
This module owns the connection, creation (one sandbox or a gang batch) and reads; the rest
lives in private modules re-exported here: the `Sandbox` handle (`_sandbox`), whole-rollout
pause/resume and restore (`_rollout`), violations and policies (`_security`), warm pools
(`_pools`), and the caller-side request checks (`_requests`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.api
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from sandfleet import errors, telemetry
from sandfleet._batch_outcomes import BatchOutcomes
from sandfleet._pools import _FleetPools
from sandfleet._requests import _spec
from sandfleet._rollout import RolloutChange, _FleetRollout
from sandfleet._sandbox import ExecResult, Sandbox
from sandfleet._security import _FleetSecurity
from sandfleet._whoami import live, signed_in_tenant
from sandfleet.bus import Bus, decode, kv_values
from sandfleet.config import nats_url
from schemas import events, node, sandbox
from schemas.events import AnySandboxEvent
from schemas.sandbox import DesktopSpec, Isolation, SandboxRecord

__all__ = ["QUIET_S", "SERVICES", "BatchProgress", "ExecResult", "Fleet", "RolloutChange", "Sandbox", "connect"]

log = logging.getLogger("sandfleet.sdk")
QUIET_S = 30.0  # a gang batch with no event for this long has its records read instead
SERVICES = ("placement", "agent", "layer-cache", "reclaimer", "launcher", "security-monitor")


@dataclass(frozen=True)
class BatchProgress:
    """Where a gang batch stands: `placed` sandboxes, of which `running` started and `failed` did not."""

    total: int
    placed: int
    running: int
    failed: int

    @property
    def done(self) -> bool:
        return self.running + self.failed >= self.placed


class Fleet(_FleetRollout, _FleetSecurity, _FleetPools):
    """A connection to the platform; `Sandbox`, rollout and security calls hang off it."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        # Gang batches in flight share one subscription to `started`/`failed`: each event is
        # delivered and decoded once, not once per batch waiting.
        self._batch_waiters: list[Callable[[events.SandboxEvent], None]] = []
        self._batch_subs: list[Any] = []
        self._batch_subs_lock = asyncio.Lock()
        self._tenant: asyncio.Future[str | None] | None = None

    async def tenant(self) -> str | None:
        """The tenant this connection signed in as (the bus server says; asked once), or None for
        the platform's own users. A tenant sees its own sandboxes' events only, live."""
        if self._tenant is None:
            self._tenant = asyncio.ensure_future(signed_in_tenant(self.bus))
        return await asyncio.shield(self._tenant)

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(
        self,
        *,
        isolation: Isolation = "process",
        cpu: float = 1.0,
        memory_mb: int = 512,
        pids: int = 512,
        timeout_s: int = 600,
        labels: dict[str, str] | None = None,
        layers: list[str] | None = None,
        allow: list[str] | None = None,
        disk_mb: int = 1024,
        host_view: bool = False,
        desktop: DesktopSpec | None = None,
        build: bool = False,
        request_timeout_s: float = 60.0,
    ) -> Sandbox:
        """`desktop`: a virtual screen for the sandbox's programs, driven with `sb.screenshot`,
        `sb.mouse`, `sb.keys`, `sb.type` (its layers bring the display: `sandfleet desktop layer`).
        `build`: a build sandbox (system directories writable, root with a package manager's
        capabilities in its user namespace), for the platform's own account only (SandboxSpec.build)."""
        spec = _spec(isolation, cpu, memory_mb, pids, timeout_s, labels, layers, allow, disk_mb, host_view, desktop,
                     build)
        with telemetry.tracer("sandfleet.sdk").start_as_current_span("sandbox.create", kind=SpanKind.INTERNAL) as span:
            reply = await self.bus.request(sandbox.CREATE, spec, sandbox.CreateReply, timeout=request_timeout_s)
            span.set_attributes({telemetry.SANDBOX_ID: reply.id, telemetry.NODE_ID: reply.node})
        return Sandbox(self, reply.id, reply.node)

    async def create_many(
        self,
        count: int,
        *,
        request_timeout_s: float | None = None,
        progress: Callable[[BatchProgress], object] | None = None,
        **spec: Any,
    ) -> list[Sandbox]:
        """Create `count` sandboxes with one request (a gang batch, up to 32,000): placement answers
        once all are placed, the nodes launch them in parallel, and `progress` is called as their
        `started`/`failed` events arrive. Returns when every one has started or failed.

        Raises `ServiceFailure` if any sandbox failed to start (the others are returned on the error
        as `.created`, so the caller can use or destroy them); `Capacity` if the batch cannot be
        placed whole (nothing was created), with a message starting `quota:` if a quota refused it.
        """
        req = sandbox.CreateManyRequest(count=count, spec=_spec(**spec), wait=False)
        timeout = request_timeout_s or 60 + 0.05 * count
        batch = BatchOutcomes()
        arrived = asyncio.Event()

        def settled(event: events.SandboxEvent) -> None:
            if batch.heard(event):
                arrived.set()

        # Subscribed before asking, so no event of the batch can pass unseen.
        await self._follow_batches(settled)
        try:
            reply = await self.bus.request(sandbox.CREATE_MANY, req, sandbox.CreateManyReply, timeout=timeout)
            batch.placed({i: p.node for p in reply.placements for i in p.ids})
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                state = BatchProgress(total=count, placed=len(batch.where), running=batch.tally[sandbox.State.RUNNING],
                                      failed=batch.tally[sandbox.State.FAILED])
                if progress is not None:
                    progress(state)
                if state.done:
                    break
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    await self._settle(batch, settled)  # an event may have been missed: ask the records
                    break
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), min(left, QUIET_S))
                except asyncio.TimeoutError:  # long silence: an event may have been missed
                    await self._settle(batch, settled)
        finally:
            await self._unfollow_batches(settled)
        where, outcome = batch.where, batch.outcome
        created = [Sandbox(self, i, n) for i, n in where.items() if i in outcome and outcome[i].state is sandbox.State.RUNNING]
        if len(created) < count:
            failed = [f"{i}: {outcome[i].detail if i in outcome else 'no outcome in time'}"
                      for i in where if i not in outcome or outcome[i].state is not sandbox.State.RUNNING]
            failure = errors.InternalError(f"{len(failed)} of {count} sandboxes failed: {failed[:3]}")
            failure.created = created  # type: ignore[attr-defined]
            raise failure
        return created

    async def _follow_batches(self, settled: Callable[[events.SandboxEvent], None]) -> None:
        async with self._batch_subs_lock:
            if not self._batch_subs:
                tenant = await self.tenant() or events.ANY
                self._batch_subs = [
                    await self.bus.subscribe_direct(events.sandbox_subject("*", name, tenant), self._on_batch_event)
                    for name in ("started", "failed")
                ]
            self._batch_waiters.append(settled)

    async def _unfollow_batches(self, settled: Callable[[events.SandboxEvent], None]) -> None:
        async with self._batch_subs_lock:
            self._batch_waiters.remove(settled)
            if not self._batch_waiters:
                subs, self._batch_subs = self._batch_subs, []
                for sub in subs:
                    await sub.unsubscribe()

    def _on_batch_event(self, msg: Msg) -> None:
        event = _vouched(msg)
        if event is not None and event.state in (sandbox.State.RUNNING, sandbox.State.FAILED):
            for settled in list(self._batch_waiters):
                settled(event)

    async def _settle(self, batch: BatchOutcomes, settled: Callable[[events.SandboxEvent], None]) -> None:
        """Read the records of the sandboxes with no outcome yet (their events were missed)."""
        pending = [i for i in batch.where if i not in batch.outcome]
        for start in range(0, len(pending), 256):
            found = await asyncio.gather(*(self.get(i) for i in pending[start : start + 256]), return_exceptions=True)
            for record in found:
                if isinstance(record, SandboxRecord):
                    self._settled(record, settled)

    @staticmethod
    def _settled(record: SandboxRecord, settled: Callable[[events.SandboxEvent], None]) -> None:
        if record.state is sandbox.State.RUNNING or record.state in sandbox.ENDED:
            kind = events.Started if record.state is sandbox.State.RUNNING else events.Failed
            state = sandbox.State.RUNNING if record.state is sandbox.State.RUNNING else sandbox.State.FAILED
            settled(kind(sandbox_id=record.id, node=record.node, tenant=record.tenant, state=state,
                         seq=record.seq, at=record.updated_at, reason=record.reason, detail=record.detail))

    async def set_quota(
        self, *, task: str | None = None, tenant: str | None = None, max_concurrent: int = 0,
        max_creates_per_s: float = 0.0,
    ) -> sandbox.QuotaState:
        """Limit the sandboxes labelled task=`task` (or tenant=`tenant`); 0 is no limit. A create past
        a limit raises `Capacity` with a message starting `quota:`."""
        scope, name = ("task", task) if task is not None else ("tenant", tenant)
        raw = dict(scope=scope, name=name, max_concurrent=max_concurrent, max_creates_per_s=max_creates_per_s)
        return await self.bus.request(sandbox.QUOTA_SET, raw, sandbox.QuotaState)

    async def quota(self, *, task: str | None = None, tenant: str | None = None) -> sandbox.QuotaState:
        scope, name = ("task", task) if task is not None else ("tenant", tenant)
        return await self.bus.request(sandbox.QUOTA_GET, dict(scope=scope, name=name), sandbox.QuotaState)

    async def get(self, sandbox_id: str) -> SandboxRecord:
        return await self.bus.request(sandbox.GET, sandbox.GetRequest(id=sandbox_id), SandboxRecord)

    async def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle for an existing sandbox (raises NotFound if there is none)."""
        record = await self.get(sandbox_id)
        return Sandbox(self, record.id, record.node)

    async def list(self, *, include_ended: bool = False) -> list[SandboxRecord]:
        req = sandbox.ListRequest(include_ended=include_ended)
        return (await self.bus.request(sandbox.LIST, req, sandbox.SandboxList, timeout=30)).sandboxes

    async def events(self, sandbox_id: str | None = None, *, replay: bool = False,
                     node: str | None = None) -> AsyncIterator[AnySandboxEvent]:
        """Lifecycle events as they happen (`replay=True`: from the start of the stream first).
        With a tenant's credentials: its own sandboxes' only, and live only (Unsupported for replay).

        Each event's `node` is one the server vouched for (a node may publish under its own
        name only; an event whose body says otherwise than its subject is dropped). Of one
        sandbox: only its node's (`node`, else its record's while it has one) and placement's,
        so another node's word about it never arrives."""
        tenant = await self.tenant()
        if tenant is not None:
            _live_only(replay, "events")
        node = node or await self._node_of(sandbox_id)
        subject = _lifecycle_filter(sandbox_id, tenant, node)
        if tenant is not None:
            async for msg in live(self.bus, [subject]):
                if (event := _vouched(msg, node)) is not None:
                    yield event
            return
        policy = nats.js.api.DeliverPolicy.ALL if replay else nats.js.api.DeliverPolicy.NEW
        sub = await self.bus.js.subscribe(subject, ordered_consumer=True, deliver_policy=policy)
        try:
            async for msg in sub.messages:
                if (event := _vouched(msg, node)) is not None:
                    yield event
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def history(self, sandbox_id: str | None = None, *, idle_s: float = 1.0,
                      node: str | None = None) -> list[AnySandboxEvent]:
        """Every stored lifecycle event (of one sandbox, or all), oldest first (the platform's users:
        a tenant's account has no stream). Vouched for as `events` says: of one sandbox, its node's
        (`node`, else its record's; an ended sandbox's record is soon forgotten, so pass the node
        to be sure) and placement's only."""
        _live_only(await self.tenant() is not None, "history")
        node = node or await self._node_of(sandbox_id)
        subject = _lifecycle_filter(sandbox_id, None, node)
        sub = await self.bus.js.subscribe(
            subject, ordered_consumer=True, deliver_policy=nats.js.api.DeliverPolicy.ALL
        )
        found: list[AnySandboxEvent] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_s)
                except nats.errors.TimeoutError:
                    break
                if (event := _vouched(msg, node)) is not None:
                    found.append(event)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return found

    async def _node_of(self, sandbox_id: str | None) -> str | None:
        """The node `sandbox_id`'s record names (None: every sandbox, its record is gone, or no
        placement answers or these credentials may not ask: then every node's word, each still
        vouched for by its subject)."""
        if not sandbox_id:
            return None
        try:
            return (await self.get(sandbox_id)).node or None
        except (errors.NotFound, errors.NoResponders, errors.Timeout, errors.Forbidden):
            return None

    async def nodes(self) -> list[node.NodeInfo]:
        kv = await self.bus.js.key_value(node.KV_BUCKET)
        return [decode(value, node.NodeInfo) for value in (await kv_values(kv, "list nodes")).values()]

    async def ping(self, service: str, timeout: float = 1.0) -> bool:
        try:
            await self.bus.nc.request(f"$SRV.PING.{service}", b"", timeout=timeout)
            return True
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return False


def _lifecycle_filter(sandbox_id: str | None, tenant: str | None, node: str | None) -> str:
    """The lifecycle events of `sandbox_id` (None: every sandbox) of `tenant` (None: any: the
    platform's view) under `node` (None: any)."""
    return events.sandbox_filter(sandbox_id or events.ANY, tenant or events.ANY, node or events.ANY)


def _vouched(msg: Msg, node: str | None = None) -> AnySandboxEvent | None:
    """The event `msg` carries if it may be believed (`events.vouched`), else None (logged: a
    node said something about a sandbox that is not its own, or a body lied about its subject)."""
    try:
        event = decode(msg.data, AnySandboxEvent)
    except msgspec.DecodeError:
        event = None
    if event is None or not events.vouched(event, msg.subject, node):
        log.warning("dropped a lifecycle event on %s that its publisher may not have sent", msg.subject)
        return None
    return event


def _live_only(replay: bool, what: str) -> None:
    if replay:
        raise errors.Unsupported(f"{what}: a tenant sees its sandboxes' events live, not the stored stream "
                                 "(replay is the operator's)")


class _Connect:
    """`await connect(url)` or `async with connect(url) as fleet:`."""

    def __init__(self, url: str | None, name: str, creds: str | Path | None = None) -> None:
        self._url = nats_url(url)
        self._name = name
        self._creds = creds
        self._fleet: Fleet | None = None

    async def _open(self) -> Fleet:
        self._fleet = Fleet(await Bus.connect(self._url, self._name, creds=self._creds))
        return self._fleet

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._open().__await__()

    async def __aenter__(self) -> Fleet:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        if self._fleet is not None:
            await self._fleet.close()


def connect(url: str | None = None, *, name: str = "sandfleet-sdk", creds: str | Path | None = None) -> _Connect:
    """`creds`: a credentials file (`sandfleet tenant add`); without it $SANDFLEET_CREDS, else the
    operator's of a platform on this machine (sandfleet.credentials)."""
    return _Connect(url, name, creds)

"""Placement's handlers: create one or many sandboxes, look them up, list them, set quotas.

A create is admitted by the quotas, booked on the nodes through the shared ledger, written
as records (`scheduled`) and only then handed to the nodes, so a sandbox that was accepted
is never lost: if its node cannot be reached its record ends `failed`. A gang batch
(`wait=False`) is answered as soon as every sandbox is placed and recorded; its launches go
on per node, in parallel, and the caller follows their events. A single create of a warm
pool's shape first tries to claim a spare a node built ahead (pools.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import nats.errors

from sandfleet import errors, metrics, telemetry
from sandfleet.allow_rules import parse_allow
from sandfleet.bus import CALLER_TENANT, Bus
from sandfleet.errors import ServiceError
from sandfleet.store import BatchRefused, SandboxStore
from sandfleet.telemetry import NODE_ID, SANDBOX_ID
from schemas import node as node_schema
from schemas.errors import ErrorCode
from schemas.sandbox import (
    BATCH_TOKEN_HEX,
    ENDED,
    CreateManyReply,
    CreateManyRequest,
    CreateReply,
    CreateRequest,
    GetRequest,
    ListRequest,
    NodePlacement,
    Quota,
    QuotaGetRequest,
    QuotaState,
    Reason,
    SandboxBatch,
    SandboxList,
    SandboxRecord,
    SandboxSpec,
    State,
)
from services.placement.ledger import Ledger
from services.placement.policy import NoCapacity, NodeView, NoEligibleNode, UnknownNode
from services.placement.pools import PoolBook, with_tenant
from services.placement.quotas import Quotas

log = logging.getLogger("sandfleet.placement")

LAUNCH_CHUNK = 500  # sandboxes per launch request: ~150 KB, well under the payload limit


@dataclass
class Deps:
    bus: Bus
    store: SandboxStore
    nodes: NodeView
    ledger: Ledger | None = None  # None: book in this replica's view only (tests of one replica)
    quotas: Quotas | None = None
    pools: PoolBook | None = None  # None: no warm pools (every create is cold)
    launches: set[asyncio.Task] = field(default_factory=set)  # gang-batch launches still going


def new_id() -> str:
    """An id of the one-record layout (tests store such records); placement's come from batches."""
    return "sb-" + secrets.token_hex(6)


def new_token() -> str:
    return secrets.token_hex(BATCH_TOKEN_HEX // 2)


async def _book(deps: Deps, spec: SandboxSpec, count: int, node: str | None = None) -> dict[str, int]:
    try:
        if deps.ledger is None:
            return deps.nodes.place(spec, count, time.time(), node=node)
        return await deps.ledger.book(spec, count, time.time(), node=node)
    except UnknownNode as exc:
        raise ServiceError(ErrorCode.NOT_FOUND, str(exc)) from None
    except NoEligibleNode as exc:
        raise ServiceError(ErrorCode.UNSUPPORTED, str(exc)) from None
    except NoCapacity as exc:
        raise ServiceError(ErrorCode.CAPACITY, str(exc)) from None


def _spec_of(req: CreateRequest) -> SandboxSpec:
    return SandboxSpec(**{f: getattr(req, f) for f in SandboxSpec.__struct_fields__})


def _check_allow(spec: SandboxSpec) -> None:
    """A bad egress rule is the creator's error: refuse it before a record or a node is
    involved, whoever sent the request (the SDK checks too, but any NATS client may call)."""
    try:
        parse_allow(spec.allow)
    except ValueError as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(exc)) from None


Stored = tuple[SandboxRecord, int]  # a record and its KV revision


@dataclass(frozen=True)
class Placed:
    """One batch record as stored, and what a node is sent in one launch: its members' records
    (revision 0: no own record yet)."""

    batch: SandboxBatch
    members: list[Stored]


Announce = Callable[[], Awaitable[bool]]  # stores a batch's first events; False: it could not, the batch is given back


async def _place(deps: Deps, spec: SandboxSpec, count: int, node: str | None = None, restored_from: str = "",
                 announce_later: bool = False, tenant: str | None = None, admitted: list[str] | None = None
                 ) -> tuple[list[Placed], Announce | None]:
    """Admit, book and record `count` sandboxes (on `node` only, if given) as batch records of at
    most LAUNCH_CHUNK, one launch each. `announce_later`: return once the records are stored, with what
    stores their `scheduled` events, to await before handing any of them to a node (a gang
    batch is answered first: its events then do not hold the answer back). Their tenant is the
    caller's as the server vouched for it, unless given; `admitted`: the quota keys it was
    admitted under already."""
    _check_allow(spec)
    owner = tenant if tenant is not None else (CALLER_TENANT.get() or "")
    if spec.build and owner:  # refused before anything is stored (the launcher refuses it too)
        raise ServiceError(ErrorCode.FORBIDDEN, "a build sandbox (build=true) is the platform's own "
                                                f"(sandfleet layer build); tenant {owner} may not ask for one")
    spec = with_tenant(spec, owner)
    now = time.time()
    if admitted is not None:  # a claim that found no spare admitted it already
        quota_keys = admitted
    else:
        quota_keys = await deps.quotas.admit(spec, count, now) if deps.quotas else []
    try:
        with telemetry.phase("placement.decide", {telemetry.ISOLATION: spec.isolation, "sandfleet.count": count}):
            plan = await _book(deps, spec, count, node)
    except ServiceError:
        if deps.quotas:
            await deps.quotas.give_back(quota_keys, count)
        raise
    # One batch record per launch (a node's share, LAUNCH_CHUNK at a time): one stored message
    # where there was one per sandbox; each sandbox's own record is written by its first change.
    batches = [SandboxBatch(token=new_token(), node=node_id, spec=spec, count=min(LAUNCH_CHUNK, k - start),
                            created_at=now, restored_from=restored_from, tenant=owner)
               for node_id, k in plan.items() for start in range(0, k, LAUNCH_CHUNK)]
    try:
        if deps.quotas and quota_keys:
            await deps.quotas.remember([(i, b.node) for b in batches for i in b.ids()], quota_keys)
        if announce_later:
            written, store_events = await deps.store.record_batches(batches)
        else:
            written, store_events = await deps.store.create_batches(batches), None
    except (ServiceError, errors.SandfleetError, OSError) as exc:
        await _unplace(deps, spec, plan, [r for b in batches for r in b.records()], quota_keys, exc)
        raise ServiceError(ErrorCode.INTERNAL, f"could not record the batch: {exc}") from None
    placed = [Placed(batch, members) for batch, members in zip(batches, written)]
    announce: Announce | None = None
    if store_events is not None:
        async def announce() -> bool:
            try:
                await store_events()
                return True
            except (ServiceError, errors.SandfleetError, OSError) as exc:
                await _unplace(deps, spec, plan, [r for p in placed for r, _ in p.members], quota_keys, exc)
                return False
    return placed, announce


async def _unplace(deps: Deps, spec, plan, records, quota_keys, exc) -> None:  # type: ignore[no-untyped-def]
    """Nothing was handed to a node: give every booking back and end whatever got recorded."""
    log.warning("recording a batch of %d failed: %s", len(records), exc)
    if deps.ledger is not None:
        await deps.ledger.release(plan, spec)
    if deps.quotas and quota_keys:
        await deps.quotas.forget_members([(r.id, r.node) for r in records])
        await deps.quotas.give_back(quota_keys, len(records))
    refused = exc.refused if isinstance(exc, BatchRefused) else {}
    for r in records:
        if r.id in refused:  # not written: the record under that id, if any, is another sandbox's
            continue
        detail = "placement could not record the batch"
        try:
            await deps.store.transition(r.id, State.FAILED, Reason.LAUNCH_FAILED, detail,
                                        only_from=frozenset({State.SCHEDULED}))
        except ServiceError as refusal:
            if refusal.code is ErrorCode.NOT_FOUND:  # never stored, though its `scheduled` event may be
                await deps.store.end_unrecorded(r, Reason.LAUNCH_FAILED, detail)


async def create(deps: Deps, req: CreateRequest) -> CreateReply:
    started, outcome = time.monotonic(), "failed"
    try:
        spec, admitted = _spec_of(req), None
        if deps.pools is not None:
            _check_allow(spec)
            claimed, admitted = await deps.pools.claim_admitted(deps.nodes, deps.quotas, spec,
                                                                CALLER_TENANT.get() or "", req.node)
            if claimed is not None:
                telemetry.current_attributes(telemetry.sandbox_attributes(claimed.id, claimed.node, spec))
                outcome = "ok"
                return claimed
        (placed,), _ = await _place(deps, spec, 1, req.node, admitted=admitted)
        node_id, record = placed.batch.node, placed.members[0][0]
        telemetry.current_attributes(telemetry.sandbox_attributes(record.id, node_id, spec))
        telemetry.state_changed(State.SCHEDULED.value)
        created = await _launch_on(deps, placed)
        result = created[0]
        if not result.ok:
            raise ServiceError(result.code, f"launch failed on {node_id}: {result.error}")
        outcome = "ok"
        return CreateReply(id=result.id, node=node_id)
    finally:
        metrics.CREATES.observe(time.monotonic() - started, isolation=req.isolation, outcome=outcome)


async def create_many(deps: Deps, req: CreateManyRequest) -> CreateManyReply:
    started = time.monotonic()
    claimed, admitted = [], None  # spares of a warm pool of the batch's shape go first; the rest is built cold
    if deps.pools is not None:
        _check_allow(req.spec)
        claimed, admitted = await deps.pools.claim_many_admitted(deps.nodes, deps.quotas, req.spec,
                                                                 CALLER_TENANT.get() or "", req.count)
        for _ in claimed:
            metrics.CREATES.observe(time.monotonic() - started, isolation=req.spec.isolation, outcome="ok")
    rest = req.count - len(claimed)
    # A large gang batch is answered once its records are stored: its events follow them
    # (before any launch), instead of sharing the server with them while the caller waits.
    placed, announce = await _place(deps, req.spec, rest, announce_later=not req.wait and rest > LAUNCH_CHUNK,
                                    admitted=admitted) if rest else ([], None)
    launches = [(p.batch.node, _launch_on(deps, p, waited=req.wait)) for p in placed]
    if not req.wait:
        task = asyncio.create_task(_launch_after_reply(deps, [coro for _, coro in launches],
                                                       flush_first=rest > LAUNCH_CHUNK, announce=announce))
        deps.launches.add(task)
        task.add_done_callback(deps.launches.discard)
        by_node: dict[str, list[str]] = {}
        for sandbox_id, node_id in claimed:
            by_node.setdefault(node_id, []).append(sandbox_id)
        for p in placed:
            by_node.setdefault(p.batch.node, []).extend(r.id for r, _ in p.members)
        return CreateManyReply(placements=[NodePlacement(node=n, ids=ids) for n, ids in by_node.items()])
    done = await asyncio.gather(*(coro for _, coro in launches))
    seconds = time.monotonic() - started  # each waited for the whole batch
    for results in done:
        for result in results:
            metrics.CREATES.observe(seconds, isolation=req.spec.isolation, outcome="ok" if result.ok else "failed")
    sandboxes, failures = [CreateReply(id=i, node=n) for i, n in claimed], []
    for (node_id, _), results in zip(launches, done):
        for result in results:
            if result.ok:
                sandboxes.append(CreateReply(id=result.id, node=node_id))
            else:
                failures.append(f"{result.id}: {result.error}")
    return CreateManyReply(sandboxes=sandboxes, failed=len(failures), errors=failures[:20])


async def _launch_after_reply(deps: Deps, launches: list, flush_first: bool = True,  # type: ignore[type-arg]
                              announce: Announce | None = None) -> None:
    """A gang batch's launches, once its reply has left: the reply is queued on the connection
    when this starts, so launches written after it reach the server after it. `flush_first`
    (a PING answered after the reply) keeps up to ~20 MB of launch requests from being encoded
    ahead of the reply's write; a batch of one launch request is encoded in well under a
    millisecond, and waiting a round trip for it would lengthen every steady batch. `announce`:
    the batch's `scheduled` events, stored after the reply has left and before any launch (if
    they cannot be, nothing is launched and the batch ends failed)."""
    if flush_first:
        try:
            await deps.bus.nc.flush()
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("flush before launching a batch failed (%s); launching anyway", exc)
    if announce is not None and not await announce():
        for launch in launches:
            launch.close()  # never started: nothing of the batch reaches a node
        return
    await asyncio.gather(*launches)


async def _launch_on(deps: Deps, placed: Placed, waited: bool = True) -> list[node_schema.LaunchResult]:
    """Ask the batch's node to launch it, in one message that is its batch record; `waited`: a
    caller waits for the answer, so what the node cannot start before this request times out
    must end failed there, not start for nobody."""
    node_id, timeout = placed.batch.node, 30 + 0.05 * placed.batch.count
    answer_by = time.time() + timeout - 1.0 if waited else 0.0
    request = node_schema.LaunchRequest(batch=placed.batch, answer_by=answer_by)
    records = [r for r, _ in placed.members]
    try:
        reply = await deps.bus.request(
            node_schema.subject(node_id, node_schema.LAUNCH),
            request,
            node_schema.LaunchReply,
            timeout=timeout,
        )
        return reply.results
    except errors.SandfleetError as exc:
        # The node never took them (or never answered): they must not stay `scheduled` forever.
        log.warning("launch on %s failed: %s", node_id, exc, extra={NODE_ID: node_id})
        if isinstance(exc, errors.NoResponders) and deps.ledger is not None:
            await deps.ledger.release({node_id: len(records)}, records[0].spec)  # it surely took none
        await asyncio.gather(*(_fail(deps, r.id, f"node {node_id}: {exc}", Reason.LAUNCH_FAILED, only_scheduled=True)
                               for r in records))
        if waited and isinstance(exc, errors.Timeout):
            return await _settled_without_reply(deps, node_id, records, str(exc))
        return [node_schema.LaunchResult(id=r.id, ok=False, error=str(exc)) for r in records]


SETTLE_WITHOUT_REPLY_S = 20.0  # past the launch's timeout (30 s and more), within the SDK's create (60 s)


async def _settled_without_reply(deps: Deps, node_id: str, records: list[SandboxRecord], why: str
                                 ) -> list[node_schema.LaunchResult]:
    """A waited launch whose reply never came: its node's launcher may have died under the
    request and, restarted, built the sandboxes it had taken (a record it had claimed is the
    node's to finish: `starting` is never failed here). The caller is told what their records
    say once each has settled, so a sandbox that runs is never reported failed to its creator."""
    deadline = time.monotonic() + SETTLE_WITHOUT_REPLY_S
    while True:
        try:
            now = await deps.store.read_many([r.id for r in records])
        except (ServiceError, errors.SandfleetError) as exc:
            log.warning("cannot read the outcome of a launch on %s: %s", node_id, exc, extra={NODE_ID: node_id})
            now = {}
        pending = [i for i, (r, _) in now.items() if r.state in (State.SCHEDULED, State.STARTING)]
        if not pending or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    results = []
    for r in records:
        record = now[r.id][0] if r.id in now else None
        if record is not None and record.state is State.RUNNING:
            results.append(node_schema.LaunchResult(id=r.id, ok=True))
        else:
            detail = record.detail if record is not None and record.detail else why
            results.append(node_schema.LaunchResult(id=r.id, ok=False, error=detail))
    return results


async def _fail(deps: Deps, sandbox_id: str, detail: str, reason: Reason, only_scheduled: bool = False) -> bool:
    """`only_scheduled`: a launch whose reply was lost may still have started the sandbox; the
    node owns it from `starting` on, so placement must not fail a running one."""
    try:
        await deps.store.transition(sandbox_id, State.FAILED, reason, detail,
                                    only_from=frozenset({State.SCHEDULED}) if only_scheduled else None)
        return True
    except ServiceError:
        return False  # the node did act on it, or it ended meanwhile; its record says what happened


STUCK_AFTER_S = 120.0


async def fail_stuck(deps: Deps, now: float) -> list[str]:
    """End sandboxes that stayed `scheduled` with no launch (a placement replica died between
    writing the record and asking the node): accepted work is never left in limbo. The same
    pass purges the batch records no sandbox reads any longer."""
    spent: list[str] = []
    stuck = [r for r in await deps.store.all(spent=spent)
             if r.state is State.SCHEDULED and now - r.updated_at > STUCK_AFTER_S]
    failed = []
    for r in stuck:
        if await _fail(deps, r.id, "never launched", Reason.LAUNCH_FAILED, only_scheduled=True):
            failed.append(r.id)
    if spent:
        await deps.store.drop_batches(spent)
    return failed


async def fail_lost(deps: Deps, now: float) -> dict[str, int]:
    """Nodes whose heartbeats stopped: the one replica that marks each lost fails its sandboxes
    (reason `node_lost`); a node heard from again loses the mark."""
    if deps.ledger is None:
        return {}
    alive = set(deps.nodes.alive(now))
    reported: dict[str, int] = {}
    for node_id, booking in list(deps.nodes.bookings.items()):
        if node_id in alive:
            if booking.lost:
                await deps.ledger.mark_lost(node_id, False)
            continue
        if booking.lost or not await deps.ledger.mark_lost(node_id, True):
            continue
        records = [r for r in await deps.store.all(node_id) if r.state not in ENDED]
        reported[node_id] = sum(await asyncio.gather(*(_lose(deps, r) for r in records)))
    return reported


async def _lose(deps: Deps, record: SandboxRecord) -> bool:
    """End a sandbox of a lost node (`failed`, reason `node_lost`). One with a checkpoint is first
    started again from it on another node, and the failed event names the new one."""
    detail = f"node {record.node} stopped sending heartbeats"
    restored: CreateReply | None = None
    if record.checkpoint:
        try:
            restored = await _restore(deps, record)
            detail += f"; restored from its checkpoint as {restored.id} on {restored.node}"
        except Exception as exc:  # whatever went wrong, the lost one must still be reported
            if not isinstance(exc, (ServiceError, errors.SandfleetError)):
                log.exception("restoring %s from its checkpoint failed", record.id)
            detail += f"; its checkpoint could not be restored: {getattr(exc, 'message', None) or exc}"
    if await _fail(deps, record.id, detail, Reason.NODE_LOST):
        return True
    if restored is not None:  # it ended some other way meanwhile: nobody wants the copy
        await _destroy_quietly(deps, restored)
    return False


async def _restore(deps: Deps, record: SandboxRecord) -> CreateReply:
    """A new sandbox from `record`'s latest checkpoint: its spec, on its checkpoint's layers,
    wherever placement finds room (the lost node takes nothing)."""
    spec = msgspec.structs.replace(record.spec, layers=list(record.checkpoint), host_view=False)
    (placed,), _ = await _place(deps, spec, 1, restored_from=record.id, tenant=record.tenant)
    node_id = placed.batch.node
    (result,) = await _launch_on(deps, placed)
    if not result.ok:
        raise ServiceError(result.code, f"launch failed on {node_id}: {result.error}")
    return CreateReply(id=result.id, node=node_id)


async def _destroy_quietly(deps: Deps, sandbox: CreateReply) -> None:
    try:
        await deps.bus.request(node_schema.subject(sandbox.node, node_schema.DESTROY),
                               node_schema.DestroyRequest(sandbox_id=sandbox.id), node_schema.DestroyReply, timeout=30)
    except errors.SandfleetError as exc:
        log.warning("could not destroy %s, restored for a sandbox that ended meanwhile: %s", sandbox.id, exc,
                    extra={SANDBOX_ID: sandbox.id, NODE_ID: sandbox.node})


async def get(deps: Deps, req: GetRequest) -> SandboxRecord:
    record, _ = await deps.store.get(req.id)
    tenant = CALLER_TENANT.get()
    if tenant is not None and record.tenant != tenant:  # another's is, to a tenant, no sandbox at all
        raise ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {req.id}")
    return record


async def list_sandboxes(deps: Deps, req: ListRequest) -> SandboxList:
    found = await deps.store.all(req.node, req.include_ended)
    tenant = CALLER_TENANT.get()
    return SandboxList(sandboxes=found if tenant is None else [r for r in found if r.tenant == tenant])


async def set_quota(deps: Deps, req: Quota) -> QuotaState:
    if deps.quotas is None:
        raise ServiceError(ErrorCode.UNSUPPORTED, "this placement keeps no quotas")
    return await deps.quotas.set(req)


async def get_quota(deps: Deps, req: QuotaGetRequest) -> QuotaState:
    if deps.quotas is None:
        raise ServiceError(ErrorCode.UNSUPPORTED, "this placement keeps no quotas")
    return await deps.quotas.get(req)

"""Placement's handlers: create one or many sandboxes, look them up, list them.

A create writes the record (`scheduled`) before asking the node to launch, so a sandbox
that was accepted is never lost: if the node cannot be reached its record ends `failed`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

from sandfleet import errors
from sandfleet.bus import Bus
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas import node as node_schema
from schemas.errors import ErrorCode
from schemas.sandbox import (
    CreateManyReply,
    CreateManyRequest,
    CreateReply,
    CreateRequest,
    GetRequest,
    ListRequest,
    Reason,
    SandboxList,
    SandboxRecord,
    SandboxSpec,
    State,
)
from services.placement.policy import NoCapacity, NodeView, NoEligibleNode

log = logging.getLogger("sandfleet.placement")

LAUNCH_CHUNK = 200  # sandboxes per launch request, to keep messages well under the payload limit


@dataclass
class Deps:
    bus: Bus
    store: SandboxStore
    nodes: NodeView


def new_id() -> str:
    return "sb-" + secrets.token_hex(6)


def _plan(deps: Deps, spec: SandboxSpec, count: int) -> dict[str, int]:
    try:
        return deps.nodes.place(spec.isolation, count, time.time())
    except NoEligibleNode as exc:
        raise ServiceError(ErrorCode.UNSUPPORTED, str(exc)) from None
    except NoCapacity as exc:
        raise ServiceError(ErrorCode.CAPACITY, str(exc)) from None


def _spec_of(req: CreateRequest) -> SandboxSpec:
    return SandboxSpec(**{f: getattr(req, f) for f in SandboxSpec.__struct_fields__})


async def create(deps: Deps, req: CreateRequest) -> CreateReply:
    spec = _spec_of(req)
    (node_id,) = _plan(deps, spec, 1)
    created = await _launch_on(deps, node_id, [await _schedule(deps, node_id, spec)])
    if not created:
        raise ServiceError(ErrorCode.CAPACITY, "the node could not start the sandbox")
    result = created[0]
    if not result.ok:
        raise ServiceError(result.code, f"launch failed on {node_id}: {result.error}")
    return CreateReply(id=result.id, node=node_id)


async def create_many(deps: Deps, req: CreateManyRequest) -> CreateManyReply:
    plan = _plan(deps, req.spec, req.count)
    launches = []
    for node_id, count in plan.items():
        records = await asyncio.gather(*(_schedule(deps, node_id, req.spec) for _ in range(count)))
        for start in range(0, len(records), LAUNCH_CHUNK):
            launches.append((node_id, _launch_on(deps, node_id, records[start : start + LAUNCH_CHUNK])))
    done = await asyncio.gather(*(coro for _, coro in launches))
    sandboxes, failures = [], []
    for (node_id, _), results in zip(launches, done):
        for result in results:
            if result.ok:
                sandboxes.append(CreateReply(id=result.id, node=node_id))
            else:
                failures.append(f"{result.id}: {result.error}")
    return CreateManyReply(sandboxes=sandboxes, failed=len(failures), errors=failures[:20])


async def _schedule(deps: Deps, node_id: str, spec: SandboxSpec) -> SandboxRecord:
    now = time.time()
    record = SandboxRecord(
        id=new_id(), node=node_id, spec=spec, state=State.SCHEDULED, created_at=now, updated_at=now
    )
    return await deps.store.create(record)


async def _launch_on(deps: Deps, node_id: str, records: list[SandboxRecord]) -> list[node_schema.LaunchResult]:
    request = node_schema.LaunchRequest(
        sandboxes=[node_schema.LaunchItem(id=r.id, spec=r.spec) for r in records]
    )
    try:
        reply = await deps.bus.request(
            node_schema.subject(node_id, node_schema.LAUNCH),
            request,
            node_schema.LaunchReply,
            timeout=30 + 0.05 * len(records),
        )
        return reply.results
    except errors.SandfleetError as exc:
        # The node never took them (or never answered): they must not stay `scheduled` forever.
        log.warning("launch on %s failed: %s", node_id, exc)
        for r in records:
            try:
                await deps.store.transition(r.id, State.FAILED, Reason.LAUNCH_FAILED, f"node {node_id}: {exc}")
            except ServiceError:
                pass  # the node did act on it after all; its record says what happened
        return [node_schema.LaunchResult(id=r.id, ok=False, error=str(exc)) for r in records]


STUCK_AFTER_S = 120.0


async def fail_stuck(deps: Deps, now: float) -> list[str]:
    """End sandboxes that stayed `scheduled` with no launch (a placement replica died between
    writing the record and asking the node): accepted work is never left in limbo."""
    stuck = [r for r in await deps.store.all() if r.state is State.SCHEDULED and now - r.updated_at > STUCK_AFTER_S]
    failed = []
    for r in stuck:
        try:
            await deps.store.transition(r.id, State.FAILED, Reason.LAUNCH_FAILED, "never launched")
            failed.append(r.id)
        except ServiceError:
            pass  # launched or ended meanwhile, or another replica got there first
    return failed


async def get(deps: Deps, req: GetRequest) -> SandboxRecord:
    record, _ = await deps.store.get(req.id)
    return record


async def list_sandboxes(deps: Deps, req: ListRequest) -> SandboxList:
    return SandboxList(sandboxes=await deps.store.all(req.node, req.include_ended))

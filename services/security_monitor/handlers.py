"""The monitor's handlers: policy requests from trainers, and one violation from the stream.

A violation is counted into its sandbox's record first (idempotently); a violation of a tenant's
sandbox is then copied to that tenant's subject (the only one its account sees), de-duplicated
by the violation's stream sequence; an action that
record has pending is then carried out on the sandbox's node (`node.v1.<node>.destroy` with
reason `violation`, or `node.v1.<node>.quarantine`), announced once as an event, and marked
done. A crash anywhere in between leaves the action pending, so the redelivered violation
finishes it; the node's verbs are idempotent and the event is de-duplicated by its message id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from sandfleet import errors, metrics
from sandfleet.bus import Bus
from sandfleet.telemetry import SANDBOX_ID
from schemas import node as node_schema
from schemas import security, violations
from schemas.node import DestroyReply, DestroyRequest, QuarantineReply, QuarantineRequest
from schemas.sandbox import Reason
from schemas.security import Policy, PolicyGetRequest, PolicyList, PolicyListRequest, SandboxGetRequest, SandboxSecurity
from schemas.violations import Violation
from services.security_monitor import policy as rules
from services.security_monitor.state import Ledger, Owners, Policies

log = logging.getLogger("sandfleet.security")

NODE_TIMEOUT_S = 30.0


@dataclass
class Deps:
    bus: Bus
    policies: Policies
    ledger: Ledger
    owners: Owners


# -- requests ------------------------------------------------------------------------------


async def set_policy(deps: Deps, req: Policy) -> Policy:
    stored = msgspec.structs.replace(req, updated_at=time.time())
    await deps.policies.put(stored)
    log.info("policy of task %s: %s %s (default %d)", req.task, req.action, req.thresholds, req.default_threshold)
    return stored


async def get_policy(deps: Deps, req: PolicyGetRequest) -> Policy:
    return await deps.policies.get(req.task)


async def list_policies(deps: Deps, req: PolicyListRequest) -> PolicyList:
    return PolicyList(policies=await deps.policies.all())


async def get_sandbox(deps: Deps, req: SandboxGetRequest) -> SandboxSecurity:
    record, _ = await deps.ledger.get(req.sandbox_id)
    return record


# -- the stream ----------------------------------------------------------------------------


async def on_violation(deps: Deps, violation: Violation, seq: int) -> SandboxSecurity:
    """Count one violation (stream sequence `seq`) and carry out whatever action it makes due."""
    task = violation.labels.get("task", "")
    policy = await deps.policies.get(task)
    now = time.time()
    record, _ = await deps.ledger.update(
        violation.sandbox_id, lambda r: rules.count(r, violation, seq, policy, now)
    )
    tenant = await deps.owners.of(violation.sandbox_id)
    if tenant:
        subject = violations.tenant_subject(tenant, violation.node, violation.sandbox_id, violation.kind)
        await deps.bus.publish_durable(subject, violation, msg_id=f"{violation.sandbox_id}:{seq}")
    if record.action_state == "pending":
        record = await _act(deps, record, policy, tenant)
    return record


async def _act(deps: Deps, record: SandboxSecurity, policy: Policy, tenant: str) -> SandboxSecurity:
    outcome = await _on_node(deps.bus, record)
    metrics.POLICY_ACTIONS.inc(action=record.action, outcome="done" if outcome == "done" else "not_done")
    event = rules.action_event(record, policy, outcome, time.time())
    msg_id = f"{record.sandbox_id}:{record.action}"
    await deps.bus.publish_durable(security.action_subject(record.sandbox_id, record.action), event, msg_id=msg_id)
    if tenant:
        await deps.bus.publish_durable(security.tenant_action_subject(tenant, record.sandbox_id, record.action), event,
                                       msg_id=f"{msg_id}:{tenant}")
    log.warning("sandbox %s: %s (%s): %s", record.sandbox_id, record.action, rules.detail(record), outcome,
                extra={SANDBOX_ID: record.sandbox_id})

    def done(r: SandboxSecurity) -> SandboxSecurity | None:
        return msgspec.structs.replace(r, action_state="done") if r.action_state == "pending" else None

    updated, _ = await deps.ledger.update(record.sandbox_id, done)
    return updated


async def _on_node(bus: Bus, record: SandboxSecurity) -> str:
    """Do the action on the sandbox's node; "done", or why the node refused (the sandbox had
    ended, or is ending). Lost contact with the node raises, so the violation is retried."""
    detail = rules.detail(record)[:1024]
    try:
        if record.action == "kill":
            subject = node_schema.subject(record.node, node_schema.DESTROY)
            request = DestroyRequest(sandbox_id=record.sandbox_id, reason=Reason.VIOLATION, detail=detail)
            await bus.request(subject, request, DestroyReply, timeout=NODE_TIMEOUT_S)
        else:
            subject = node_schema.subject(record.node, node_schema.QUARANTINE)
            request = QuarantineRequest(sandbox_id=record.sandbox_id, detail=detail)
            await bus.request(subject, request, QuarantineReply, timeout=NODE_TIMEOUT_S)
    except (errors.NotFound, errors.Conflict) as exc:
        return f"not done: {exc.message}"
    return "done"

"""Fleet calls about security: violation streams, the security monitor's per-task policies and
per-sandbox records, and what each node agent enforces."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import nats.errors
import nats.js.api

from sandfleet import errors
from sandfleet._whoami import live
from sandfleet.bus import Bus, decode
from schemas import events, node, security, violations
from schemas.security import Policy, SandboxSecurity, SecurityAction
from schemas.violations import Violation


class _FleetSecurity:
    """The security half of `Fleet` (mixed into it)."""

    bus: Bus

    tenant: Callable[[], Awaitable[str | None]]  # Fleet's: who the server says this connection is

    async def violations(
        self, sandbox_id: str | None = None, *, task: str | None = None, replay: bool = False, actions: bool = False
    ) -> AsyncIterator[Violation | SecurityAction]:
        """What sandboxes tried and were refused, as it happens (of one sandbox, or one task label);
        with `actions=True` also what the security monitor did about it (kill, quarantine), in order.
        With a tenant's credentials: its own sandboxes' only, live only (Unsupported for replay)."""
        tenant = await self.tenant()
        if tenant is not None:
            async for event in self._tenant_violations(tenant, sandbox_id, task, replay, actions):
                yield event
            return
        subject = violations.sandbox_filter(sandbox_id) if sandbox_id else violations.ALL
        subjects = [subject]
        if actions:
            subjects.append(security.actions_filter(sandbox_id) if sandbox_id else security.ALL_ACTIONS)
        policy = nats.js.api.DeliverPolicy.ALL if replay else nats.js.api.DeliverPolicy.NEW
        config = nats.js.api.ConsumerConfig(filter_subjects=subjects) if actions else None
        sub = await self.bus.js.subscribe(
            subject, stream=events.STREAM, ordered_consumer=True, deliver_policy=policy, config=config
        )
        try:
            async for msg in sub.messages:
                event = decode(msg.data, Violation | SecurityAction)
                if task is None or _task_of(event) == task:
                    yield event
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def _tenant_violations(self, tenant: str, sandbox_id: str | None, task: str | None, replay: bool,
                                 actions: bool) -> AsyncIterator[Violation | SecurityAction]:
        """The security monitor's copies of a tenant's violations (and actions), live."""
        if replay:
            raise errors.Unsupported("violations: a tenant sees its sandboxes' violations live, not the stored "
                                     "stream (replay is the operator's)")
        subjects = [violations.tenant_filter(tenant, sandbox_id or "*")]
        if actions:
            subjects.append(security.tenant_actions_filter(tenant, sandbox_id or "*"))
        async for msg in live(self.bus, subjects):
            event = decode(msg.data, Violation | SecurityAction)
            if task is None or _task_of(event) == task:
                yield event

    async def set_policy(
        self, *, task: str, action: str = "record", thresholds: dict[str, int] | None = None, default_threshold: int = 1
    ) -> Policy:
        """What the security monitor does to a sandbox labelled task=`task` that makes violations:
        `record`, `kill` or `quarantine` once a kind prefix reaches its threshold (`{"network": 3}`)."""
        raw = dict(task=task, action=action, thresholds=thresholds or {}, default_threshold=default_threshold)
        return await self.bus.request(security.POLICY_SET, raw, Policy)  # the monitor validates it

    async def get_policy(self, task: str) -> Policy:
        return await self.bus.request(security.POLICY_GET, dict(task=task), Policy)

    async def policies(self) -> list[Policy]:
        return (await self.bus.request(security.POLICY_LIST, {}, security.PolicyList)).policies

    async def security_record(self, sandbox_id: str) -> SandboxSecurity:
        """The monitor's counts for one sandbox and the action taken: a trainer zeroes the reward
        of a trajectory whose sandbox has any (`total > 0`)."""
        return await self.bus.request(security.SANDBOX_GET, dict(sandbox_id=sandbox_id), SandboxSecurity)

    async def security(self, node_id: str) -> node.NodeSecurity:
        """What the node agent of `node_id` enforces (eBPF egress, Landlock, AppArmor ...)."""
        return await self.bus.request(node.subject(node_id, node.SECURITY), node.Empty(), node.NodeSecurity)


def _task_of(event: Violation | SecurityAction) -> str | None:
    return event.task if isinstance(event, SecurityAction) else event.labels.get("task")

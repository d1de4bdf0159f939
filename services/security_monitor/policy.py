"""The monitor's decisions, with no I/O: which count a violation adds to, whether a sandbox has
crossed its task's threshold, and what the action event says.

Counting is idempotent by the violation's stream sequence: the monitor's consumer delivers at
least once (a crash before the ack redelivers, two replicas may race on one sandbox), so a
sandbox's record remembers the sequences it counted. It keeps the latest `SEEN_KEEP`; a
violation older than all of those is taken as counted, which can only be wrong for a sandbox
that made more than `SEEN_KEEP` violations while one of its earlier ones waited unacked.
An action is decided once per sandbox (`action_state` none → pending → done) and never again.
"""

from __future__ import annotations

import msgspec

from schemas.security import Policy, SandboxSecurity, SecurityAction
from schemas.violations import Violation

SEEN_KEEP = 512
RECENT_KEEP = 16


def default_policy(task: str) -> Policy:
    """What applies to a task nobody set a policy for (or a sandbox with no task label)."""
    return Policy(task=task, action="record")


def count_key(kind: str, thresholds: dict[str, int]) -> str:
    """The longest threshold key that is `kind` or a dotted prefix of it, else the kind's layer."""
    best = ""
    for key in thresholds:
        if (kind == key or kind.startswith(key + ".")) and len(key) > len(best):
            best = key
    return best or kind.split(".", 1)[0]


def threshold(policy: Policy, key: str) -> int:
    """How many violations under `key` trigger the action; 0 means never."""
    return policy.thresholds.get(key, policy.default_threshold)


def already_counted(record: SandboxSecurity, seq: int) -> bool:
    if seq in record.seen:
        return True
    return len(record.seen) >= SEEN_KEEP and seq < record.seen[0]


def count(
    record: SandboxSecurity, violation: Violation, seq: int, policy: Policy, now: float
) -> SandboxSecurity | None:
    """The record after counting one violation, with an action pending if it crossed the
    threshold; None if this violation was counted before."""
    if already_counted(record, seq):
        return None
    key = count_key(violation.kind, policy.thresholds)
    counts = {**record.counts, key: record.counts.get(key, 0) + 1}
    updated = msgspec.structs.replace(
        record,
        node=violation.node,
        task=violation.labels.get("task", ""),
        counts=counts,
        total=record.total + 1,
        seen=sorted([*record.seen, seq])[-SEEN_KEEP:],
        recent=[*record.recent, violation][-RECENT_KEEP:],
        updated_at=now,
    )
    if record.action_state == "none" and policy.action != "record":
        limit = threshold(policy, key)
        if limit > 0 and counts[key] >= limit:
            updated = msgspec.structs.replace(updated, action=policy.action, action_state="pending", trigger=key)
    return updated


def detail(record: SandboxSecurity) -> str:
    """The reason text the sandbox's lifecycle event carries."""
    n = record.counts.get(record.trigger, 0)
    return f"security policy of task {record.task!r}: {record.action} after {n} {record.trigger} violation(s)"


def action_event(record: SandboxSecurity, policy: Policy, outcome: str, now: float) -> SecurityAction:
    """The event for a pending action, carrying the recent violations that counted toward it."""
    thresholds = policy.thresholds
    return SecurityAction(
        sandbox_id=record.sandbox_id,
        node=record.node,
        task=record.task,
        action=record.action,
        trigger=record.trigger,
        count=record.counts.get(record.trigger, 0),
        threshold=threshold(policy, record.trigger),
        violations=[v for v in record.recent if count_key(v.kind, thresholds) == record.trigger],
        outcome=outcome,
        at=now,
    )

"""The security monitor's subjects: per-task policies a trainer sets, what the monitor knows of
each sandbox, and the action events it publishes (`events.v1.security.<sandbox>.<action>`,
kept by the EVENTS stream beside the violations that caused them).

A policy names what happens to a sandbox of a task (its `task` label) once it has made enough
violations: `record` (nothing but the audit trail), `kill` (destroyed, ends `failed` with
reason `violation`) or `quarantine` (frozen, kept `paused` with its files for forensics).
Thresholds count per sandbox per kind prefix: `{"network": 3}` acts on the third
`network.*` violation; kinds no key matches count under their first token (`file.landlock`
under `file`) against `default_threshold`; a threshold of 0 never acts.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.violations import Violation

POLICY_SET = "security.v1.policy.set"
POLICY_GET = "security.v1.policy.get"
POLICY_LIST = "security.v1.policy.list"
SANDBOX_GET = "security.v1.sandbox.get"
ALL = "security.v1.>"  # every command the security monitor serves

SERVICE = "security-monitor"
QUEUE_GROUP = "security-monitor"
CONSUMER = "security-monitor"  # the durable JetStream consumer every replica shares
POLICY_BUCKET = "security-policies"
SANDBOX_BUCKET = "security-sandboxes"
SANDBOX_MAX_AGE_S = 8 * 24 * 3600  # longer than any sandbox lives (timeout_s <= 7 days)

ALL_ACTIONS = "events.v1.security.>"
VERSION = 1

Action = Literal["record", "kill", "quarantine"]
TaskName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
KindPrefix = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")]
Threshold = Annotated[int, Meta(ge=0, le=1_000_000)]

# Past tense in the subject, as for lifecycle events.
ACTION_EVENT = {"kill": "killed", "quarantine": "quarantined"}


def action_subject(sandbox_id: str, action: str) -> str:
    return f"events.v1.security.{sandbox_id}.{ACTION_EVENT[action]}"


def actions_filter(sandbox_id: str) -> str:
    return f"events.v1.security.{sandbox_id}.*"


# A tenant's copy of the actions on its sandboxes (as for violations: schemas/violations.py).
def tenant_action_subject(tenant: str, sandbox_id: str, action: str) -> str:
    return f"events.v2.security.{tenant}.{sandbox_id}.{ACTION_EVENT[action]}"


def tenant_actions_filter(tenant: str, sandbox_id: str = "*") -> str:
    return f"events.v2.security.{tenant}.{sandbox_id}.*"


class Policy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The KV value under `security-policies/<task>`, and the body of `security.v1.policy.set`."""

    task: TaskName
    action: Action = "record"
    thresholds: Annotated[dict[KindPrefix, Threshold], Meta(max_length=64)] = {}
    default_threshold: Threshold = 1
    updated_at: float = 0.0


class PolicyGetRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    task: TaskName


class PolicyListRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class PolicyList(msgspec.Struct, frozen=True, kw_only=True):
    policies: list[Policy]


class SandboxGetRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9\-]*$")]


ActionState = Literal["none", "pending", "done"]


class SandboxSecurity(msgspec.Struct, frozen=True, kw_only=True):
    """What the monitor knows of one sandbox: the KV value under `security-sandboxes/<id>`
    (revision-checked), and the reply of `security.v1.sandbox.get`.

    `seen` holds the stream sequences of the latest violations counted, so a redelivered
    violation (after a monitor crash) or one handled by two replicas is counted once.
    """

    sandbox_id: str
    node: str = ""
    task: str = ""
    counts: dict[str, int] = {}
    total: int = 0
    seen: list[int] = []
    recent: list[Violation] = []
    action: Action = "record"
    action_state: ActionState = "none"
    trigger: str = ""  # the count key that crossed its threshold
    updated_at: float = 0.0


class SecurityAction(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="security.action"):
    """Published once per acted-on sandbox on `events.v1.security.<sandbox>.<killed|quarantined>`."""

    v: int = VERSION
    sandbox_id: str
    node: str
    task: str
    action: Action
    trigger: str
    count: int
    threshold: int
    violations: list[Violation]
    outcome: str  # "done", or why the node could not do it (e.g. the sandbox had already ended)
    at: float

"""Lifecycle events, published on `events.v2.sandbox.<tenant>.<id>.<event>` and kept in one stream.

Each event is a tagged Struct; `seq` counts the events of one sandbox (1, 2, ...) so a
consumer can tell when it missed one; the stream sequence orders events across sandboxes.

v2 put the sandbox's tenant into the subject (v1, `events.v1.sandbox.<id>.<event>`, had none),
so the bus itself can hand a tenant its own events and no one else's: each tenant's account
imports `events.v2.sandbox.<its name>.>` and nothing else. Every consumer moved with it (one
stored message per transition, as before, instead of a v1 and a v2 copy of each). A sandbox of
no tenant (made from inside the platform's account) has the token `_`, which no tenant name
can be (they start with a letter or digit).
"""

from __future__ import annotations

import msgspec

from schemas.sandbox import Reason, State

STREAM = "EVENTS"
STREAM_SUBJECTS = ["events.v1.>", "events.v2.>"]  # v1: violations, reclaim, security, layer events
ALL = "events.v1.>"
ALL_SANDBOX = "events.v2.sandbox.>"
VERSION = 2
ANY = "*"
NO_TENANT = "_"  # the subject token of a sandbox made from inside the platform's account


def tenant_token(tenant: str) -> str:
    return tenant or NO_TENANT


def sandbox_subject(sandbox_id: str, event: str, tenant: str = ANY) -> str:
    """`event` of `sandbox_id` (either may be `*`) of `tenant` (a name, `_` for none, or `*`: any)."""
    return f"events.v2.sandbox.{tenant}.{sandbox_id}.{event}"


def sandbox_filter(sandbox_id: str, tenant: str = ANY) -> str:
    return f"events.v2.sandbox.{tenant}.{sandbox_id}.>"


def sandbox_id_of(subject: str) -> str:
    """The sandbox id a lifecycle event's subject names (`events.v2.sandbox.<tenant>.<id>.<event>`)."""
    return subject.split(".")[4]


def tenant_filter(tenant: str) -> str:
    """Every lifecycle event of one tenant's sandboxes: what its account imports."""
    return f"events.v2.sandbox.{tenant}.>"


class SandboxEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = VERSION
    sandbox_id: str
    node: str
    tenant: str = ""  # the record's: "" for a sandbox of no tenant
    state: State
    seq: int
    at: float
    reason: Reason = Reason.NONE
    detail: str = ""

    @property
    def name(self) -> str:
        return type(self).__struct_config__.tag.rsplit(".", 1)[-1]

    @property
    def subject(self) -> str:
        return sandbox_subject(self.sandbox_id, self.name, tenant_token(self.tenant))


class Scheduled(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.scheduled"):
    pass


class Starting(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.starting"):
    pass


class Started(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.started"):
    pass


class Paused(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.paused"):
    pass


class Resumed(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.resumed"):
    pass


class Stopping(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.stopping"):
    pass


class Stopped(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.stopped"):
    pass


class Failed(SandboxEvent, frozen=True, kw_only=True, tag="sandbox.failed"):
    pass


AnySandboxEvent = Scheduled | Starting | Started | Paused | Resumed | Stopping | Stopped | Failed

_EVENT_FOR_STATE: dict[State, type[SandboxEvent]] = {
    State.SCHEDULED: Scheduled,
    State.STARTING: Starting,
    State.RUNNING: Started,
    State.PAUSED: Paused,
    State.STOPPING: Stopping,
    State.STOPPED: Stopped,
    State.FAILED: Failed,
}


def event_type(previous: State | None, new: State) -> type[SandboxEvent]:
    """The event a transition publishes: a return from `paused` is `resumed`, not `started`."""
    if previous is State.PAUSED and new is State.RUNNING:
        return Resumed
    return _EVENT_FOR_STATE[new]

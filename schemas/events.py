"""Lifecycle events, published on `events.v3.sandbox.<tenant>.<node>.<id>.<event>` and kept in one stream.

Each event is a tagged Struct; `seq` counts the events of one sandbox (1, 2, ...) so a
consumer can tell when it missed one; the stream sequence orders events across sandboxes.

v2 put the sandbox's tenant into the subject, so the bus itself hands a tenant its own events
and no one else's: each tenant's account imports `events.v3.sandbox.<its name>.>` and nothing
else. v3 puts the sandbox's node right after it, so the bus also tells who may say what: a
node's user may publish `events.v3.sandbox.*.<its id>.>` only (the events of sandboxes under its
own name), and the node token of an event a consumer receives is one the server checked against
its publisher. Tenant first, node second: both the tenant's import and the node's permission
are one wildcard subject each. A node can still publish an event naming *another* node's sandbox
id under its own token, so a consumer that acts on an event checks the event's node against the
sandbox's (`vouched`; the SDK's waits, placement's quota release). Every consumer moved with it
(one stored message per transition; nothing publishes `events.v2.sandbox.` any more).

Reserved tokens: a sandbox of no tenant (made from inside the platform's account) has the tenant
token `_`, which no tenant name can be (they start with a letter or digit); an event placement
publishes for a sandbox without a node has the node token `_` (`PLACEMENT_NODE`), which no node
id can be (`NodeId` starts with a letter or digit; `bus_accounts` refuses credentials for one),
so only placement, which may publish every lifecycle subject, publishes under it.
"""

from __future__ import annotations

import msgspec

from schemas.sandbox import Reason, State

STREAM = "EVENTS"
# v1: violations, reclaim, security, layer events; v2: the security monitor's tenant copies of
# violations and actions (schemas/violations.py, security.py); v3: lifecycle events.
STREAM_SUBJECTS = ["events.v1.>", "events.v2.>", "events.v3.>"]
ALL = "events.v1.>"
ALL_SANDBOX = "events.v3.sandbox.>"
VERSION = 3
ANY = "*"
NO_TENANT = "_"  # the subject token of a sandbox made from inside the platform's account
PLACEMENT_NODE = "_"  # the node token of an event of a sandbox without a node: placement's alone


def tenant_token(tenant: str) -> str:
    return tenant or NO_TENANT


def node_token(node: str) -> str:
    return node or PLACEMENT_NODE


def sandbox_subject(sandbox_id: str, event: str, tenant: str = ANY, node: str = ANY) -> str:
    """`event` of `sandbox_id` (either may be `*`) of `tenant` (a name, `_` for none, or `*`: any)
    on `node` (an id, `_` for none, or `*`: any)."""
    return f"events.v3.sandbox.{tenant}.{node}.{sandbox_id}.{event}"


def sandbox_filter(sandbox_id: str, tenant: str = ANY, node: str = ANY) -> str:
    return f"events.v3.sandbox.{tenant}.{node}.{sandbox_id}.>"


def sandbox_id_of(subject: str) -> str:
    """The sandbox id a lifecycle event's subject names (`events.v3.sandbox.<tenant>.<node>.<id>.<event>`)."""
    return subject.split(".")[5]


def node_of(subject: str) -> str:
    """The node a lifecycle event's subject names ("" for placement's token): the server checked
    it against the publisher's permissions, unlike anything in the body."""
    token = subject.split(".")[4]
    return "" if token == PLACEMENT_NODE else token


def tenant_filter(tenant: str) -> str:
    """Every lifecycle event of one tenant's sandboxes: what its account imports."""
    return f"events.v3.sandbox.{tenant}.>"


def node_filter(node: str) -> str:
    """Every lifecycle event of sandboxes under `node`'s name: all a node may publish."""
    return f"events.v3.sandbox.*.{node}.>"


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
        return sandbox_subject(self.sandbox_id, self.name, tenant_token(self.tenant), node_token(self.node))


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


def vouched(event: SandboxEvent, subject: str, node: str | None = None) -> bool:
    """Whether `event` may be believed as it arrived on `subject`: its body says what the subject
    says (so its `node` is the one the server checked the publisher against), and, given the
    sandbox's `node` (its record's, or the placement reply's), it is that node's or placement's
    own (an event another node sent under its own name about this sandbox is a forgery)."""
    if event.subject != subject:
        return False
    return node is None or event.node in (node, "")


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

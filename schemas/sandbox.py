"""Sandbox commands answered by placement, the sandbox record kept in KV, and the life cycle.

Subjects here are the ones a trainer speaks to; everything a user sends is validated by
the Struct constraints (msgspec), so a service never sees an out-of-range limit.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

CREATE = "sandbox.v1.create"
CREATE_MANY = "sandbox.v1.create_many"
GET = "sandbox.v1.get"
LIST = "sandbox.v1.list"
ALL = "sandbox.v1.>"  # every sandbox command, quotas too (what placement serves)

QUEUE_GROUP = "placement"
KV_BUCKET = "sandboxes"

Isolation = Literal["process", "container", "microvm", "vm"]

LabelKey = Annotated[str, Meta(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")]
LabelValue = Annotated[str, Meta(max_length=256)]
SandboxId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9\-]*$")]
NodeId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")]

MAX_BATCH = 32_000


class DesktopSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A virtual screen of this size (pixels, 24-bit colour) for the sandbox's programs, driven
    from outside it with the `screen.*` subjects (schemas/desktop.py). Its programs come from
    the sandbox's layers (`sandfleet desktop layer` builds a stack that has them)."""

    width: Annotated[int, Meta(ge=320, le=2560)] = 1280
    height: Annotated[int, Meta(ge=200, le=1600)] = 800


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a trainer asks for; the body of `sandbox.v1.create`."""

    isolation: Isolation = "process"
    cpu: Annotated[float, Meta(gt=0, le=64)] = 1.0
    memory_mb: Annotated[int, Meta(ge=16, le=262_144)] = 512
    pids: Annotated[int, Meta(ge=8, le=32_768)] = 512
    timeout_s: Annotated[int, Meta(ge=1, le=7 * 24 * 3600)] = 600
    labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=32)] = {}
    layers: Annotated[list[Annotated[str, Meta(min_length=1, max_length=128)]], Meta(max_length=16)] = []
    allow: Annotated[list[Annotated[str, Meta(min_length=1, max_length=253)]], Meta(max_length=256)] = []
    # The writable upper dir's size (MiB), a tmpfs: a write beyond it fails with ENOSPC in this
    # sandbox only. Its pages are charged to the sandbox's memory, so they count against memory_mb too.
    disk_mb: Annotated[int, Meta(ge=16, le=1_048_576)] = 1024
    # True: the host's system directories read-only instead of layers (process only, for tests).
    # False with no layers: the node's default layers (`sandfleet up --default-layers`).
    host_view: bool = False
    # A screen for computer use (a display server and window manager started in the sandbox as
    # its own processes); None: no screen, and the `screen.*` subjects answer `unsupported`.
    desktop: DesktopSpec | None = None
    # A build sandbox (`sandfleet layer build` runs each Dockerfile RUN in one): its system
    # directories are writable too, and its root keeps the capabilities a package manager needs
    # (chown, fowner, fsetid, dac_override, kill, setuid, setgid), inside its user namespace only.
    # `process` and `container` on a node whose roots run in user namespaces; asked for by the
    # platform's own account only: a tenant's create of one fails with `invalid_request`.
    build: bool = False
    # True: the top layer is a running VM's saved machine state (`checkpoint(memory=True)`), not
    # a disk: the VM starts from it, its processes going on (`fleet.restore` sets it).
    machine_state: bool = False

    def __post_init__(self) -> None:
        if self.machine_state and self.isolation not in ("microvm", "vm"):
            raise ValueError("a machine state restores only into a VM level (microvm, vm)")
        if self.machine_state and len(self.layers) < 2:
            raise ValueError("machine_state=True needs the VM's layers and the state's layer on top")
        if self.host_view and self.build:
            raise ValueError("a build sandbox writes its own root: host_view=True cannot build")
        if self.host_view and self.layers:
            raise ValueError("host_view=True takes no layers")
        if self.host_view and self.desktop is not None:
            raise ValueError("a desktop runs from the sandbox's layers: host_view=True takes no desktop")


class CreateRequest(SandboxSpec, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    # Only this node (a restore onto a chosen node: migration). A placement constraint, not part
    # of the sandbox's spec: its record and a checkpoint of it do not carry the pin. Defaults are
    # not sent (the receiver has the same ones), so an unpinned request is also a valid SandboxSpec
    # (the SDK sends one as a batch's spec).
    node: NodeId | None = None


class CreateReply(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    node: str
    state: str = "running"


class CreateManyRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    count: Annotated[int, Meta(ge=1, le=MAX_BATCH)]
    spec: SandboxSpec = SandboxSpec()
    # True: reply when every launch has answered, listing the started ones in `sandboxes`.
    # False (a gang batch): reply as soon as every sandbox is placed, recorded and handed to its
    # node, in the compact `placements`; follow `started`/`failed` events for the rest.
    wait: bool = True


class NodePlacement(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """[node, [ids...]]: one node's share of a batch, compact so 32,000 ids fit in one reply."""

    node: str
    ids: list[str]


class CreateManyReply(msgspec.Struct, frozen=True, kw_only=True):
    sandboxes: list[CreateReply] = []
    failed: int = 0
    errors: list[str] = []
    placements: list[NodePlacement] = []


QUOTA_SET = "sandbox.v1.quota.set"
QUOTA_GET = "sandbox.v1.quota.get"
QUOTA_BUCKET = "quotas"
QuotaScope = Literal["task", "tenant"]  # the label a quota counts by


class Quota(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits for the sandboxes labelled `<scope>=<name>`; 0 means no limit. A create beyond one
    fails with a `capacity` error whose message starts with `quota:`."""

    scope: QuotaScope = "task"
    name: LabelValue
    max_concurrent: Annotated[int, Meta(ge=0)] = 0
    max_creates_per_s: Annotated[float, Meta(ge=0)] = 0.0


class QuotaGetRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    scope: QuotaScope = "task"
    name: LabelValue


class QuotaState(msgspec.Struct, frozen=True, kw_only=True):
    quota: Quota
    active: int = 0  # sandboxes counted against max_concurrent now


class QuotaUsage(msgspec.Struct, frozen=True, kw_only=True):
    """KV `quotas/u.<scope>.<name>`: what a quota has in use, updated with a revision check."""

    active: int = 0
    tokens: float = 0.0  # creates left in the rate bucket at `at` (refills at max_creates_per_s)
    at: float = 0.0


class GetRequest(msgspec.Struct, frozen=True, kw_only=True):
    id: SandboxId


class ListRequest(msgspec.Struct, frozen=True, kw_only=True):
    node: NodeId | None = None
    include_ended: bool = False


class State(str, enum.Enum):
    REQUESTED = "requested"
    SCHEDULED = "scheduled"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Reason(str, enum.Enum):
    """Why a sandbox reached `stopped` or `failed`; closed so consumers can switch on it."""

    NONE = "none"
    REQUESTED = "requested"  # the user destroyed it
    EXPIRED = "expired"  # timeout_s passed
    LAUNCH_FAILED = "launch_failed"
    PROCESS_EXITED = "process_exited"  # its init died on its own (out of memory, killed)
    LOST_ON_RESTART = "lost_on_restart"  # a restarted service found it gone
    NODE_SHUTDOWN = "node_shutdown"
    NODE_LOST = "node_lost"
    VIOLATION = "violation"  # the task's security policy killed it (failed) or quarantined it (paused)
    MEMORY_PRESSURE = "memory_pressure"  # paused by the node's reclaimer (idle under node pressure)


ENDED = frozenset({State.STOPPED, State.FAILED})

TRANSITIONS: dict[State, frozenset[State]] = {
    State.REQUESTED: frozenset({State.SCHEDULED, State.FAILED}),
    State.SCHEDULED: frozenset({State.STARTING, State.RUNNING, State.STOPPING, State.FAILED}),  # running: built within the grace
    State.STARTING: frozenset({State.RUNNING, State.STOPPING, State.FAILED}),
    State.RUNNING: frozenset({State.PAUSED, State.STOPPING, State.FAILED}),
    State.PAUSED: frozenset({State.RUNNING, State.STOPPING, State.FAILED}),
    State.STOPPING: frozenset({State.STOPPED, State.FAILED}),
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
}


def can_transition(current: State, new: State) -> bool:
    return new in TRANSITIONS[current]


class SandboxRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The KV value under `sandboxes/<id>`; every update is checked against its revision."""

    id: str
    node: str
    spec: SandboxSpec
    state: State
    reason: Reason = Reason.NONE
    detail: str = ""
    created_at: float
    updated_at: float
    started_at: float = 0.0
    deadline: float = 0.0
    init_pid: int = 0
    init_start_time: int = 0  # /proc/<pid>/stat field 22, so a recycled pid is never adopted
    seq: int = 0  # how many lifecycle events this sandbox has published
    # The layers of its latest checkpoint (digests, bottom first; the checkpoint's own last):
    # if its node is lost, placement starts a new sandbox from them on another node.
    checkpoint: list[str] = []
    restored_from: str = ""  # the sandbox whose lost node this one replaced, from its checkpoint
    # Whose it is: the tenant whose account the server said the create came from ("": the
    # platform's own account: the operator, a gateway). Set by placement, never from a request
    # body; a node answers a tenant only about its own sandboxes.
    tenant: str = ""


# -- the keys of the `sandboxes` bucket (record layout v3) ------------------------------------
# A sandbox's own record lives under `<node>.<id>`, its node's name first, so a node's bus user
# may be allowed puts of `$KV.sandboxes.<its node>.>` and nothing else of the bucket; placement's
# batch records live under `batch.<token>` (no node may be called `batch`). A reader that knows
# only the id asks for `*.<id>` (a wildcard last-by-subject read; it costs the server ~3x an
# exact key's, so a reader that knows the node, e.g. from the batch record, reads the exact key).


def record_key(node_id: str, sandbox_id: str) -> str:
    return f"{node_id}.{sandbox_id}"


def record_filter(sandbox_id: str) -> str:
    """The keys any node could hold `sandbox_id`'s record under."""
    return f"*.{sandbox_id}"


def record_key_parts(key: str) -> tuple[str, str] | None:
    """(node, sandbox id) of an own record's key; None for a batch record's (or a foreign) key."""
    node_id, dot, sandbox_id = key.partition(".")
    if not dot or not sandbox_id or "." in sandbox_id or key.startswith(BATCH_KEY_PREFIX):
        return None
    return node_id, sandbox_id


# -- the batch record (record layout v2) ---------------------------------------------------
# One KV value holds a whole launch's sandboxes as placement scheduled them: at 100 and more a
# batch, the bus stores one message where it stored one per sandbox. Each sandbox is
# `scheduled` as its batch says (seq 1) until its own record (`sandboxes/<node>.<id>`) is first
# written, by a revision-checked write that expects no value under its key (revision 0), so
# the first to change it wins as before; from then its own record is the record. Its id names
# its batch: `sb-<token>-<n>` is member n of the batch under `batch.<token>`.

BATCH_KEY_PREFIX = "batch."
BATCH_KEY_NODE = "batch"  # the first token of a batch key: a name no node may have
BATCH_TOKEN_HEX = 10  # random hex per batch; a token in use already is refused and drawn again


def batch_key(token: str) -> str:
    """The KV key of the batch `token`, beside the sandboxes' own keys (`<node>.<id>`)."""
    return BATCH_KEY_PREFIX + token


def batch_member_id(token: str, n: int) -> str:
    return f"sb-{token}-{n}"


def batch_of(sandbox_id: str) -> tuple[str, int] | None:
    """(token, n) of a batch-placed sandbox's id; None for an id of the one-record layout."""
    if not sandbox_id.startswith("sb-") or len(sandbox_id) < 3 + BATCH_TOKEN_HEX + 2:
        return None
    token, dash, n = sandbox_id[3 : 3 + BATCH_TOKEN_HEX], sandbox_id[3 + BATCH_TOKEN_HEX], sandbox_id[4 + BATCH_TOKEN_HEX :]
    if dash != "-" or not n.isdigit() or (len(n) > 1 and n[0] == "0"):
        return None
    return token, int(n)


class SandboxBatch(msgspec.Struct, frozen=True, kw_only=True):
    """The KV value under `sandboxes/batch.<token>`: `count` sandboxes (`sb-<token>-0` ...)
    scheduled together on `node` with one spec. Written once, never updated; what changes
    later is each sandbox's own record."""

    token: Annotated[str, Meta(pattern=f"^[0-9a-f]{{{BATCH_TOKEN_HEX}}}$")]
    node: NodeId
    spec: SandboxSpec
    count: Annotated[int, Meta(ge=1, le=MAX_BATCH)]
    created_at: float
    restored_from: str = ""
    tenant: str = ""

    def ids(self) -> list[str]:
        return [batch_member_id(self.token, n) for n in range(self.count)]

    def record(self, n: int) -> SandboxRecord:
        """Member n as its own record would read before its first change."""
        return SandboxRecord(id=batch_member_id(self.token, n), node=self.node, spec=self.spec,
                             state=State.SCHEDULED, created_at=self.created_at, updated_at=self.created_at, seq=1,
                             restored_from=self.restored_from, tenant=self.tenant)

    def records(self) -> list[SandboxRecord]:
        return [self.record(n) for n in range(self.count)]


class SandboxList(msgspec.Struct, frozen=True, kw_only=True):
    sandboxes: list[SandboxRecord]

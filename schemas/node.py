"""Node-targeted commands (`node.v1.<node_id>.<verb>`) and node registrations.

The launcher of a node answers launch/exec/files/destroy; the node agent of the same node
answers confine/release. A trainer reaches exec and files directly on the node that holds
the sandbox (the create reply names it), so placement is never on the exec path.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.errors import ErrorCode
from schemas.sandbox import Isolation, LabelKey, LabelValue, Reason, SandboxBatch, SandboxId, SandboxRecord, SandboxSpec

KV_BUCKET = "nodes"
HEARTBEAT_S = 2.0
NODE_TTL_S = 10.0

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_OUTPUT_BYTES = 1024 * 1024


def subject(node_id: str, verb: str) -> str:
    return f"node.v1.{node_id}.{verb}"


LAUNCH = "launch"
EXEC = "exec"
WRITE_FILE = "write_file"
READ_FILE = "read_file"
DESTROY = "destroy"
QUARANTINE = "quarantine"
PAUSE = "pause"  # also what the node's reclaimer sends to freeze an idle sandbox under pressure
RESUME = "resume"
PAUSE_SELECTED = "pause_selected"  # every live sandbox of the node with these labels (a rollout)
RESUME_SELECTED = "resume_selected"
HINT = "hint"
CHECKPOINT = "checkpoint"
CONFINE = "confine"
RELEASE = "release"
AGENT_LIST = "confined"
SECURITY = "security"


class NodePressure(msgspec.Struct, frozen=True, kw_only=True):
    """The node's pressure stall information (`some avg10`, percent of time stalled)."""

    cpu: float = 0.0
    memory: float = 0.0


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The KV value under `nodes/<node_id>`, rewritten by the launcher every heartbeat."""

    id: str
    isolation: list[str]
    capacity: int
    running: int
    cpus: int
    memory_mb: int
    at: float
    version: str = "1"
    starting: int = 0  # launches taken and not finished yet
    allocated_cpu: float = 0.0  # what its live and starting sandboxes asked for
    allocated_memory_mb: int = 0
    pressure: NodePressure = NodePressure()
    layers: list[str] = []  # names and digests of the layers the node has cached
    # Changes whenever the launcher starts; with `accepted*` (what this instance has taken,
    # cumulative) placement knows exactly which of its bookings are still on the way.
    instance: str = ""
    accepted: int = 0
    accepted_cpu: float = 0.0
    accepted_memory_mb: int = 0
    simulated: bool = False  # a load-test node (loadtest/): it accepts launches and creates nothing
    criu: str = ""  # process-level checkpoint: "on: <criu version>", or "off: <why>" (`criu check` is run at start)
    microvm: str = ""  # the `microvm` level: "on: tcg (no usable KVM: ...), ..." or "off: <why>"
    vm: str = ""  # the `vm` level (a full machine): "on: tcg (...), q35 + SeaBIOS, ..." or "off: <why>"
    # Spares ready to claim, by pool key (schemas/pools.py); they count in `running` and the
    # allocations already, so a claim takes no new room.
    warm: dict[str, int] = {}


BOOKINGS_BUCKET = "node-bookings"


class NodeBooking(msgspec.Struct, frozen=True, kw_only=True):
    """KV `node-bookings/<node_id>`: what placement has sent a node, updated with a revision check by
    every placement replica, so two replicas never book the same free room twice.

    For a node that reports `instance`, the counts are cumulative for that instance (compare with
    its `accepted*`); for one that does not, they count what was sent since its heartbeat `since`.
    """

    instance: str = ""
    since: float = 0.0
    count: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    lost: bool = False  # a replica has claimed the work of failing this node's sandboxes


class LaunchItem(msgspec.Struct, frozen=True, kw_only=True):
    id: SandboxId
    spec: SandboxSpec
    # The record as placement stored it and its KV revision: the node may make its first
    # transition without reading it (the write is still revision-checked).
    record: SandboxRecord | None = None
    revision: int = 0
    # When the caller stops waiting (epoch s; 0: nobody waits, as for a gang batch). A sandbox
    # still queued for a launch slot then ends `failed` instead of starting for nobody.
    answer_by: float = 0.0


class LaunchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The sandboxes to launch: `sandboxes` one by one, and/or every member of `batch` (record
    layout v2: placement launches each batch record whole, in one message that carries its
    spec once instead of twice per sandbox); `answer_by` is the batch members' (see LaunchItem)."""

    sandboxes: list[LaunchItem] = []
    batch: SandboxBatch | None = None
    answer_by: float = 0.0

    def items(self) -> list[LaunchItem]:
        """Every sandbox to launch, a batch's members as their batch record says (revision 0:
        no own record yet). Empty only for a request that names none, which a node refuses."""
        if self.batch is None:
            return self.sandboxes
        spec, answer_by = self.batch.spec, self.answer_by
        return self.sandboxes + [LaunchItem(id=r.id, spec=spec, record=r, revision=0, answer_by=answer_by)
                                 for r in self.batch.records()]


class LaunchResult(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    ok: bool
    error: str = ""
    code: ErrorCode = ErrorCode.INTERNAL  # what kind of failure, so placement can pass it on


class LaunchReply(msgspec.Struct, frozen=True, kw_only=True):
    results: list[LaunchResult]


Argv = Annotated[list[Annotated[str, Meta(max_length=131_072)]], Meta(min_length=1, max_length=4096)]
AbsPath = Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"^/")]


class ExecRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    argv: Argv | None = None  # required unless image_command
    # Run the image's command (a sandbox over an imported image): its Entrypoint followed by
    # `argv` if given, else by its Cmd, as `docker run IMAGE [ARGS]` does.
    image_command: bool = False
    env: Annotated[dict[str, str], Meta(max_length=1024)] = {}
    cwd: AbsPath = "/workspace"
    stdin: Annotated[bytes, Meta(max_length=MAX_FILE_BYTES)] = b""
    timeout_s: Annotated[float, Meta(gt=0, le=24 * 3600)] = 60.0


class ExecReply(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
    # The signal that ended the command came from its sandbox ending (destroyed, expired, OOM,
    # node shutdown): the result says nothing of the command; the record says why.
    sandbox_ended: bool = False


class WriteFileRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    path: AbsPath
    data: Annotated[bytes, Meta(max_length=MAX_FILE_BYTES)]
    mode: Annotated[int, Meta(ge=0, le=0o7777)] = 0o644


class WriteFileReply(msgspec.Struct, frozen=True, kw_only=True):
    size: int


class ReadFileRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    path: AbsPath


class ReadFileReply(msgspec.Struct, frozen=True, kw_only=True):
    data: bytes


class DestroyRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    # `violation` is for the security monitor's kill; the launcher refuses other reasons.
    reason: Reason = Reason.REQUESTED
    detail: Annotated[str, Meta(max_length=1024)] = ""


class DestroyReply(msgspec.Struct, frozen=True, kw_only=True):
    record: SandboxRecord


class QuarantineRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Security monitor → launcher: freeze the sandbox (cgroup.freeze) and keep it, files and
    all, as `paused` with reason `violation` until someone destroys it or it expires."""

    sandbox_id: SandboxId
    detail: Annotated[str, Meta(max_length=1024)] = ""


class QuarantineReply(msgspec.Struct, frozen=True, kw_only=True):
    record: SandboxRecord


class PauseRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Freeze every process of the sandbox (v2 cgroup.freeze) and keep it `paused` until a
    resume; `memory_pressure` is the node's reclaimer freezing an idle sandbox."""

    sandbox_id: SandboxId
    reason: Literal["requested", "memory_pressure"] = "requested"
    detail: Annotated[str, Meta(max_length=1024)] = ""


class PauseReply(msgspec.Struct, frozen=True, kw_only=True):
    record: SandboxRecord


class ResumeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Thaw a paused sandbox; a quarantined one (reason `violation`) is refused with `conflict`."""

    sandbox_id: SandboxId


class ResumeReply(msgspec.Struct, frozen=True, kw_only=True):
    record: SandboxRecord


class SelectedRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`pause_selected` / `resume_selected`: every live sandbox of the node carrying all these labels."""

    labels: Annotated[dict[LabelKey, LabelValue], Meta(min_length=1, max_length=32)]


class SelectedReply(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    matched: int  # live sandboxes with the labels
    changed: int  # paused (or resumed) by this request
    unchanged: int  # already so (or quarantined, for a resume)
    failed: int = 0
    errors: list[str] = []


class HintRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`idle` lowers the sandbox's CPU weight to the minimum; `active` restores what its spec gives."""

    sandbox_id: SandboxId
    hint: Literal["idle", "active"]


class HintReply(msgspec.Struct, frozen=True, kw_only=True):
    hint: str
    file: str  # the cgroup file written (v1 cpu.shares, or v2 cpu.weight)
    value: int


class CheckpointRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    sandbox_id: SandboxId
    name: Annotated[str, Meta(min_length=1, max_length=63, pattern=r"^(?!sha256$)[a-z0-9][a-z0-9_\-]*$")]
    keep_paused: bool = False  # true: leave it frozen afterwards (a migration stops the original)
    # True: the whole running machine (RAM, devices, its processes and the writable layer it
    # holds in RAM) of a VM level (microvm, vm); the other levels answer `unsupported`.
    memory: bool = False


class MachineState(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a saved running machine needs of the node that restores it (any other refuses it,
    typed, before QEMU starts). Kept in the state's layer too, as `machine.json`, which is what
    the restoring node reads (the handle is the client's, the layer is the store's)."""

    level: Annotated[str, Meta(max_length=16)]  # microvm or vm
    machine: Annotated[str, Meta(max_length=64)]  # QEMU's machine type, as QEMU resolves it
    accelerator: Annotated[str, Meta(max_length=8)]  # tcg or kvm
    cpu: Annotated[str, Meta(max_length=128)]  # the guest's CPU: TCG's fixed model, or the host's under KVM
    qemu: Annotated[str, Meta(max_length=64)]  # QEMU's version
    guest: Annotated[str, Meta(max_length=128)]  # the guest kernel + initramfs (digest): its agent is in RAM
    size: Annotated[int, Meta(ge=0)] = 0  # bytes of the state file


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A sandbox's files at one moment: its writable layer, packed as layer `name` (`digest`) in
    the store on top of `base` (digests, bottom first). `fleet.restore` starts a sandbox with
    layers base + [digest] and the same spec. Processes are not captured (`processes` false)...
    unless it is a memory checkpoint of a VM (`machine` set, `processes` true): then the layer
    holds the machine's saved state, never a disk, and the restored VM goes on from it."""

    sandbox_id: str
    node: str
    name: str
    digest: str
    base: list[str]
    spec: SandboxSpec
    processes: bool = False
    paused: bool = False  # the original was left frozen
    created_at: float
    seconds: float = 0.0
    machine: MachineState | None = None


class ConfineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Launcher → node agent: make the kernel resources a sandbox runs in."""

    sandbox_id: SandboxId
    isolation: Isolation
    cpu: float
    memory_mb: int
    pids: int
    allow: list[str] = []  # SandboxSpec.allow: egress rules (empty: no egress, no veth)
    labels: dict[str, str] = {}
    host_view: bool = False  # SandboxSpec.host_view: what its AppArmor profile lets it write
    build: bool = False  # SandboxSpec.build: its profile grants the whole root and a build's capabilities


class Confinement(msgspec.Struct, frozen=True, kw_only=True):
    """Where the sandbox's first process must go before it runs any sandbox code."""

    sandbox_id: str
    cgroup_procs: list[str]  # every cgroup.procs file to write the pid into (v1 controllers + v2)
    cgroup_v2: str  # the v2 directory: BPF attach point, freeze, kill
    netns: str  # a bind-mounted network namespace file
    address: str = ""  # the sandbox's egress address (its veth), empty without egress
    apparmor_profile: str = ""  # the profile its processes run under; empty where AppArmor is off


class ReleaseRequest(msgspec.Struct, frozen=True, kw_only=True):
    sandbox_id: SandboxId


class ReleaseReply(msgspec.Struct, frozen=True, kw_only=True):
    released: bool


class ConfinedList(msgspec.Struct, frozen=True, kw_only=True):
    sandbox_ids: list[str]


class NodeSecurity(msgspec.Struct, frozen=True, kw_only=True):
    """What the node agent enforces on this node, each as `on`, or `off: <why>`."""

    node: str
    mechanisms: dict[str, str]


class Empty(msgspec.Struct, frozen=True, kw_only=True):
    pass

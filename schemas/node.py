"""Node-targeted commands (`node.v1.<node_id>.<verb>`) and node registrations.

The launcher of a node answers launch/exec/files/destroy; the node agent of the same node
answers confine/release. A trainer reaches exec and files directly on the node that holds
the sandbox (the create reply names it), so placement is never on the exec path.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.errors import ErrorCode
from schemas.sandbox import Isolation, SandboxId, SandboxRecord, SandboxSpec

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
CONFINE = "confine"
RELEASE = "release"
AGENT_LIST = "confined"
SECURITY = "security"


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


class LaunchItem(msgspec.Struct, frozen=True, kw_only=True):
    id: SandboxId
    spec: SandboxSpec


class LaunchRequest(msgspec.Struct, frozen=True, kw_only=True):
    sandboxes: Annotated[list[LaunchItem], Meta(min_length=1)]


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
    argv: Argv
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


class DestroyReply(msgspec.Struct, frozen=True, kw_only=True):
    record: SandboxRecord


class ConfineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Launcher → node agent: make the kernel resources a sandbox runs in."""

    sandbox_id: SandboxId
    isolation: Isolation
    cpu: float
    memory_mb: int
    pids: int


class Confinement(msgspec.Struct, frozen=True, kw_only=True):
    """Where the sandbox's first process must go before it runs any sandbox code."""

    sandbox_id: str
    cgroup_procs: list[str]  # every cgroup.procs file to write the pid into (v1 controllers + v2)
    cgroup_v2: str  # the v2 directory: BPF attach point, freeze, kill
    netns: str  # a bind-mounted network namespace file


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

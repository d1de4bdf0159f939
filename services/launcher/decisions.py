"""The launcher's decisions that need no I/O, kept apart so they are read (and unit-tested) on
their own: what a restarted launcher does with each record of its node, who may launch a build
sandbox, what a destroy may do and how it ends, and which live sandboxes fencing drops. Callers
gather the facts (records, liveness, the layer-cache's roots) and act on the answer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.sandbox import ENDED, Reason, SandboxRecord, SandboxSpec, State

# -- recovery after a restart ---------------------------------------------------------------


@dataclass(frozen=True)
class Readopt:
    """Take the sandbox back as it was: still running, or frozen by a pause or a quarantine
    (its cgroup stayed frozen through the restart)."""

    paused: bool = False
    quarantined: bool = False


@dataclass(frozen=True)
class Relaunch:
    """Build it again from its spec: placement handed it to this node and a crash cut its
    launch short. Nothing of it ran for anyone (`running` was never written, so no caller has
    it), and nothing of what the cut launch made is on record: an init it may have spawned is
    killed with its confinement and the sandbox is built whole, never adopted half-made."""


@dataclass(frozen=True)
class Ending:
    """End the sandbox's record this way once its remains are stopped and released."""

    state: State
    reason: Reason
    detail: str = ""
    why: str = ""  # for the log: why it was not taken back, if that needs saying


def after_restart(record: SandboxRecord, alive: bool, levels: Iterable[str],
                  roots: Mapping[str, object] | None) -> Readopt | Relaunch | Ending:
    """What to do with one of the node's records found at start. `alive`: its recorded instance
    still runs; `roots`: the roots the layer-cache holds, by sandbox (None if it did not answer,
    then every root counts as kept). A launch a crash interrupted is the node's to finish: it
    is built again, and ends `failed` only if that build fails."""
    levels = list(levels)
    if record.state in (State.SCHEDULED, State.STARTING) and record.spec.isolation in levels:
        return Relaunch()
    usable = record.state in (State.RUNNING, State.PAUSED) and alive and record.spec.isolation in levels
    if usable and not record.spec.host_view and roots is not None and record.id not in roots:
        return ending_after_restart(record, why="the layer-cache no longer holds its root")
    if not usable:
        return ending_after_restart(record)
    frozen = record.state is State.PAUSED
    return Readopt(paused=frozen and record.reason is not Reason.VIOLATION,
                   quarantined=frozen and record.reason is Reason.VIOLATION)


def ending_after_restart(record: SandboxRecord, why: str = "") -> Ending:
    """A crash interrupted it: a destroy under way finishes as it would have; anything else was lost."""
    if record.state is State.STOPPING:
        return Ending(State.STOPPED, record.reason, why=why)
    return Ending(State.FAILED, Reason.LOST_ON_RESTART, f"was {record.state.value}", why=why)


def orphan_roots(roots: Mapping[str, object] | None, live: Iterable[str]) -> list[str]:
    """The roots the layer-cache holds for sandboxes no longer live here."""
    return sorted(set(roots or {}) - set(live))


# -- build sandboxes -----------------------------------------------------------------------

BUILD_LEVELS = ("process", "container")  # where the spawner's build confinement applies


def build_refusal(spec: SandboxSpec, tenant: str) -> ServiceError | None:
    """Why a build sandbox (SandboxSpec.build) may not be launched, or None. Its root keeps
    capabilities and may write its system directories: the platform's own builder asks for
    one (`sandfleet layer build`, the operator), a tenant's record never may, whatever its
    body said. Whether this node has the user namespace it needs is the driver's to say."""
    if not spec.build:
        return None
    if tenant:
        return ServiceError(ErrorCode.INVALID_REQUEST, "a build sandbox (build=true) is the platform's own "
                                                       f"(sandfleet layer build); tenant {tenant} may not ask for one")
    if spec.isolation not in BUILD_LEVELS:
        return ServiceError(ErrorCode.UNSUPPORTED, f"a build sandbox runs at {' or '.join(BUILD_LEVELS)}, "
                                                   f"not {spec.isolation}")
    return None


# -- destroy -------------------------------------------------------------------------------


def destroy_reason_refusal(reason: Reason) -> ServiceError | None:
    """A caller may destroy a sandbox as requested or for a violation; other reasons are the platform's."""
    if reason in (Reason.REQUESTED, Reason.VIOLATION):
        return None
    return ServiceError(ErrorCode.INVALID_REQUEST,
                        f"a destroy's reason is requested or violation, not {reason.value}")


def already_destroyed(record: SandboxRecord, reason: Reason, node_id: str) -> bool:
    """A kill for a violation of a sandbox this node already ended for a violation: the security
    monitor retrying an action that landed before it crashed. Answered with the record, so the
    audit trail says the kill was done, not refused."""
    return (reason is Reason.VIOLATION and record.reason is Reason.VIOLATION and record.state in ENDED
            and record.node == node_id)


def destroy_refusal(sandbox_id: str, record: SandboxRecord, node_id: str) -> ServiceError | None:
    """Whether a sandbox that is not live here may still be destroyed from its record: one that
    ended or lives elsewhere is not found; one still being scheduled or started is not ours yet.
    What is left (a crash left it stopping or running) is finished from the record."""
    if record.state in ENDED or record.node != node_id:
        return ServiceError(ErrorCode.NOT_FOUND, f"sandbox {sandbox_id} is {record.state.value}")
    if record.state in (State.STARTING, State.SCHEDULED):
        return ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is still {record.state.value}")
    return None


def destroyed_state(reason: Reason) -> State:
    """A killed cheater ends `failed` so its record stays readable, like a crashed one."""
    return State.FAILED if reason in (Reason.PROCESS_EXITED, Reason.VIOLATION) else State.STOPPED


# -- fencing -------------------------------------------------------------------------------


def to_drop(candidates: Iterable[str], records: Mapping[str, tuple[SandboxRecord, int]],
            node_id: str) -> list[tuple[str, str]]:
    """(id, why) of the live sandboxes whose records ended elsewhere, vanished, or name another node."""
    dropped = []
    for sandbox_id in candidates:
        record = records[sandbox_id][0] if sandbox_id in records else None
        if record is None:
            why = "its record is gone"
        elif record.state in ENDED:
            why = f"its record was ended elsewhere ({record.state.value}, {record.reason.value}: {record.detail})"
        elif record.node != node_id:
            why = f"its record names node {record.node}"
        else:
            continue
        dropped.append((sandbox_id, why))
    return dropped


def selected(labels_of: Mapping[str, Mapping[str, str]], wanted: Mapping[str, str]) -> list[str]:
    """The sandboxes (by id, from their labels) that carry every wanted label."""
    return [i for i, labels in labels_of.items() if all(labels.get(k) == v for k, v in wanted.items())]

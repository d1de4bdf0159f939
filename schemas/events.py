"""Lifecycle events, published on `events.v1.sandbox.<id>.<event>` and kept in one stream.

Each event is a tagged Struct; `seq` counts the events of one sandbox (1, 2, ...) so a
consumer can tell when it missed one; the stream sequence orders events across sandboxes.
"""

from __future__ import annotations

import msgspec

from schemas.sandbox import Reason, State

STREAM = "EVENTS"
STREAM_SUBJECTS = ["events.v1.>"]
ALL = "events.v1.>"
ALL_SANDBOX = "events.v1.sandbox.>"
VERSION = 1


def sandbox_subject(sandbox_id: str, event: str) -> str:
    return f"events.v1.sandbox.{sandbox_id}.{event}"


def sandbox_filter(sandbox_id: str) -> str:
    return f"events.v1.sandbox.{sandbox_id}.>"


class SandboxEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = VERSION
    sandbox_id: str
    node: str
    state: State
    seq: int
    at: float
    reason: Reason = Reason.NONE
    detail: str = ""

    @property
    def name(self) -> str:
        return type(self).__struct_config__.tag.rsplit(".", 1)[-1]


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

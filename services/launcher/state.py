"""What the launcher holds in memory about this node: its live sandboxes (`Live`) and what
this launcher instance has taken in (`Intake`, reported in every heartbeat so placement can
tell its bookings still in transit). The truth survives elsewhere: the KV record, the kernel
and the layer-cache; after a restart recovery rebuilds the live table from them."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from schemas.layers import Rootfs
from schemas.node import LaunchItem
from schemas.sandbox import SandboxSpec
from services.launcher.drivers.base import Driver, Instance


def _unwatched() -> None:
    pass


class Attached(Protocol):
    async def end(self) -> None: ...


@dataclass
class Live:
    id: str
    spec: SandboxSpec
    driver: Driver
    instance: Instance  # what the driver made; handed back to it for every operation
    deadline: float
    rootfs: Rootfs | None = None  # the layer-cache's composed root (None: host view)
    ending: bool = False
    quarantined: bool = False  # frozen by the security monitor: files readable, nothing runs
    paused: bool = False  # frozen by a pause (sb.pause, a rollout pause, the reclaimer): a resume thaws it
    freezing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one pause/resume/checkpoint at a time
    execs: set[asyncio.Future] = field(default_factory=set)  # commands running now
    unwatch: Callable[[], None] = _unwatched  # stops the driver's watch on its exit
    # What a capability keeps for this sandbox (file transfers, watches...), by name; each is
    # ended, its resources released, before the sandbox's processes and root go.
    attached: dict[str, Attached] = field(default_factory=dict)
    image_ids: tuple[int, int] | None = None  # (uid, gid) of its image's `User`, once looked up (image_config)


@dataclass
class Intake:
    """Counts what this launcher instance takes, so placement can tell its bookings in transit."""

    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    accepted: int = 0
    accepted_cpu: float = 0.0
    accepted_memory_mb: int = 0
    starting: dict[str, SandboxSpec] = field(default_factory=dict)  # in a launch request being answered

    def took(self, items: list[LaunchItem]) -> None:
        for item in items:
            self.accepted += 1
            self.accepted_cpu += item.spec.cpu
            self.accepted_memory_mb += item.spec.memory_mb
            self.starting[item.id] = item.spec

    def answered(self, items: list[LaunchItem]) -> None:
        for item in items:
            self.starting.pop(item.id, None)

"""The node agent's one way onto the bus for violation events: every watcher (egress
programs and the DNS stub, the syscall and limit watch, the audit reader of Landlock and
AppArmor denials) hands what it saw to one `ViolationPublisher`, which labels the event
with its sandbox's task labels, publishes it durably on `events.v1.violation.<node>.
<sandbox>.<kind>` (de-duplicated by the watcher's message id), and holds back a flood.

A flood is held back per sandbox, whatever its source: at most `per_second` events of one
sandbox in each one-second window; the rest are counted, and the next event that goes out
says how many were not reported one by one (as the syscall programs already do in the
kernel, whose own count is added). So a sandbox that loops on a denied write cannot take
the bus, the stream or the agent's event loop with it, and nothing is silently lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sandfleet import metrics
from sandfleet.bus import Bus
from sandfleet.store import SandboxStore
from sandfleet.telemetry import SANDBOX_ID
from schemas import violations
from schemas.violations import Violation

log = logging.getLogger("sandfleet.agent")

PER_SECOND = 100  # as SF_BUDGET_PER_S in bpf/syscalls.bpf.c
_SWEEP_AFTER = 1024  # budgets held before idle ones are dropped


@dataclass
class _Budget:
    window: float  # start of its current one-second window
    used: int = 0
    suppressed: int = 0  # held back since its last published event


def held_back(attempted: str, suppressed: int) -> str:
    """`attempted`, saying how many similar attempts before it were not reported one by one."""
    return f"{attempted} (after {suppressed} similar attempt(s) not reported one by one)" if suppressed else attempted


@dataclass
class ViolationPublisher:
    node_id: str
    per_second: int = PER_SECOND
    clock: Callable[[], float] = time.monotonic
    labels: dict[str, dict[str, str]] = field(default_factory=dict)  # by sandbox, from its confine request
    published: int = 0
    _bus: Bus | None = None
    _store: SandboxStore | None = None
    _budgets: dict[str, _Budget] = field(default_factory=dict)

    def bind(self, bus: Bus, store: SandboxStore) -> None:
        """Start publishing (before this, events are dropped: there is nowhere to put them)."""
        self._bus, self._store = bus, store

    def _admit(self, sandbox_id: str, suppressed: int) -> int | None:
        """How many attempts of the sandbox were held back before this one (`suppressed` of them
        by its source), or None to hold this one back too."""
        now = self.clock()
        budget = self._budgets.get(sandbox_id)
        if budget is None:
            if len(self._budgets) >= _SWEEP_AFTER:
                self._sweep(now)
            budget = self._budgets[sandbox_id] = _Budget(now)
        elif now - budget.window >= 1.0:
            budget.window, budget.used = now, 0
        if budget.used >= self.per_second:
            budget.suppressed += 1 + suppressed
            return None
        budget.used += 1
        held, budget.suppressed = budget.suppressed + suppressed, 0
        return held

    def _sweep(self, now: float) -> None:
        for sandbox_id in [s for s, b in self._budgets.items() if now - b.window >= 1.0 and not b.suppressed]:
            del self._budgets[sandbox_id]

    async def _labels(self, sandbox_id: str) -> dict[str, str]:
        known = self.labels.get(sandbox_id)
        if known is not None:
            return known
        try:  # a sandbox confined by a previous agent: its record has them
            assert self._store is not None
            return dict((await self._store.get(sandbox_id))[0].spec.labels)
        except Exception:
            return {}

    async def publish(self, sandbox_id: str, kind: str, attempted: str, *, msg_id: str, pid: int = 0,
                      command: str = "", address: str | None = None, port: int = 0, at: float | None = None,
                      suppressed: int = 0) -> bool:
        """Publish one violation; False when it was held back (or there is no bus yet).
        `suppressed`: attempts the source itself already held back before this one."""
        if self._bus is None:
            return False
        held = self._admit(sandbox_id, suppressed)
        if held is None:
            return False
        event = Violation(node=self.node_id, sandbox_id=sandbox_id, kind=kind, pid=pid, command=command,
                          attempted=held_back(attempted, held), address=address, port=port,
                          at=time.time() if at is None else at, labels=await self._labels(sandbox_id))
        try:
            await self._bus.publish_durable(violations.subject(self.node_id, sandbox_id, kind), event, msg_id=msg_id)
        except Exception as exc:  # the reporter must outlive a bad moment of the bus
            log.warning("violation of %s not published: %s", sandbox_id, exc, extra={SANDBOX_ID: sandbox_id})
            return False
        self.published += 1
        metrics.VIOLATIONS.inc(kind=kind)
        return True

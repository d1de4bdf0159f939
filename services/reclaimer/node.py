"""One node's reclamation loop: every `interval_s` it samples the node's sandboxes (their cgroups),
reads the node's memory pressure (PSI), asks the policy what to do, does it, and publishes
each action as an event; and it answers `node.v1.<node>.savings`.

Kernel reads and page-outs run in a worker thread: with hundreds of sandboxes a pass reads
thousands of small files, and a page-out of a large sandbox takes a while. The passes keep to a
CPU budget (`cpu_budget`, a fraction of one core): when a pass costs more than the budget allows
at `interval_s` (thousands of sandboxes), the next one waits longer, so sampling never competes
with the sandboxes it is meant to save memory for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from sandfleet import errors, metrics
from sandfleet.bus import Bus
from sandfleet.telemetry import SANDBOX_ID
from linuxnode import procfs
from linuxnode.cgroups import CgroupLayout, list_sandboxes
from schemas import reclaim
from schemas import node as node_schema
from schemas.reclaim import NodeSavings, ReclaimAction
from services.reclaimer import memory
from services.reclaimer.ksm import SharedKsm
from services.reclaimer.policy import Action, Phase, Policy, Sample
from services.reclaimer.zram import ZramSwap

log = logging.getLogger("sandfleet.reclaimer")

FREEZE_TIMEOUT_S = 10.0
MAX_INTERVAL_S = 30.0  # the CPU budget may stretch the sampling period up to this


@dataclass
class NodeReclaimer:
    bus: Bus
    node_id: str
    layout: CgroupLayout
    policy: Policy
    ksm: SharedKsm
    zram: ZramSwap
    enabled: bool = True
    interval_s: float = 2.0
    cpu_budget: float = 0.05
    zram_note: str = "off"  # why the node has no zram, when it has none
    actions: Counter[str] = field(default_factory=Counter)
    reclaimed: Counter[str] = field(default_factory=Counter)
    last: list[Sample] = field(default_factory=list)
    _seq: int = 0
    pass_cpu_s: float = 0.0  # CPU time of the last sampling pass

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad pass (a sandbox ending under us, a bus hiccup) must not end the loop
                log.exception("reclaim pass failed")
            await asyncio.sleep(self.next_interval())

    def next_interval(self) -> float:
        """`interval_s`, stretched so sampling uses at most `cpu_budget` of a core."""
        if self.cpu_budget <= 0:
            return self.interval_s
        # Never slower than MAX_INTERVAL_S: pressure must still be noticed within the freeze window.
        return max(self.interval_s, min(MAX_INTERVAL_S, self.pass_cpu_s / self.cpu_budget))

    async def tick(self) -> None:
        samples = await asyncio.to_thread(self._sample_all)
        self.last = samples
        if not self.enabled:
            return
        decision = self.policy.observe(time.time(), samples, procfs.node_pressure("memory"), self.ksm.full_scans())
        if self.ksm.available:
            await asyncio.to_thread(self.ksm.want, decision.ksm_wanted)
        for action in decision.actions:
            await self._do(action)

    def _sample_all(self) -> list[Sample]:
        started = time.thread_time()
        found = []
        for sandbox_id in list_sandboxes(self.layout, self.node_id):
            s = memory.sample(self.layout, self.node_id, sandbox_id)
            if s is not None:
                found.append(s)
        self.pass_cpu_s = time.thread_time() - started
        return found

    async def _do(self, action: Action) -> None:
        sid, outcome, reclaimed = action.sandbox_id, "done", 0
        if action.kind == "merge":
            reclaimed = await asyncio.to_thread(memory.sandbox_merged_bytes, self.layout, self.node_id, sid)
        elif action.kind == "page_out":
            reclaimed, resident = await asyncio.to_thread(memory.page_out, self.layout, self.node_id, sid)
            self.policy.paged_out(sid, resident)
        elif action.kind == "freeze":
            outcome = await self._freeze(sid)
            if outcome != "done":  # not an action taken: no event, and the sandbox stays a candidate
                self.policy.freeze_failed(sid)
                log.warning("could not freeze %s under memory pressure: %s", sid, outcome, extra={SANDBOX_ID: sid})
                return
        after = await asyncio.to_thread(memory.sample, self.layout, self.node_id, sid)
        if after is None:  # it ended meanwhile: nothing to report
            return
        self.actions[action.kind] += 1
        self.reclaimed[action.kind] += reclaimed
        metrics.RECLAIM_ACTIONS.inc(action=action.kind)
        metrics.RECLAIMED.inc(reclaimed, action=action.kind)
        self._seq += 1
        event = ReclaimAction(node=self.node_id, sandbox_id=sid, action=action.kind, bytes_reclaimed=reclaimed,  # type: ignore[arg-type]
                              memory_bytes=after.memory_bytes, outcome=outcome, at=time.time())
        log.info("%s %s: %d bytes (%s)", action.kind, sid, reclaimed, outcome, extra={SANDBOX_ID: sid})
        try:
            await self.bus.publish_durable(reclaim.action_subject(self.node_id, sid, action.kind), event,
                                           msg_id=f"reclaim-{self.node_id}-{sid}-{action.kind}-{event.at}")
        except Exception as exc:  # the action is done; a lost event is logged, not retried forever
            log.warning("reclaim event for %s not published: %s", sid, exc, extra={SANDBOX_ID: sid})

    async def _freeze(self, sandbox_id: str) -> str:
        request = node_schema.PauseRequest(sandbox_id=sandbox_id, reason="memory_pressure",
                                           detail="frozen by the reclaimer: sustained node memory pressure")
        subject = node_schema.subject(self.node_id, node_schema.PAUSE)
        try:
            await self.bus.request(subject, request, node_schema.PauseReply, timeout=FREEZE_TIMEOUT_S)
        except errors.NoResponders:
            return "unavailable: nothing on this node answers pause"
        except errors.SandfleetError as exc:
            return f"refused: {exc.message}"
        return "done"

    async def savings(self, _: reclaim.SavingsRequest) -> NodeSavings:
        merged = sum(s.merged_bytes for s in self.last)
        z = self.zram.stats()
        phases = self.policy.counts()
        return NodeSavings(
            node=self.node_id, enabled=self.enabled,
            ksm=self.ksm.status() if self.enabled else "off: SANDFLEET_RECLAIM=off",
            zram=self.zram.status() if self.zram.device else self.zram_note,
            sandboxes=len(self.last), idle=phases[Phase.IDLE] + phases[Phase.PAGED_OUT] + phases[Phase.FROZEN],
            paged_out=phases[Phase.PAGED_OUT], frozen=phases[Phase.FROZEN],
            memory_bytes=sum(s.memory_bytes for s in self.last),
            merged_bytes=merged, swapped_bytes=z.orig_bytes, swap_stored_bytes=z.used_bytes,
            saved_bytes=max(0, merged + z.orig_bytes - z.used_bytes),
            actions=dict(self.actions), reclaimed_bytes=dict(self.reclaimed), at=time.time(),
        )

"""The reclaimer's decisions, without I/O: which sandboxes are idle, what to do to each and
when, and when the node's pressure has lasted long enough to freeze the idlest.

A sandbox is idle once its CPU use has stayed under `idle_cpu` (a fraction of one CPU) for
`idle_after_s`. An idle sandbox first gives ksmd time to pass over it (its pages opted in to
KSM when it was spawned): at least `merge_window_s` and two full ksmd scans (a page merges
on the second scan that finds it unchanged; ksmd shares its time with every mergeable process
of the machine), then until its merged pages have stopped growing for `merge_settle_s`, at
most `merge_max_s`; then it is reported merged and paged out at once (a page-out
first would send to swap the very pages KSM is about to share); it is
paged out again if its resident memory grows back by `repage_min_bytes` after
`repage_after_s`. Any CPU use above the threshold makes it active again. Under node memory
pressure (PSI `some avg10` at or above `pressure_avg10`) lasting `pressure_sustain_s`, the
idlest unfrozen sandbox (idle longest, then the largest) is frozen, one per sustained window.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    idle_cpu: float = 0.02
    idle_after_s: float = 30.0
    merge_window_s: float = 20.0
    merge_settle_s: float = 6.0
    merge_max_s: float = 90.0
    repage_after_s: float = 120.0
    repage_min_bytes: int = 4 << 20
    pressure_avg10: float = 25.0
    pressure_sustain_s: float = 30.0
    freeze_per_window: int = 1


@dataclass(frozen=True)
class Sample:
    """One sandbox at one moment, read from its cgroups."""

    sandbox_id: str
    cpu_usec: int  # cumulative CPU time of its cgroup
    memory_bytes: int  # what its memory cgroup is charged
    resident_bytes: int = 0  # its processes' resident memory (what a page-out can lower)
    merged_bytes: int = 0  # its pages KSM has merged so far


class Phase(enum.Enum):
    ACTIVE = "active"
    IDLE = "idle"  # idle, ksmd passing over it
    PAGED_OUT = "paged_out"
    FROZEN = "frozen"


@dataclass(frozen=True)
class Action:
    kind: str  # "merge", "page_out" or "freeze"
    sandbox_id: str


@dataclass
class Track:
    sandbox_id: str
    phase: Phase
    cpu_usec: int
    seen_at: float
    quiet_since: float
    memory_bytes: int = 0
    resident_bytes: int = 0
    idle_at: float = 0.0
    merged_bytes: int = 0
    merge_grew_at: float = 0.0
    scans_at_idle: int = 0
    paged_at: float = 0.0
    paged_resident: int = 0


@dataclass(frozen=True)
class Decision:
    actions: list[Action]
    ksm_wanted: bool  # some sandbox is idle: ksmd should run


@dataclass
class Policy:
    config: PolicyConfig = field(default_factory=PolicyConfig)
    tracks: dict[str, Track] = field(default_factory=dict)
    pressure_since: float | None = None

    def observe(self, now: float, samples: list[Sample], node_pressure: float,
                ksm_scans: int | None = None) -> Decision:
        """`ksm_scans`: ksmd's count of full scans (/sys/kernel/mm/ksm/full_scans); None without KSM."""
        c = self.config
        present = {s.sandbox_id for s in samples}
        for gone in set(self.tracks) - present:
            del self.tracks[gone]
        actions: list[Action] = []
        for s in samples:
            t = self.tracks.get(s.sandbox_id)
            if t is None:  # first sight: no CPU delta yet, so not idle before a full window
                self.tracks[s.sandbox_id] = Track(s.sandbox_id, Phase.ACTIVE, s.cpu_usec, now, now,
                                                  s.memory_bytes, s.resident_bytes)
                continue
            elapsed = now - t.seen_at
            busy = elapsed > 0 and (s.cpu_usec - t.cpu_usec) / (elapsed * 1e6) > c.idle_cpu
            t.cpu_usec, t.seen_at, t.memory_bytes, t.resident_bytes = s.cpu_usec, now, s.memory_bytes, s.resident_bytes
            if s.merged_bytes > t.merged_bytes:
                t.merge_grew_at = now
            t.merged_bytes = s.merged_bytes
            if busy:  # a frozen sandbox cannot use CPU: if it did, someone thawed it
                t.phase, t.quiet_since = Phase.ACTIVE, now
                continue
            actions += self._advance(t, now, ksm_scans)
        actions += self._relieve_pressure(now, node_pressure)
        return Decision(actions=actions, ksm_wanted=any(t.phase is not Phase.ACTIVE for t in self.tracks.values()))

    def _advance(self, t: Track, now: float, ksm_scans: int | None) -> list[Action]:
        c = self.config
        if t.phase is Phase.ACTIVE and now - t.quiet_since >= c.idle_after_s:
            t.phase, t.idle_at, t.merge_grew_at, t.scans_at_idle = Phase.IDLE, now, now, ksm_scans or 0
        if t.phase is Phase.IDLE and self._merge_settled(t, now, ksm_scans):
            t.phase, t.paged_at = Phase.PAGED_OUT, now
            t.paged_resident = t.resident_bytes  # corrected by paged_out() once the page-out is done
            return [Action("merge", t.sandbox_id), Action("page_out", t.sandbox_id)]
        if (t.phase is Phase.PAGED_OUT and now - t.paged_at >= c.repage_after_s
                and t.resident_bytes - t.paged_resident >= c.repage_min_bytes):
            t.paged_at = now
            return [Action("page_out", t.sandbox_id)]
        return []

    def _merge_settled(self, t: Track, now: float, ksm_scans: int | None) -> bool:
        c = self.config
        waited = now - t.idle_at
        scanned = ksm_scans is None or ksm_scans - t.scans_at_idle >= 2
        return waited >= c.merge_max_s or (
            waited >= c.merge_window_s and scanned and now - t.merge_grew_at >= c.merge_settle_s)

    def paged_out(self, sandbox_id: str, resident_bytes: int) -> None:
        """What the sandbox's processes hold after a page-out: the baseline for paging it again."""
        t = self.tracks.get(sandbox_id)
        if t is not None:
            t.paged_resident = t.resident_bytes = resident_bytes

    def freeze_failed(self, sandbox_id: str) -> None:
        """Nothing froze it (no freezer answers, or the sandbox is ending): it stays a candidate."""
        t = self.tracks.get(sandbox_id)
        if t is not None and t.phase is Phase.FROZEN:
            t.phase = Phase.PAGED_OUT if t.paged_at else Phase.IDLE

    def _relieve_pressure(self, now: float, pressure: float) -> list[Action]:
        c = self.config
        if pressure < c.pressure_avg10:
            self.pressure_since = None
            return []
        if self.pressure_since is None:
            self.pressure_since = now
        if now - self.pressure_since < c.pressure_sustain_s:
            return []
        candidates = [t for t in self.tracks.values() if t.phase in (Phase.IDLE, Phase.PAGED_OUT)]
        candidates.sort(key=lambda t: (t.quiet_since, -t.memory_bytes))
        chosen = candidates[: c.freeze_per_window]
        for t in chosen:
            t.phase = Phase.FROZEN
        self.pressure_since = now  # the next freeze only after another sustained window
        return [Action("freeze", t.sandbox_id) for t in chosen]

    def counts(self) -> dict[Phase, int]:
        found = {p: 0 for p in Phase}
        for t in self.tracks.values():
            found[t.phase] += 1
        return found

"""This node's warm pools: spares built ahead for the pools placement keeps in KV `pools`,
handed out one to a create that matches (`claim`).

A spare is built through the launch path (`Launcher.build`: confine, compose, start) under an
id of the form placement gives, with the pool's shape and nothing of any use: no labels, no
egress rules, no record. It is in no table an endpoint reads, so nothing can exec into it or
write to it before it is claimed, and a claimed one is never put back, so none carries anything
from one use to the next. A claim takes one from its list with no await in between (the
launcher's one loop: two claims never get the same spare), applies the create's labels and
egress rules by confining it again (the agent's confine is idempotent on what exists and adds
the veth, the rules and the labels), gives it the create's timeout, and only then writes its
record as placement would (`scheduled`, then `running`), so its events read like a cold create's.

Refills run in the background, `pool_builds` at a time, only while no launch is being built
(real creates first) and within the node's capacity; spares count in the heartbeat's
`running` and allocations. Under memory pressure (the node's PSI over `pool_memory_psi`) the
spares are destroyed and none is built. A spare whose init ends on its own is given back and
built again. Spares have no record, so what a launcher crash leaves of them is given back at
the next start: their roots and containers by recovery's sweeps, their confinements (and with
them their inits) by `give_back_orphans`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors

from linuxnode import procfs
from sandfleet import errors, metrics
from sandfleet.bus import Bus, decode
from sandfleet.errors import ServiceError
from schemas import pools as pools_schema
from schemas.errors import ErrorCode
from schemas.node import Confinement
from schemas.pools import ClaimReply, ClaimRequest, Pool
from schemas.sandbox import ENDED, Reason, SandboxRecord, SandboxSpec, State
from services.launcher import records
from services.launcher.keys import LOGGER, about
from services.launcher.lifecycle import Launcher
from services.launcher.state import Live

log = logging.getLogger(LOGGER)

RETRY_AFTER_FAILURE_S = 5.0  # a pool whose spare failed to build waits this long before the next


async def give_back_orphans(launcher: Launcher) -> list[str]:
    """At start, before this launcher serves or builds a spare: the confinements the agent holds
    that no record of this node keeps (the spares of a launcher that died), given back; their
    inits die with their cgroups. A record is read by id, not listed, so one just written counts."""
    try:
        held = await launcher.agent.held()
    except errors.SandfleetError as exc:
        log.warning("no listing from the node agent (%s): spares a crash left stay until it restarts", exc)
        return []
    candidates = sorted(held - set(launcher.live) - launcher.launching)
    if not candidates:
        return []
    try:
        kept = await launcher.store.read_many(candidates)
    except (errors.ServiceError, errors.SandfleetError) as exc:  # never guess: keep them until the next start
        log.warning("cannot read the records of %d confinement(s) to give back orphans: %s", len(candidates), exc)
        return []
    orphans = [i for i in candidates
               if i not in kept or kept[i][0].state in ENDED or kept[i][0].node != launcher.node_id]
    await asyncio.gather(*(launcher.release_confinement(i) for i in orphans))
    for sandbox_id in orphans:
        log.info("gave back the confinement of %s, which no record owns (a spare a crash left)", sandbox_id,
                 extra=about(sandbox_id))
    return orphans


def spare_id() -> str:
    """An id like placement's (`sb-` + 12 hex digits): the spare's id becomes the sandbox's, and
    its record's create refuses one that exists."""
    return "sb-" + secrets.token_hex(6)


def memory_pressure() -> float:
    return procfs.node_pressure("memory")


class WarmPools:
    """The node's spares by pool key, the pools as last read, and the builds under way."""

    def __init__(self, launcher: Launcher, bus: Bus, capacity: int, period_s: float = 1.0,
                 pressure: Callable[[], float] = memory_pressure) -> None:
        self.launcher, self.bus, self.capacity, self.period_s = launcher, bus, capacity, period_s
        self.pressure = pressure  # the node's memory PSI, `some avg10` percent
        self.pools: dict[str, Pool] = {}  # key → pool, as KV `pools` last said
        self.spares: dict[str, list[Live]] = {}  # key → built and unclaimed, oldest first
        self.building: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self.closing = False
        self.changed = asyncio.Event()  # the warm counts changed: the heartbeat tells placement soon

    # -- what the heartbeat reports ------------------------------------------------------------

    def warm(self) -> dict[str, int]:
        return {key: len(spares) for key, spares in self.spares.items() if spares}

    def held(self) -> list[SandboxSpec]:
        """The specs of every spare, built or being built: they take room like running sandboxes."""
        built = [live.spec for spares in self.spares.values() for live in spares]
        return built + [pools_schema.shape_of(self.pools[k].spec) for k, n in self.building.items()
                        if k in self.pools for _ in range(n)]

    def count(self) -> int:
        return sum(len(s) for s in self.spares.values()) + sum(self.building.values())

    # -- claim -----------------------------------------------------------------------------------

    async def claim(self, req: ClaimRequest) -> ClaimReply:
        spec = req.spec
        key = pools_schema.pool_key(spec)
        spares = self.spares.get(key)
        if self.closing or not pools_schema.poolable(spec) or not spares:
            metrics.WARM_CLAIMS.inc(result="empty")
            return ClaimReply()
        live = spares.pop(0)  # no await since the check: this spare is this claim's alone
        live.unwatch()
        self.changed.set()
        self._fill()  # its replacement, in the background
        try:
            await self._apply(live, spec)
        except BaseException:
            await self._give_back(live)
            raise
        now = time.time()
        record = SandboxRecord(id=live.id, node=self.launcher.node_id, spec=spec, state=State.SCHEDULED,
                               created_at=now, updated_at=now, tenant=req.tenant)
        try:
            [stored] = await self.launcher.store.create_many([record])
        except (errors.ServiceError, errors.SandfleetError, OSError) as exc:
            await self._give_back(live)
            raise ServiceError(ErrorCode.INTERNAL, f"could not record the claimed sandbox: {exc}") from None
        live.spec, live.deadline = spec, now + spec.timeout_s
        self.launcher.adopt(live)
        try:
            await records.running(self.launcher.store, live.id, live.instance.anchor, now, live.deadline, known=stored)
        except ServiceError:  # ended meanwhile (a destroy by id cannot come this early, a purge can)
            await self.launcher.destroy(live.id, Reason.LAUNCH_FAILED, "its record changed while it was claimed")
            raise
        log.info("claimed spare %s of pool %s", live.id, key, extra=about(live.id))
        metrics.WARM_CLAIMS.inc(result="taken")
        return ClaimReply(id=live.id)

    async def _apply(self, live: Live, spec: SandboxSpec) -> None:
        """The create's labels and egress rules, on the spare's own confinement."""
        if not (spec.labels or spec.allow):
            return
        confinement = await self.launcher.agent.confine(live.id, spec)
        live.instance = _confined(live.instance, confinement)

    async def _give_back(self, live: Live) -> None:
        try:
            await self.launcher.discard(live)
        except Exception:
            log.exception("giving back spare %s failed", live.id, extra=about(live.id))

    # -- keeping the pools -------------------------------------------------------------------

    async def run(self) -> None:
        kv = None
        while not self.closing:
            try:
                kv = kv or await self.bus.js.key_value(pools_schema.KV_BUCKET)
                self.pools = await _read_pools(kv)
            except nats.js.errors.BucketNotFoundError:
                self.pools = {}  # no pool was ever set
            except (nats.errors.Error, nats.js.errors.Error, errors.SandfleetError) as exc:
                log.warning("cannot read the warm pools (%s); keeping what was read last", exc)
            try:
                self._trim()
                self._fill()
            except Exception:  # the pools must outlive a bad moment; the next period tries again
                log.exception("keeping the warm pools failed")
            await asyncio.sleep(self.period_s)

    def _pressured(self) -> bool:
        limit = self.launcher.settings.pool_memory_psi
        return bool(limit) and self.pressure() >= limit

    def _trim(self) -> None:
        """Give back the spares of pools that went or shrank, and every spare under memory pressure."""
        pressured, dropped = self._pressured(), 0
        for key, spares in self.spares.items():
            keep = 0 if pressured or key not in self.pools else self.pools[key].size
            while len(spares) > keep:
                live = spares.pop()  # newest first: the oldest have waited longest to be claimed
                live.unwatch()
                self.changed.set()
                self._spawn(self._give_back(live))
                dropped += 1
        if pressured and dropped:
            log.warning("memory pressure: destroyed %d warm spare(s); none is built until it eases", dropped)

    def _fill(self) -> None:
        """Start builds toward each pool's size, behind real launches, within capacity and budget."""
        if self.closing or self.launcher.launching or self._pressured():
            return
        budget = self.launcher.settings.pool_builds - sum(self.building.values())
        room = self.capacity - len(self.launcher.live) - self.count()
        now = time.time()
        for key, pool in sorted(self.pools.items()):
            if pool.spec.isolation not in self.launcher.isolation or now - self._failed_at.get(key, 0) < \
                    RETRY_AFTER_FAILURE_S:
                continue
            while budget > 0 and room > 0 and len(self.spares.get(key, [])) + self.building.get(key, 0) < pool.size:
                self.building[key] = self.building.get(key, 0) + 1
                self._spawn(self._build(key, pool))
                budget, room = budget - 1, room - 1

    async def _build(self, key: str, pool: Pool) -> None:
        sandbox_id = spare_id()
        try:
            live = await self.launcher.build(sandbox_id, pools_schema.shape_of(pool.spec))
        except Exception as exc:
            self._failed_at[key] = time.time()
            log.warning("a spare of pool %s failed to build: %s", key, getattr(exc, "message", None) or exc)
            return
        finally:
            self.building[key] -= 1
        wanted = self.pools.get(key)
        if self.closing or wanted is None or len(self.spares.get(key, [])) >= wanted.size or self._pressured():
            await self._give_back(live)
            return
        live.unwatch = live.driver.watch(live.instance, lambda: self._ended_on_its_own(key, live))
        self.spares.setdefault(key, []).append(live)
        self.changed.set()
        self._fill()

    def _ended_on_its_own(self, key: str, live: Live) -> None:
        spares = self.spares.get(key, [])
        if live in spares:
            spares.remove(live)
            self.changed.set()
            log.warning("spare %s of pool %s ended on its own; building another", live.id, key, extra=about(live.id))
            self._spawn(self._give_back(live))

    def _spawn(self, work) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Node shutdown: no more builds; every spare, built or being built, given back."""
        self.closing = True
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        spares = [live for key in list(self.spares) for live in self.spares.pop(key)]
        for live in spares:
            live.unwatch()
        await asyncio.gather(*(self._give_back(live) for live in spares))


async def _read_pools(kv) -> dict[str, Pool]:  # type: ignore[no-untyped-def]
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return {}
    found = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        try:
            pool = decode(entry.value, Pool) if entry.value else None
        except msgspec.MsgspecError as exc:  # not placement's writing: never a reason to stop
            log.warning("pool %s is unreadable (%s); ignored", key, exc)
            continue
        if pool is not None and pool.size > 0:
            found[key] = pool
    return found


def _confined(instance, confinement: Confinement):  # type: ignore[no-untyped-def]
    """The instance with its new confinement (its egress address may be new); a driver whose
    instance keeps none (a VM's) is returned as it was."""
    if dataclasses.is_dataclass(instance) and hasattr(instance, "confinement"):
        return dataclasses.replace(instance, confinement=confinement)
    return instance

"""Rebuilding the launcher's live table after a restart, from the node's records, the kernel
(is each recorded instance still alive?) and the layer-cache (does it still hold the root?):
re-adopt what still runs, build again what a crash caught mid-launch, end with a reason what
it interrupted otherwise (decisions.after_restart), and give back the roots and runtime
remains that no live sandbox owns.

A launch is durable through the record placement wrote before handing it over: a record of
this node still `scheduled` or `starting` is a launch not finished, and only this node may
finish it (placement fails a `scheduled` one only after its launch request timed out, 30 s
and more, and never a `starting` one). `relaunch` builds those through the same path as a
launch request, so every write is revision-checked against placement's as it is there."""

from __future__ import annotations

import asyncio
import logging
import time

from sandfleet import errors
from schemas.layers import Rootfs
from schemas.node import LaunchItem
from schemas.sandbox import SandboxRecord, State
from services.launcher import decisions, records
from services.launcher.drivers.base import Driver, DriverFailure, Instance
from services.launcher.keys import LOGGER, about
from services.launcher.lifecycle import Launcher
from services.launcher.starting import StartingMarks
from services.launcher.state import Live

log = logging.getLogger(LOGGER)


async def recover(launcher: Launcher) -> list[SandboxRecord]:
    """Re-adopt or end every record of this node; returns the launches to build again
    (`relaunch`, once the launcher serves), their remains already given back."""
    roots = await _roots(launcher)
    interrupted: list[SandboxRecord] = []
    for record in await launcher.store.all(launcher.node_id):
        anchor = records.anchor_of(record)
        alive = anchor is not None and launcher.drivers.alive(record.spec.isolation, anchor)
        plan = decisions.after_restart(record, alive, launcher.drivers.levels, roots)
        if isinstance(plan, decisions.Relaunch):
            interrupted.append(record)
            continue
        if isinstance(plan, decisions.Readopt):
            assert anchor is not None
            driver = launcher.drivers.driver(record.spec.isolation)
            try:
                confinement = await launcher.agent.confine(record.id, record.spec)
            except errors.SandfleetError as exc:
                log.warning("cannot re-confine %s: %s", record.id, exc, extra=about(record.id))
                plan = decisions.ending_after_restart(record)
            else:
                rootfs = roots.get(record.id) if roots is not None else None
                instance = await driver.adopt(record.id, anchor, record.spec, confinement, rootfs)
                await _settle_frozen(driver, instance, record.id, frozen=plan.paused or plan.quarantined)
                launcher.adopt(Live(record.id, record.spec, driver, instance, record.deadline or time.time(),
                                    rootfs=rootfs, paused=plan.paused, quarantined=plan.quarantined))
                log.info("re-adopted sandbox %s (pid %d)", record.id, anchor.pid, extra=about(record.id))
                continue
        if plan.why:
            log.warning("sandbox %s: %s", record.id, plan.why, extra=about(record.id))
        await launcher.finish(record, anchor if alive else None, plan)
        log.info("ended sandbox %s after restart (was %s)", record.id, record.state.value, extra=about(record.id))
    for sandbox_id in decisions.orphan_roots(roots, launcher.live):
        await launcher.release_rootfs(sandbox_id)
        log.info("released the root of %s, which no live sandbox owns", sandbox_id, extra=about(sandbox_id))
    for sandbox_id in await launcher.drivers.leftovers(set(launcher.live)):
        log.info("removed container %s, which no live sandbox owns", sandbox_id, extra=about(sandbox_id))
    await _give_back_confinements(launcher, [r.id for r in interrupted])
    return interrupted


async def _give_back_confinements(launcher: Launcher, sandbox_ids: list[str]) -> None:
    """The confinements of the launches to build again: the agent keeps them (their records
    live), and an init the cut launch spawned may run in one, unrecorded. Released, that init
    is killed with its cgroup, so each sandbox has one init, the one built next. (Their roots
    and containers went with the sweeps above: no live sandbox owns them.)"""
    slots = asyncio.Semaphore(launcher.settings.launch_concurrency)

    async def one(sandbox_id: str) -> None:
        async with slots:
            await launcher.release_confinement(sandbox_id)

    await asyncio.gather(*(one(i) for i in sandbox_ids))


async def relaunch(launcher: Launcher, interrupted: list[SandboxRecord]) -> None:
    """Build again the launches a crash interrupted (`recover`), as a launch request from
    placement would be built: queued behind the same slots, a `starting` mark after the same
    grace, each record written only from the revision read here, so placement giving up on
    one meanwhile (`failed`) wins over this, or this over it, never both."""
    if not interrupted:
        return
    try:
        known = await launcher.store.read_many([r.id for r in interrupted])
    except (errors.SandfleetError, errors.ServiceError) as exc:  # the next start finds them as this one did
        log.error("cannot read the %d interrupted launch(es) to build them again: %s", len(interrupted), exc)
        return
    items = [LaunchItem(id=i, spec=record.spec, record=record, revision=revision)
             for i, (record, revision) in known.items()
             if record.state in (State.SCHEDULED, State.STARTING) and record.node == launcher.node_id]
    log.info("building again %d launch(es) a crash interrupted", len(items))
    launcher.intake.took(items)
    try:
        marks = StartingMarks(launcher.store, [item.id for item in items],
                              known={item.id: (item.record, item.revision) for item in items if item.record},
                              grace=launcher.settings.starting_grace_s)
        results = await asyncio.gather(*(launcher.launch(item, marks) for item in items))
    finally:
        launcher.intake.answered(items)
    failed = [r for r in results if not r.ok]
    log.info("built again %d of %d interrupted launch(es)", len(results) - len(failed), len(results))
    for result in failed[:5]:
        log.warning("sandbox %s could not be built again: %s", result.id, result.error, extra=about(result.id))


async def _settle_frozen(driver: Driver, instance: Instance, sandbox_id: str, frozen: bool) -> None:
    """The kernel as the record says: a launcher killed mid-checkpoint (or mid-pause) leaves a
    `running` sandbox frozen, and every command in it would hang; a `paused` one may have been
    thawed halfway. Freezing or thawing what already is so changes nothing."""
    try:
        await (driver.freeze(instance) if frozen else driver.thaw(instance))
    except (OSError, DriverFailure) as exc:  # it is ending meanwhile: its exit watch ends it
        log.warning("could not %s %s after restart: %s", "freeze" if frozen else "thaw", sandbox_id, exc,
                    extra=about(sandbox_id))


async def _roots(launcher: Launcher) -> dict[str, Rootfs] | None:
    """The roots the node's layer-cache holds, by sandbox; None if it does not answer."""
    try:
        listing = await launcher.layers.listing()
    except errors.SandfleetError as exc:
        log.warning("no root listing from the layer-cache (%s): roots are kept as they are", exc)
        return None
    return {r.sandbox_id: r for r in listing.rootfs}

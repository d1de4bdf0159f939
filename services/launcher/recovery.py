"""Rebuilding the launcher's live table after a restart, from the node's records, the kernel
(is each recorded instance still alive?) and the layer-cache (does it still hold the root?):
re-adopt what still runs, end with a reason what a crash interrupted (decisions.after_restart),
and give back the roots and runtime remains that no live sandbox owns."""

from __future__ import annotations

import logging
import time

from sandfleet import errors
from schemas.layers import Rootfs
from services.launcher import decisions, records
from services.launcher.drivers.base import Driver, DriverFailure, Instance
from services.launcher.keys import LOGGER, about
from services.launcher.lifecycle import Launcher
from services.launcher.state import Live

log = logging.getLogger(LOGGER)


async def recover(launcher: Launcher) -> None:
    roots = await _roots(launcher)
    for record in await launcher.store.all(launcher.node_id):
        anchor = records.anchor_of(record)
        alive = anchor is not None and launcher.drivers.alive(record.spec.isolation, anchor)
        plan = decisions.after_restart(record, alive, launcher.drivers.levels, roots)
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

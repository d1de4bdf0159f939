"""Pause, resume, CPU hints and file checkpoints of this node's sandboxes (RL co-design).

A pause has the sandbox's driver freeze it (a kill still reaches frozen tasks, so expiry and
destroy work on a paused sandbox) and records `paused`; a resume thaws it. A quarantine (the
security monitor) is a pause no plain resume may lift. A hint changes the sandbox's CPU weight
only; its CPU limit (quota) stays. A checkpoint freezes the sandbox, has the layer-cache build
a layer from its writable layer (which holds /workspace too) on top of its layers, and thaws
it: the files survive, the processes do not (CRIU is only detected).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable

from sandfleet import errors
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.node import Checkpoint, CheckpointRequest, HintReply, SelectedReply
from schemas.sandbox import Reason, SandboxRecord, State
from services.launcher import decisions, records
from services.launcher.drivers.base import NoWritableLayer
from services.launcher.keys import LOGGER, about
from services.launcher.lifecycle import Launcher
from services.launcher.state import Live

log = logging.getLogger(LOGGER)

CHECKPOINT_TIMEOUT_S = 600.0
_PAUSE_REASONS = {"requested": Reason.REQUESTED, "memory_pressure": Reason.MEMORY_PRESSURE}


def _not_quarantined(live: Live) -> None:
    if live.quarantined:
        raise ServiceError(ErrorCode.CONFLICT, f"sandbox {live.id} is quarantined: read its files or destroy it")


async def pause(launcher: Launcher, sandbox_id: str, reason: str = "requested", detail: str = "") -> SandboxRecord:
    """Idempotent: a paused sandbox answers with its record."""
    live = launcher.get_live(sandbox_id)
    _not_quarantined(live)
    async with live.freezing:
        if not live.paused:
            await live.driver.freeze(live.instance)
            live.paused = True
        record, _ = await launcher.store.get(sandbox_id)
        if record.state is State.PAUSED:
            return record
        try:
            return await records.paused(launcher.store, sandbox_id, _PAUSE_REASONS[reason], detail)
        except ServiceError:  # it is ending meanwhile: leave it as the store says
            if not live.ending:
                await live.driver.thaw(live.instance)
                live.paused = False
            raise


async def resume(launcher: Launcher, sandbox_id: str) -> SandboxRecord:
    """Idempotent; refused for a quarantined sandbox, which only destroy (or expiry) ends."""
    live = launcher.get_live(sandbox_id)
    _not_quarantined(live)
    async with live.freezing:
        if live.paused:
            await live.driver.thaw(live.instance)
            live.paused = False
        record, _ = await launcher.store.get(sandbox_id)
        if record.state is State.RUNNING:
            return record
        return await records.resumed(launcher.store, sandbox_id)


async def pause_selected(launcher: Launcher, labels: dict[str, str]) -> SelectedReply:
    return await _each(launcher, labels, lambda live: live.paused or live.quarantined,
                       lambda live: pause(launcher, live.id, "requested", "rollout paused"))


async def resume_selected(launcher: Launcher, labels: dict[str, str]) -> SelectedReply:
    # A quarantined one stays frozen: it counts as unchanged, not as a failure.
    return await _each(launcher, labels, lambda live: not live.paused or live.quarantined,
                       lambda live: resume(launcher, live.id))


async def _each(launcher: Launcher, labels: dict[str, str], done: Callable[[Live], bool],
                act: Callable[[Live], Awaitable[SandboxRecord]]) -> SelectedReply:
    going = {i: live for i, live in launcher.live.items() if not live.ending}
    chosen = [going[i] for i in decisions.selected({i: live.spec.labels for i, live in going.items()}, labels)]
    todo = [live for live in chosen if not done(live)]
    results = await asyncio.gather(*(act(live) for live in todo), return_exceptions=True)
    failures = [f"{live.id}: {getattr(r, 'message', r)}" for live, r in zip(todo, results)
                if isinstance(r, BaseException)]
    return SelectedReply(node=launcher.node_id, matched=len(chosen), changed=len(todo) - len(failures),
                         unchanged=len(chosen) - len(todo), failed=len(failures), errors=failures[:20])


def hint(launcher: Launcher, sandbox_id: str, which: str) -> HintReply:
    live = launcher.get_live(sandbox_id)
    weight = live.driver.set_cpu_weight(live.instance, idle=which == "idle")
    return HintReply(hint=which, file=weight.file, value=weight.value)


async def checkpoint(launcher: Launcher, req: CheckpointRequest) -> Checkpoint:
    live = launcher.get_live(req.sandbox_id)
    try:
        upper = live.driver.writable_layer(live.instance)
    except NoWritableLayer as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    assert live.rootfs is not None  # a writable layer is the upper dir of a composed root
    started = time.perf_counter()
    async with live.freezing:
        was_frozen = live.paused or live.quarantined
        if not was_frozen:  # a consistent picture: nothing writes while the writable layer is packed
            await live.driver.freeze(live.instance)
        try:
            # The layer-cache builds (it owns the store); we only hand it the writable layer.
            built = await launcher.layers.build_from_dir(req.name, upper, on=live.rootfs.layers[-1],
                                                         timeout=CHECKPOINT_TIMEOUT_S)
        except errors.SandfleetError as exc:
            raise ServiceError(getattr(exc, "code", ErrorCode.INTERNAL), f"checkpoint build failed: {exc}") from None
        finally:
            if not was_frozen and not req.keep_paused:
                await live.driver.thaw(live.instance)
        if not was_frozen and req.keep_paused:
            live.paused = True
    if not was_frozen and req.keep_paused:
        await records.paused(launcher.store, req.sandbox_id, Reason.REQUESTED, f"checkpoint {req.name}")
    layers = [*live.rootfs.layers, built.layer.digest]
    await records.checkpointed(launcher.store, req.sandbox_id, layers)
    log.info("checkpointed %s as layer %s %s", req.sandbox_id, req.name, built.layer.digest,
             extra=about(req.sandbox_id))
    return Checkpoint(sandbox_id=req.sandbox_id, node=launcher.node_id, name=req.name, digest=built.layer.digest,
                      base=list(live.rootfs.layers), spec=live.spec, paused=was_frozen or req.keep_paused,
                      created_at=time.time(), seconds=time.perf_counter() - started)


def detect_criu() -> str:
    """Process-level checkpoints need a CRIU whose `criu check` passes on this kernel."""
    path = shutil.which("criu")
    if path is None:
        return "off: criu is not installed"
    try:
        done = subprocess.run([path, "check"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"off: criu check did not run ({exc})"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"off: criu check failed ({why[-1] if why else f'exit {done.returncode}'})"
    return "on: criu check passed"

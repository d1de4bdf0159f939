"""Pause, resume, CPU hints and file checkpoints of this node's sandboxes (RL co-design).

A pause freezes the sandbox's v2 cgroup (cgroup.freeze; SIGKILL still reaches frozen tasks,
so expiry and destroy work on a paused sandbox) and records `paused`; a resume thaws it. A
quarantine (the security monitor) is a pause no plain resume may lift. A hint changes the
sandbox's CPU weight only (v1 cpu.shares on a hybrid host, v2 cpu.weight where v2 has the
cpu controller); its CPU limit (quota) stays. A checkpoint freezes the sandbox, has the
layer-cache build a layer from its writable upper dir (which holds /workspace too) on top of
its layers, and thaws it: the files survive, the processes do not (CRIU is only detected).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time

import msgspec

from sandfleet import errors
from sandfleet.errors import ServiceError
from sandfleet.layers_client import Layers
from schemas.errors import ErrorCode
from schemas.node import Checkpoint, CheckpointRequest, HintReply, SelectedReply
from schemas.sandbox import Reason, SandboxRecord, State
from services.launcher.lifecycle import Launcher, Live, set_frozen

log = logging.getLogger("sandfleet.launcher")

IDLE_SHARES, ACTIVE_SHARES = 2, 1024  # v1 cpu.shares: the kernel's minimum and its default
IDLE_WEIGHT, ACTIVE_WEIGHT = 1, 100  # v2 cpu.weight: likewise
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
            await asyncio.to_thread(set_frozen, live.confinement.cgroup_v2, True)
            live.paused = True
        record, _ = await launcher.store.get(sandbox_id)
        if record.state is State.PAUSED:
            return record
        try:
            return await launcher.store.transition(sandbox_id, State.PAUSED, _PAUSE_REASONS[reason], detail,
                                                   only_from=frozenset({State.RUNNING}))
        except ServiceError:  # it is ending meanwhile: leave it as the store says
            if not live.ending:
                await asyncio.to_thread(set_frozen, live.confinement.cgroup_v2, False)
                live.paused = False
            raise


async def resume(launcher: Launcher, sandbox_id: str) -> SandboxRecord:
    """Idempotent; refused for a quarantined sandbox, which only destroy (or expiry) ends."""
    live = launcher.get_live(sandbox_id)
    _not_quarantined(live)
    async with live.freezing:
        if live.paused:
            await asyncio.to_thread(set_frozen, live.confinement.cgroup_v2, False)
            live.paused = False
        record, _ = await launcher.store.get(sandbox_id)
        if record.state is State.RUNNING:
            return record
        return await launcher.store.transition(sandbox_id, State.RUNNING, only_from=frozenset({State.PAUSED}))


def _selected(launcher: Launcher, labels: dict[str, str]) -> list[Live]:
    return [live for live in launcher.live.values()
            if not live.ending and all(live.spec.labels.get(k) == v for k, v in labels.items())]


async def pause_selected(launcher: Launcher, labels: dict[str, str]) -> SelectedReply:
    return await _each(launcher, labels, lambda live: live.paused or live.quarantined,
                       lambda live: pause(launcher, live.id, "requested", "rollout paused"))


async def resume_selected(launcher: Launcher, labels: dict[str, str]) -> SelectedReply:
    # A quarantined one stays frozen: it counts as unchanged, not as a failure.
    return await _each(launcher, labels, lambda live: not live.paused or live.quarantined,
                       lambda live: resume(launcher, live.id))


async def _each(launcher: Launcher, labels: dict[str, str], done, act) -> SelectedReply:
    chosen = _selected(launcher, labels)
    todo = [live for live in chosen if not done(live)]
    results = await asyncio.gather(*(act(live) for live in todo), return_exceptions=True)
    failures = [f"{live.id}: {getattr(r, 'message', r)}" for live, r in zip(todo, results) if isinstance(r, BaseException)]
    return SelectedReply(node=launcher.node_id, matched=len(chosen), changed=len(todo) - len(failures),
                         unchanged=len(chosen) - len(todo), failed=len(failures), errors=failures[:20])


def cpu_weight_file(live: Live) -> tuple[str, int, int]:
    """(file, idle value, active value): v2 cpu.weight where v2 has the cpu controller, else v1 cpu.shares."""
    v2 = os.path.join(live.confinement.cgroup_v2, "cpu.weight")
    if os.path.exists(v2):
        return v2, IDLE_WEIGHT, ACTIVE_WEIGHT
    for procs in live.confinement.cgroup_procs:
        shares = os.path.join(os.path.dirname(procs), "cpu.shares")
        if os.path.exists(shares):
            return shares, IDLE_SHARES, ACTIVE_SHARES
    raise ServiceError(ErrorCode.UNSUPPORTED, f"sandbox {live.id} has no cpu.weight or cpu.shares to change")


def hint(launcher: Launcher, sandbox_id: str, which: str) -> HintReply:
    live = launcher.get_live(sandbox_id)
    path, idle, active = cpu_weight_file(live)
    value = idle if which == "idle" else active
    with open(path, "w") as f:
        f.write(str(value))
    return HintReply(hint=which, file=path, value=value)


async def checkpoint(launcher: Launcher, req: CheckpointRequest) -> Checkpoint:
    live = launcher.get_live(req.sandbox_id)
    if live.rootfs is None:
        raise ServiceError(ErrorCode.INVALID_REQUEST,
                           f"sandbox {req.sandbox_id} has no layers (host_view): it has no writable layer to pack")
    started = time.perf_counter()
    async with live.freezing:
        was_frozen = live.paused or live.quarantined
        if not was_frozen:  # a consistent picture: nothing writes while the upper dir is packed
            await asyncio.to_thread(set_frozen, live.confinement.cgroup_v2, True)
        try:
            # The layer-cache builds (it owns the store); we only hand it the upper dir.
            built = await Layers(launcher.bus).build_dir(req.name, live.rootfs.upper, on=live.rootfs.layers[-1],
                                                         timeout=CHECKPOINT_TIMEOUT_S)
        except errors.SandfleetError as exc:
            raise ServiceError(getattr(exc, "code", ErrorCode.INTERNAL), f"checkpoint build failed: {exc}") from None
        finally:
            if not was_frozen and not req.keep_paused:
                await asyncio.to_thread(set_frozen, live.confinement.cgroup_v2, False)
        if not was_frozen and req.keep_paused:
            live.paused = True
    if not was_frozen and req.keep_paused:
        await launcher.store.transition(req.sandbox_id, State.PAUSED, Reason.REQUESTED, f"checkpoint {req.name}",
                                        only_from=frozenset({State.RUNNING}))
    layers = [*live.rootfs.layers, built.layer.digest]
    # Kept on the record: placement restores the sandbox from it elsewhere if this node is lost.
    await launcher.store.update(req.sandbox_id, lambda r: msgspec.structs.replace(r, checkpoint=layers))
    log.info("checkpointed %s as layer %s %s", req.sandbox_id, req.name, built.layer.digest)
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

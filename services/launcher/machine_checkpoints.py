"""Memory checkpoints (`checkpoint(memory=True)`) of this node's VM sandboxes.

The VM's driver saves the running machine (RAM with the writable layer in it, devices, the
guest's processes) and what a restoring node needs into a directory; the layer-cache builds
it into a layer over the sandbox's disk layers, as a files checkpoint's writable layer is
built, so it reaches any node the way every layer does (the store, fetched on demand).
`fleet.restore` names that layer on top with `machine_state` set, and the VM's driver starts
from it instead of attaching it. Levels whose drivers cannot save a machine answer
`unsupported`: their checkpoints keep files only.

A memory checkpoint is not written to the record's `checkpoint` (what placement restores a
sandbox of a lost node from): that restore gives the layers as disks, which a state is not.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from sandfleet import errors
from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.node import Checkpoint, CheckpointRequest, MachineState
from schemas.sandbox import Reason
from services.launcher import records
from services.launcher.driver_errors import translated
from services.launcher.drivers.base import Instance
from services.launcher.keys import LOGGER, about
from services.launcher.lifecycle import Launcher

log = logging.getLogger(LOGGER)

BUILD_TIMEOUT_S = 600.0  # the state is about the guest's RAM in size (~90 MB per 256 MB)


@runtime_checkable
class MachineSaving(Protocol):
    """A driver whose sandboxes are machines whose whole state can be saved (the VM levels)."""

    async def save_machine_state(self, instance: Instance) -> tuple[Path, MachineState]: ...

    def drop_machine_state(self, into: Path) -> None: ...


async def checkpoint(launcher: Launcher, req: CheckpointRequest) -> Checkpoint:
    live = launcher.get_live(req.sandbox_id)
    driver = live.driver
    if not isinstance(driver, MachineSaving):
        raise ServiceError(ErrorCode.UNSUPPORTED, f"checkpoint(memory=True) keeps running processes of VM levels "
                                                  f"only; isolation {live.spec.isolation!r} keeps files only "
                                                  "(memory=False)")
    assert live.rootfs is not None  # a VM's disks are its composed root's layers
    # A restored VM's own top layer is the state it came from: its disks are the ones below.
    disks = list(live.rootfs.layers[:-1] if live.spec.machine_state else live.rootfs.layers)
    started = time.perf_counter()
    async with live.freezing:
        if live.paused or live.quarantined:
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {live.id} is paused: a machine's state is saved "
                                                   "running (resume it first)")
        with translated(f"checkpoint {req.sandbox_id}", path=False):
            into, machine = await driver.save_machine_state(live.instance)
        try:
            built = await launcher.layers.build_from_dir(req.name, into, on=disks[-1], timeout=BUILD_TIMEOUT_S)
        except errors.SandfleetError as exc:
            raise ServiceError(getattr(exc, "code", ErrorCode.INTERNAL), f"checkpoint build failed: {exc}") from None
        finally:
            driver.drop_machine_state(into)
        if req.keep_paused:  # saved running; frozen after, so the original does not go on (a migration)
            with translated(f"freeze {req.sandbox_id}", path=False):
                await live.driver.freeze(live.instance)
            live.paused = True
    if req.keep_paused:
        await records.paused(launcher.store, req.sandbox_id, Reason.REQUESTED, f"checkpoint {req.name}")
    seconds = time.perf_counter() - started
    log.info("memory checkpoint of %s as layer %s %s (%d MiB) in %.1f s", req.sandbox_id, req.name,
             built.layer.digest, machine.size >> 20, seconds, extra=about(req.sandbox_id))
    return Checkpoint(sandbox_id=req.sandbox_id, node=launcher.node_id, name=req.name, digest=built.layer.digest,
                      base=disks, spec=live.spec, processes=True, paused=req.keep_paused, created_at=time.time(),
                      seconds=seconds, machine=machine)

"""A VM's memory checkpoint as its layer holds it: the running machine's saved state
(`machine.state`) and what a node restoring it needs (`machine.json`, a schemas.node.MachineState),
written by the node that saves it (`save`) and checked by the node that restores it (`checked`).

The restoring node reads both as hostile input: the layer is anyone's who may build layers, and
the handle naming it is the client's. Needs it does not meet are `Unsupported` (another node
may meet them); a file that is not a regular one, bigger than the machine could have written or
missing is refused before QEMU sees it; what QEMU itself refuses the driver refuses too.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec

from linuxnode.vm.runtime import MachineNeeds, MicroVMs, RunningVM
from sandfleet import errors
from schemas.node import MachineState
from services.launcher.drivers.base import LaunchRefused

STATE_FILE, NEEDS_FILE = "machine.state", "machine.json"
CHECKPOINT_DIR = "checkpoint"  # in the VM's own directory while its layer is built (gone with it)
MAX_NEEDS_BYTES = 4096
# A saved state holds at most the guest's RAM (its zero pages are not written) plus the devices'
# (a `vm`'s card memory, up to 32 MiB at the largest screen): anything bigger is not one.
STATE_SLACK_MB = 128


async def save(vms: MicroVMs, vm: RunningVM, level: str) -> tuple[Path, MachineState]:
    """`vm` saved running into `<its directory>/checkpoint/` with its needs; the directory and
    the needs. Nothing of it stays if the save fails."""
    into = vm.run_dir / CHECKPOINT_DIR
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(mode=0o700)  # root's: QEMU, once it has dropped root, cannot read it
    try:
        await vms.save_running(vm, into / STATE_FILE)
        needs = await asyncio.to_thread(vms.needs)
        kept = MachineState(level=level, machine=needs.machine, accelerator=needs.accelerator, cpu=needs.cpu,
                            qemu=needs.qemu, guest=needs.guest, size=(into / STATE_FILE).stat().st_size)
        (into / NEEDS_FILE).write_bytes(msgspec.json.encode(kept))
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise
    return into, kept


def checked(inside: Callable[[str], Path], level: str, mine: Callable[[], MachineNeeds], guest_mb: int) -> Path:
    """The state file of the layer whose files `inside(name)` reaches, once its needs are this
    node's (`mine()`, a `level` machine) and the file is one a machine of `guest_mb` could have
    written (blocking)."""
    try:
        fd = os.open(inside(NEEDS_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_NEEDS_BYTES + 1)
        if len(raw) > MAX_NEEDS_BYTES:
            raise LaunchRefused(f"the machine state's {NEEDS_FILE} is over {MAX_NEEDS_BYTES} bytes")
        theirs = msgspec.json.decode(raw, type=MachineState)
    except OSError as exc:
        raise LaunchRefused(f"the top layer holds no machine state ({NEEDS_FILE}: {exc.strerror})") from None
    except msgspec.MsgspecError as exc:
        raise LaunchRefused(f"the machine state's {NEEDS_FILE} is not one: {exc}") from None
    why = mine().mismatch(MachineNeeds(theirs.machine, theirs.accelerator, theirs.cpu, theirs.qemu, theirs.guest))
    if theirs.level != level:
        why = "; ".join(filter(None, [f"level {theirs.level!r} (this is {level!r})", why]))
    if why:
        raise errors.Unsupported(f"this node cannot restore the machine state: it was saved with {why}")
    state = inside(STATE_FILE)
    try:
        found = os.lstat(state)
    except OSError as exc:
        raise LaunchRefused(f"the top layer holds no machine state ({STATE_FILE}: {exc.strerror})") from None
    if not stat.S_ISREG(found.st_mode):
        raise LaunchRefused(f"the machine state {STATE_FILE} is not a regular file")
    if found.st_size > (guest_mb + STATE_SLACK_MB) << 20:
        raise LaunchRefused(f"the machine state is {found.st_size >> 20} MiB: more than a machine of "
                            f"{guest_mb} MiB writes")
    return state

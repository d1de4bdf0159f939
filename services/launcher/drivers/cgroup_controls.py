"""What every level does to a sandbox from outside, through the cgroups its confinement made:
freeze and thaw (cgroup.freeze), and the idle hint's CPU weight. The process, container and
both VM levels share these (a VM's cgroup holds its QEMU)."""

from __future__ import annotations

import asyncio

from linuxnode import cgroups
from schemas.node import Confinement
from services.launcher.drivers.base import CpuWeight, DriverFailure, Unsupported


async def set_frozen(confinement: Confinement, frozen: bool) -> None:
    try:
        await asyncio.to_thread(cgroups.set_frozen, confinement.cgroup_v2, frozen)
    except cgroups.CgroupError as exc:
        raise DriverFailure(str(exc)) from None


def set_cpu_weight(sandbox_id: str, confinement: Confinement, idle: bool) -> CpuWeight:
    found = cgroups.cpu_weight_file(confinement.cgroup_v2, confinement.cgroup_procs)
    if found is None:
        raise Unsupported(f"sandbox {sandbox_id} has no cpu.weight or cpu.shares to change")
    return CpuWeight(file=found.path, value=found.write(idle))

"""The launcher's runtime drivers, one per isolation level, behind one small interface:
start an init in a confinement (and on a composed root, when the sandbox has layers), run a
command in it, stop it. Files go through the `process` runtime's openat2 reads and writes
from the init's root for every level: a container's init has a root like any process.

A command in a container is run the way `process` runs one, by the spawner's exec helper
(join the cgroups, setns into every namespace of the init, chroot into its root, drop every
capability, no_new_privs, the sandbox's Landlock policy and seccomp filter, see
linuxnode/process/children.py), not by `crun exec`: that is the confinement crun
would give it from the bundle (see linuxnode/container.py), for less CPU, and one
exec path for every level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from linuxnode import process as process_runtime
from linuxnode.container import ContainerSpec, Crun
from linuxnode.process import InitProcess, ProcessSpec
from schemas.layers import Rootfs
from schemas.node import MAX_OUTPUT_BYTES, Confinement, ExecRequest
from schemas.sandbox import SandboxSpec

log = logging.getLogger("sandfleet.launcher")


class LaunchRefused(Exception):
    """This node cannot start what was asked (a level it lacks, a container without a root)."""


class ExecFailed(Exception):
    """The command could not be started in the sandbox (its init is gone, a join failed)."""


@dataclass(frozen=True)
class ExecOutcome:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool


class Driver(Protocol):
    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> InitProcess: ...

    async def exec(self, sandbox_id: str, init: InitProcess, confinement: Confinement,
                   req: ExecRequest) -> ExecOutcome: ...

    async def stop(self, sandbox_id: str, init: InitProcess | None) -> None: ...


def _tmp_size_mb(spec: SandboxSpec) -> int:
    return max(16, spec.memory_mb // 2)


class ProcessDriver:
    """`process`: the spawner-based runtime; with layers, its root is the composed overlay."""

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> InitProcess:
        return await process_runtime.start_async(
            ProcessSpec(
                sandbox_id=sandbox_id,
                cgroup_procs=confinement.cgroup_procs,
                netns=confinement.netns,
                tmp_size_mb=_tmp_size_mb(spec),
                workspace_size_mb=spec.disk_mb,  # the host view's one writable disk
                **({"rootfs_dir": rootfs.path} if rootfs is not None else {}),
            )
        )

    async def exec(self, sandbox_id: str, init: InitProcess, confinement: Confinement,
                   req: ExecRequest) -> ExecOutcome:
        try:
            r = await process_runtime.exec(
                init, list(req.argv), cgroup_procs=confinement.cgroup_procs, env=dict(req.env), cwd=req.cwd,
                stdin=req.stdin, timeout_s=req.timeout_s, max_output=MAX_OUTPUT_BYTES,
            )
        except process_runtime.ExecError as exc:
            raise ExecFailed(str(exc)) from None
        return ExecOutcome(r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated)

    async def stop(self, sandbox_id: str, init: InitProcess | None) -> None:
        if init is not None:
            await process_runtime.kill_async(init)


class ContainerDriver(ProcessDriver):
    """`container`: crun over the composed overlay; a container needs a root of layers. Its
    commands run as a process sandbox's do (see the module docstring)."""

    def __init__(self, crun: Crun) -> None:
        self.crun = crun

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> InitProcess:
        if rootfs is None:
            raise LaunchRefused("a container has no host view: name its layers, e.g. layers=['base']")
        return await self.crun.start(
            ContainerSpec(sandbox_id=sandbox_id, rootfs=rootfs.path, cgroup_procs=confinement.cgroup_procs,
                          netns=confinement.netns, tmp_size_mb=_tmp_size_mb(spec))
        )

    async def stop(self, sandbox_id: str, init: InitProcess | None) -> None:
        await self.crun.remove(sandbox_id, init)


class Runtimes:
    """The drivers this node has; `container` only where crun was found to work at start."""

    def __init__(self, crun: Crun | None = None) -> None:
        self.crun = crun
        self.drivers: dict[str, Driver] = {"process": ProcessDriver()}
        if crun is not None:
            self.drivers["container"] = ContainerDriver(crun)

    @property
    def levels(self) -> list[str]:
        return list(self.drivers)

    def driver(self, isolation: str) -> Driver:
        found = self.drivers.get(isolation)
        if found is None:
            raise LaunchRefused(f"this node cannot run isolation {isolation!r}; it offers {self.levels}")
        return found

    async def leftovers(self, keep: set[str]) -> list[str]:
        """Remove containers a crash left (crun state or bundle) that no kept sandbox owns."""
        if self.crun is None:
            return []
        gone = sorted(self.crun.containers() - keep)
        for sandbox_id in gone:
            await self.crun.remove(sandbox_id, None)
        return gone


async def detect_crun(state_dir: Path) -> Crun | None:
    """crun, if it is installed and a real container starts here; None (and why, in the log) if not."""
    try:
        crun = Crun.find(state_dir)
    except Exception as exc:  # e.g. no cgroup v2 at all: then no container either
        log.warning("crun cannot be set up here (%s): this node offers no `container` isolation", exc)
        return None
    if crun is None:
        log.info("crun is not installed: this node offers no `container` isolation")
        return None
    why = await crun.probe()
    if why is not None:
        log.warning("crun does not work here (%s): this node offers no `container` isolation", why)
        crun.close()
        return None
    return crun

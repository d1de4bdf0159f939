"""The `container` level: crun over the composed overlay (linuxnode.container); a container
needs a root of layers. Everything after the start goes as for a `process` sandbox (its init
has a root, namespaces and cgroups like any), not through `crun exec`: the spawner gives a
command the confinement crun would give it from the bundle, for less CPU, and every namespace
level keeps one exec path (see linuxnode/container.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from linuxnode import roots_ns, userns
from linuxnode.container import ContainerError, ContainerSpec, Crun
from linuxnode.process import InitProcess
from schemas.layers import Rootfs
from schemas.node import Confinement
from schemas.sandbox import SandboxSpec
from services.launcher.drivers.base import Anchor, Instance, LaunchRefused, StartFailed
from services.launcher.drivers.process import NamespaceSandbox, ProcessDriver, tmp_size_mb

log = logging.getLogger("sandfleet.launcher")


class ContainerDriver(ProcessDriver):
    def __init__(self, crun: Crun, ids: userns.IdRange | None = None, roots: roots_ns.RootsView | None = None) -> None:
        super().__init__(ids, roots)
        self.crun = crun

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        if rootfs is None:
            raise LaunchRefused("a container has no host view: name its layers, e.g. layers=['base']")
        self.check_build(spec, rootfs)
        tree = await self.root_tree(rootfs)
        try:
            init = await self.crun.start(
                ContainerSpec(sandbox_id=sandbox_id, rootfs=rootfs.path, cgroup_procs=confinement.cgroup_procs,
                              netns=confinement.netns, tmp_size_mb=tmp_size_mb(spec),
                              apparmor_profile=confinement.apparmor_profile, id_host=self.id_host(rootfs),
                              root_tree=tree)
            )
        except ContainerError as exc:
            raise StartFailed(str(exc)) from None
        finally:
            if tree >= 0:
                os.close(tree)
        return NamespaceSandbox(sandbox_id, init, confinement, rootfs, spec.build)

    async def stop(self, sandbox_id: str, anchor: Anchor | None) -> None:
        init = InitProcess(anchor.pid, anchor.start_time) if anchor is not None else None
        await self.crun.remove(sandbox_id, init)

    async def leftovers(self, keep: set[str]) -> list[str]:
        """Containers a crash left (crun state or bundle) that no kept sandbox owns."""
        gone = sorted(self.crun.containers() - keep)
        for sandbox_id in gone:
            await self.crun.remove(sandbox_id, None)
        return gone

    def close(self) -> None:
        self.crun.close()


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

"""The `process` level: a sandbox is a pause-mode init in fresh namespaces started by the node
library's spawner (linuxnode.process), on the composed overlay when it has layers or on the
host's read-only system directories (the host view) when it does not.

Everything here enters the sandbox from the host, and the `container` driver does the same:
commands through the spawner's exec helper (join the cgroups, setns into every namespace of
the init, chroot into its root, drop every capability, the Landlock policy and seccomp
filter), files with openat2(RESOLVE_IN_ROOT) from the init's root, freezing and the CPU
weight through the sandbox's cgroup files (linuxnode.cgroups), exit through a pidfd.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linuxnode import cgroups
from linuxnode import process as process_runtime
from linuxnode.process import InitProcess, ProcessSpec, fileops, transfer
from linuxnode.process.watch import DirWatch
from schemas.layers import Rootfs
from schemas.node import Confinement
from schemas.sandbox import SandboxSpec
from services.launcher.drivers.base import (
    Anchor,
    Command,
    CpuWeight,
    DirectoryWatch,
    DownloadSource,
    DriverFailure,
    ExecFailed,
    ExecOutcome,
    Instance,
    NoWritableLayer,
    SandboxGone,
    StartFailed,
    Unsupported,
    UploadSink,
)


@dataclass(frozen=True)
class NamespaceSandbox:
    """A namespace sandbox: its init and the confinement and root it runs in."""

    sandbox_id: str
    init: InitProcess
    confinement: Confinement
    rootfs: Rootfs | None

    @property
    def anchor(self) -> Anchor:
        return Anchor(self.init.pid, self.init.start_time)


def _own(instance: Instance) -> NamespaceSandbox:
    if not isinstance(instance, NamespaceSandbox):
        raise TypeError(f"not a namespace sandbox: {type(instance).__name__}")
    return instance


def _init(anchor: Anchor) -> InitProcess:
    return InitProcess(pid=anchor.pid, start_time=anchor.start_time)


def tmp_size_mb(spec: SandboxSpec) -> int:
    return max(16, spec.memory_mb // 2)


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (adopted after a restart): the supervisor reaps it


class ProcessDriver:
    """`process`, and the host-side operations every namespace level shares."""

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        try:
            init = await process_runtime.start_async(
                ProcessSpec(
                    sandbox_id=sandbox_id,
                    cgroup_procs=confinement.cgroup_procs,
                    netns=confinement.netns,
                    tmp_size_mb=tmp_size_mb(spec),
                    workspace_size_mb=spec.disk_mb,  # the host view's one writable disk
                    **({"rootfs_dir": rootfs.path} if rootfs is not None else {}),
                )
            )
        except process_runtime.RuntimeStartError as exc:
            raise StartFailed(str(exc)) from None
        return NamespaceSandbox(sandbox_id, init, confinement, rootfs)

    async def stop(self, sandbox_id: str, anchor: Anchor | None) -> None:
        if anchor is not None:
            await process_runtime.kill_async(_init(anchor))
            reap(anchor.pid)

    def alive(self, anchor: Anchor) -> bool:
        return process_runtime.is_alive(_init(anchor))

    async def adopt(self, sandbox_id: str, anchor: Anchor, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        return NamespaceSandbox(sandbox_id, _init(anchor), confinement, rootfs)

    def watch(self, instance: Instance, on_exit: Callable[[], None]) -> Callable[[], None]:
        pid = _own(instance).init.pid
        loop = asyncio.get_running_loop()
        watching: list[int] = []

        def unwatch() -> None:
            if watching:
                loop.remove_reader(watching[0])
                os.close(watching.pop())

        def exited() -> None:
            unwatch()
            reap(pid)
            on_exit()

        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return loop.call_soon(exited).cancel
        watching.append(pidfd)
        loop.add_reader(pidfd, exited)
        return unwatch

    async def exec(self, instance: Instance, command: Command) -> ExecOutcome:
        sandbox = _own(instance)
        try:
            r = await process_runtime.exec(
                sandbox.init, list(command.argv), cgroup_procs=sandbox.confinement.cgroup_procs, env=command.env,
                cwd=command.cwd, stdin=command.stdin, timeout_s=command.timeout_s, max_output=command.max_output,
            )
        except process_runtime.ExecError as exc:
            raise ExecFailed(str(exc)) from None
        return ExecOutcome(r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated)

    def read_file(self, instance: Instance, path: str, max_bytes: int) -> bytes:
        try:
            return process_runtime.read_file(_own(instance).init, path, max_bytes)
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

    def write_file(self, instance: Instance, path: str, data: bytes, mode: int) -> int:
        try:
            return process_runtime.write_file(_own(instance).init, path, data, mode)
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

    async def freeze(self, instance: Instance) -> None:
        await self._set_frozen(_own(instance), True)

    async def thaw(self, instance: Instance) -> None:
        await self._set_frozen(_own(instance), False)

    @staticmethod
    async def _set_frozen(sandbox: NamespaceSandbox, frozen: bool) -> None:
        try:
            await asyncio.to_thread(cgroups.set_frozen, sandbox.confinement.cgroup_v2, frozen)
        except cgroups.CgroupError as exc:
            raise DriverFailure(str(exc)) from None

    def set_cpu_weight(self, instance: Instance, idle: bool) -> CpuWeight:
        sandbox = _own(instance)
        found = cgroups.cpu_weight_file(sandbox.confinement.cgroup_v2, sandbox.confinement.cgroup_procs)
        if found is None:
            raise Unsupported(f"sandbox {sandbox.sandbox_id} has no cpu.weight or cpu.shares to change")
        return CpuWeight(file=found.path, value=found.write(idle))

    def writable_layer(self, instance: Instance) -> Path:
        sandbox = _own(instance)
        if sandbox.rootfs is None:
            raise NoWritableLayer(f"sandbox {sandbox.sandbox_id} has no layers (host_view): "
                                  "it has no writable layer to pack")
        return Path(sandbox.rootfs.upper)  # the overlay's upper dir, which holds /workspace too

    async def leftovers(self, keep: set[str]) -> list[str]:
        return []  # a process sandbox leaves nothing the agent and layer-cache do not reclaim

    def close(self) -> None:
        pass

    # -- files: uploads and downloads of any size, the file tree -----------------------------

    def open_upload(self, instance: Instance, path: str, kind: str, mode: int, depth: int) -> UploadSink:
        init = _own(instance).init
        try:
            if kind == "dir":
                return transfer.TreeSink(init, path, depth)
            return transfer.FileSink(init, path, mode)
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

    def open_download(self, instance: Instance, path: str, chunk: int, depth: int) -> DownloadSource:
        try:
            return transfer.open_source(_own(instance).init, path, chunk, depth)
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

    _FILE_OPS = {"stat": fileops.stat_path, "list": fileops.list_dir, "mkdir": fileops.mkdir,
                 "remove": fileops.remove, "rename": fileops.rename}

    def open_watch(self, instance: Instance, path: str, recursive: bool, max_dirs: int) -> DirectoryWatch:
        try:
            return DirWatch(_own(instance).init, path, recursive, max_dirs)
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

    def file_op(self, instance: Instance, op: str, *args) -> object:
        try:
            return self._FILE_OPS[op](_own(instance).init, *args)
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

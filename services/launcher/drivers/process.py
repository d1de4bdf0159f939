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
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linuxnode import cgroups, netns, procfs, roots_ns, userns
from linuxnode import process as process_runtime
from linuxnode.process import InitProcess, ProcessSpec, background, fileops, terminal, transfer
from linuxnode.process.watch import DirWatch
from schemas.layers import Rootfs
from schemas.node import Confinement
from schemas.sandbox import SandboxSpec
from services.launcher.drivers import cgroup_controls
from services.launcher.drivers.base import (
    Anchor,
    Command,
    CpuWeight,
    DirectoryWatch,
    DownloadSource,
    ExecFailed,
    ExecOutcome,
    Instance,
    LaunchRefused,
    NoWritableLayer,
    RunningCommand,
    RunningTerminal,
    SandboxGone,
    StartFailed,
    StdinClosed,
    Unsupported,
    UploadSink,
    Usage,
    reap,
    watch_exit,
)


@dataclass(frozen=True)
class NamespaceSandbox:
    """A namespace sandbox: its init and the confinement and root it runs in."""

    sandbox_id: str
    init: InitProcess
    confinement: Confinement
    rootfs: Rootfs | None
    build: bool = False  # a build sandbox (SandboxSpec.build): its commands may write its system dirs

    @property
    def anchor(self) -> Anchor:
        return Anchor(self.init.pid, self.init.start_time)


def _own(instance: Instance) -> NamespaceSandbox:
    if not isinstance(instance, NamespaceSandbox):
        raise TypeError(f"not a namespace sandbox: {type(instance).__name__}")
    return instance


CONNECT_TIMEOUT_S = 5.0  # a forward's connect to a port inside the sandbox


def tmp_size_mb(spec: SandboxSpec) -> int:
    return max(16, spec.memory_mb // 2)


class ProcessDriver:
    """`process`, and the host-side operations every namespace level shares. `ids`: the node's
    user-namespace range (linuxnode.userns.node_range), None where roots are the host's uid 0."""

    def __init__(self, ids: userns.IdRange | None = None, roots: roots_ns.RootsView | None = None) -> None:
        self.ids = ids
        # Where roots of layers are mounted (the node's roots namespace); None: this process's own.
        self.roots = roots

    async def root_tree(self, rootfs: Rootfs) -> int:
        """A detached clone of the composed root, for the runtime to attach in the sandbox's own
        namespace (the caller closes it); -1 where roots are in this process's own namespace."""
        if self.roots is None:
            return -1
        try:
            return await asyncio.to_thread(self.roots.clone, rootfs.path)
        except OSError as exc:
            raise StartFailed(f"cannot clone the root {rootfs.path}: {exc.strerror}") from None

    def host_path(self, path: str) -> str:
        """A path of the roots namespace as this process reaches it."""
        return self.roots.path(path) if self.roots is not None else path

    def id_host(self, rootfs: Rootfs | None) -> int:
        """Who the sandbox's root is on the host: for a root of layers, the id its layers were
        idmapped to (the layer-cache's word, on the Rootfs: a root it composed unmapped runs
        unmapped, or the sandbox could not write its own files); for the host view, the node's."""
        if rootfs is not None:
            return rootfs.id_host
        return self.ids.host if self.ids is not None else 0

    def check_build(self, spec: SandboxSpec, rootfs: Rootfs | None) -> None:
        """A build sandbox's root keeps capabilities, which only a user namespace makes harmless."""
        if spec.build and not self.id_host(rootfs):
            raise LaunchRefused("a build sandbox needs a user namespace, and this node runs sandbox roots as the "
                                "host's root (SANDFLEET_USERNS=off)")

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        self.check_build(spec, rootfs)
        tree = await self.root_tree(rootfs) if rootfs is not None else -1
        try:
            init = await process_runtime.start_async(
                ProcessSpec(
                    sandbox_id=sandbox_id,
                    cgroup_procs=confinement.cgroup_procs,
                    netns=confinement.netns,
                    tmp_size_mb=tmp_size_mb(spec),
                    workspace_size_mb=spec.disk_mb,  # the host view's one writable disk
                    apparmor_profile=confinement.apparmor_profile,
                    id_host=self.id_host(rootfs),
                    **({"rootfs_dir": rootfs.path, "root_tree": tree} if rootfs is not None else {}),
                )
            )
        except process_runtime.RuntimeStartError as exc:
            raise StartFailed(str(exc)) from None
        finally:
            if tree >= 0:
                os.close(tree)
        return NamespaceSandbox(sandbox_id, init, confinement, rootfs, spec.build)

    async def stop(self, sandbox_id: str, anchor: Anchor | None) -> None:
        if anchor is not None:
            await process_runtime.kill_async(anchor.process())
            reap(anchor.pid)

    def alive(self, anchor: Anchor) -> bool:
        return process_runtime.is_alive(anchor.process())

    async def adopt(self, sandbox_id: str, anchor: Anchor, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        return NamespaceSandbox(sandbox_id, anchor.process(), confinement, rootfs, spec.build)

    def watch(self, instance: Instance, on_exit: Callable[[], None]) -> Callable[[], None]:
        return watch_exit(_own(instance).init.pid, on_exit)

    def why_ended(self, instance: Instance) -> str:
        return ""  # its init's exit is all there is to say

    async def exec(self, instance: Instance, command: Command) -> ExecOutcome:
        sandbox = _own(instance)
        try:
            r = await process_runtime.exec(
                sandbox.init, list(command.argv), cgroup_procs=sandbox.confinement.cgroup_procs, env=command.env,
                apparmor=sandbox.confinement.apparmor_profile, uid=command.uid, gid=command.gid, build=sandbox.build,
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
        await cgroup_controls.set_frozen(_own(instance).confinement, True)

    async def thaw(self, instance: Instance) -> None:
        await cgroup_controls.set_frozen(_own(instance).confinement, False)

    def set_cpu_weight(self, instance: Instance, idle: bool) -> CpuWeight:
        sandbox = _own(instance)
        return cgroup_controls.set_cpu_weight(sandbox.sandbox_id, sandbox.confinement, idle)

    def writable_layer(self, instance: Instance) -> Path:
        sandbox = _own(instance)
        if sandbox.rootfs is None:
            raise NoWritableLayer(f"sandbox {sandbox.sandbox_id} has no layers (host_view): "
                                  "it has no writable layer to pack")
        return Path(self.host_path(sandbox.rootfs.upper))  # the overlay's upper dir, which holds /workspace too

    async def leftovers(self, keep: set[str]) -> list[str]:
        return []  # a process sandbox leaves nothing the agent and layer-cache do not reclaim

    def close(self) -> None:
        pass

    # -- health: what a sandbox uses, read from outside it ------------------------------------

    async def usage(self, instance: Instance) -> Usage:
        sandbox = _own(instance)
        upper = self.host_path(sandbox.rootfs.upper) if sandbox.rootfs is not None else None
        return await asyncio.to_thread(_usage, sandbox, upper)

    # -- background processes (issue 12: processes) --------------------------------------

    async def spawn(self, instance: Instance, command: Command, on_output: Callable[[int, bytes], None],
                    on_exit: Callable[[int], None]) -> RunningCommand:
        sandbox = _own(instance)
        try:
            running = await background.spawn(sandbox.init, list(command.argv),
                                             cgroup_procs=sandbox.confinement.cgroup_procs, env=command.env,
                                             apparmor=sandbox.confinement.apparmor_profile, uid=command.uid,
                                             gid=command.gid, build=sandbox.build,
                                             cwd=command.cwd, on_output=on_output, on_exit=on_exit,
                                             read_bytes=command.max_output // 2)
        except process_runtime.ExecError as exc:
            raise ExecFailed(str(exc)) from None
        return _Background(running)

    # -- ports: forwarding a TCP connection to the sandbox's own ports ---------------------

    async def connect_port(self, instance: Instance, host: str, port: int) -> socket.socket:
        sandbox = _own(instance)
        host = _own_address(sandbox, host)
        if not process_runtime.is_alive(sandbox.init):
            raise SandboxGone("the sandbox's init is gone")
        try:
            # Made inside the sandbox's own namespace, so even its loopback is the sandbox's: the
            # host's and other sandboxes' listeners are out of reach.
            sock = netns.socket_inside(sandbox.confinement.netns, socket.AF_INET6 if ":" in host else socket.AF_INET)
        except FileNotFoundError:
            raise SandboxGone("the sandbox's network namespace is gone") from None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):  # a full accept queue must not hold the tunnel open
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def port_listens(self, instance: Instance, host: str, port: int) -> bool:
        sandbox = _own(instance)
        host = _own_address(sandbox, host)
        try:
            return netns.listens(sandbox.init.pid, host, port)  # the init's /proc shows its namespace
        except ProcessLookupError:
            raise SandboxGone("the sandbox's init is gone") from None

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

    # -- PTY: a background command on a terminal the node holds -----------------------------

    async def spawn_terminal(self, instance: Instance, command: Command, cols: int, rows: int,
                             on_output: Callable[[int, bytes], None],
                             on_exit: Callable[[int], None]) -> RunningTerminal:
        sandbox = _own(instance)
        try:
            running = await terminal.spawn(sandbox.init, list(command.argv),
                                           cgroup_procs=sandbox.confinement.cgroup_procs, env=command.env,
                                           apparmor=sandbox.confinement.apparmor_profile, uid=command.uid,
                                           gid=command.gid, build=sandbox.build,
                                           cwd=command.cwd, cols=cols, rows=rows, on_output=on_output,
                                           on_exit=on_exit, read_bytes=command.max_output // 2)
        except process_runtime.ExecError as exc:
            raise ExecFailed(str(exc)) from None
        return _Terminal(running)


def _usage(sandbox: NamespaceSandbox, upper: str | None) -> Usage:
    """Its cgroup files, its writable layer, and /proc/<init>/net/dev (which shows the host the
    counters of the init's network namespace: `lo` and the sandbox's end of its veth)."""
    try:
        used = cgroups.read_usage(sandbox.confinement.cgroup_v2, sandbox.confinement.cgroup_procs)
    except FileNotFoundError:
        raise SandboxGone("the sandbox's cgroup is gone") from None
    interfaces = procfs.read_net_dev(sandbox.init.pid)
    if not process_runtime.is_alive(sandbox.init):
        raise SandboxGone("the sandbox's init is gone")  # and a recycled pid's figures are not its own
    if upper is not None:  # its upper dir, as the roots namespace has it
        disk = _bytes_used(Path(upper))
    else:  # the host view: its one writable disk is the /workspace tmpfs in its mount namespace
        disk = _filesystem_used(Path(f"/proc/{sandbox.init.pid}/root/workspace"))
    return Usage(cpu_s=used.cpu_usec / 1e6 if used.cpu_usec >= 0 else -1.0, memory_bytes=used.memory_bytes,
                 memory_peak_bytes=used.memory_peak_bytes, memory_limit_bytes=used.memory_limit_bytes,
                 disk_bytes=disk, processes=used.processes,
                 interfaces=[(i.name, i.rx_bytes, i.tx_bytes) for i in interfaces])


def _bytes_used(upper: Path) -> int:
    """The upper dir's usage: its tmpfs's (a root with a disk limit has one of its own, holding only
    the upper and overlay work dirs) in O(1), else the blocks of every file in it, hard links once."""
    try:
        if os.path.ismount(upper.parent):
            return _filesystem_used(upper)
        seen: set[tuple[int, int]] = set()
        total = 0
        for root, dirs, files in os.walk(upper):
            for name in dirs + files:
                st = os.lstat(os.path.join(root, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total
    except FileNotFoundError:
        return -1


def _filesystem_used(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return (st.f_blocks - st.f_bfree) * st.f_frsize
class _Background:
    """The node library's background command, its stdin error in the seam's terms."""

    def __init__(self, running: background.BackgroundCommand) -> None:
        self.running = running

    @property
    def os_pid(self) -> int | None:
        return self.running.os_pid

    @property
    def stdin_open(self) -> bool:
        return self.running.stdin_open

    async def write(self, data: bytes) -> int:
        try:
            return await self.running.write(data)
        except background.StdinClosed as exc:
            raise StdinClosed(str(exc)) from None

    def close_stdin(self) -> None:
        self.running.close_stdin()

    def signal(self, number: int) -> bool:
        return self.running.signal(number)

    def close(self) -> None:
        self.running.close()


class _Terminal(_Background):
    running: terminal.Terminal

    def resize(self, cols: int, rows: int) -> bool:
        return self.running.resize(cols, rows)


def _own_address(sandbox: NamespaceSandbox, host: str) -> str:
    """The address a forward names, as an address of the sandbox itself, or why it is not one."""
    if host == "own":
        if not sandbox.confinement.address:
            raise Unsupported(f"sandbox {sandbox.sandbox_id} has no egress address of its own: use its loopback")
        return sandbox.confinement.address
    if host == "localhost":
        return "127.0.0.1"
    if host not in ("127.0.0.1", "::1"):
        raise ValueError(f"{host!r} is not an address of the sandbox itself")
    return host

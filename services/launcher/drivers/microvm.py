"""The `microvm` level: a QEMU machine per sandbox (linuxnode.vm), its root the sandbox's layer
stack as read-only disks, everything inside reached through the guest agent.

The hypervisor is the boundary: QEMU runs in the sandbox's cgroups (so freeze is pause, the
memory limit holds guest RAM and QEMU together, kill is destroy) and network namespace, with
its seccomp sandbox on and no network device unless the sandbox has allow rules (then a
user-mode NIC whose host-side sockets the node's egress policing sees). The composed overlay the layer-cache makes for
every sandbox is not entered: its mounts only say which image files to attach
(linuxnode/vm/layer_disks.py). A guest that breaks the agent protocol, floods it with what it
does not allow or stops answering is killed on the spot; the launcher then sees QEMU end and
fails the sandbox (`process_exited`), and the log says why.

**Memory checkpoints** (`save_machine_state`; a spec's `machine_state`): the running machine's
whole state (RAM, which holds the writable layer too, and devices) and the needs of a node that
may restore it, packed by the launcher as one layer over the sandbox's; a VM started from such
a layer never attaches it as a disk, and checks it as hostile input first (machine_state.py).

Not yet at this level (each a typed Unsupported): a directory tree as one upload (files of any
size, tree downloads and the tree's operations work), watches, files-only checkpoints (the
writable layer is in guest RAM: `checkpoint(memory=True)` keeps it with the processes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sandfleet import errors
from linuxnode import cgroups, roots_ns
from linuxnode import process as process_runtime
from linuxnode.vm import layer_disks, machine
from linuxnode.vm import files as vm_files
from linuxnode.vm import ports as vm_ports
from linuxnode.vm.frames import window as frames_window
from linuxnode.vm.channel import AgentChannel, CommandFailed, GuestBroken, GuestCommand
from linuxnode.vm.guest_image import GuestImage, default_dir
from linuxnode.vm.runtime import MicroVMs, RunningVM, Shape, VMStartError
from schemas.layers import Rootfs
from schemas.node import Confinement, MachineState
from schemas.sandbox import SandboxSpec
from services.launcher.keys import LOGGER, about
from services.launcher.drivers import cgroup_controls, machine_state
from services.launcher.drivers.guest_commands import GuestBackground, GuestTerminal, exit_code, loopback_is_ipv6
from services.launcher.drivers.base import (
    Anchor,
    Command,
    CpuWeight,
    DownloadSource,
    DriverFailure,
    ExecFailed,
    ExecOutcome,
    Instance,
    LaunchRefused,
    NoWritableLayer,
    RunningCommand,
    RunningTerminal,
    SandboxGone,
    StartFailed,
    Unsupported,
    UploadSink,
    Usage,
    watch_exit,
)

log = logging.getLogger(LOGGER)
T = TypeVar("T")

KILL_GRACE_S = 10.0  # a timed-out command's SIGKILL to its exit, in the guest


@dataclass
class VMSandbox:
    sandbox_id: str
    vm: RunningVM
    confinement: Confinement
    loop: asyncio.AbstractEventLoop
    frozen: bool = False
    killed: str = ""  # why the node killed the guest
    commands: set[GuestCommand] = field(default_factory=set)
    forwards: set[asyncio.Future] = field(default_factory=set)  # port forwards being carried

    @property
    def anchor(self) -> Anchor:
        return Anchor(self.vm.pid, self.vm.start_time)

    @property
    def channel(self) -> AgentChannel:
        return self.vm.channel


def _own(instance: Instance) -> VMSandbox:
    if not isinstance(instance, VMSandbox):
        raise TypeError(f"not a microvm sandbox: {type(instance).__name__}")
    return instance


class MicroVMDriver:
    LEVEL = "microvm"  # the isolation it serves, as errors name it (VMDriver serves `vm`)

    def _unsupported(self, what: str) -> Unsupported:
        return Unsupported(f"{what} is not supported for isolation {self.LEVEL!r} yet")

    roots: roots_ns.RootsView | None = None  # where roots are composed (Drivers.open); None: our own namespace

    def __init__(self, vms: MicroVMs) -> None:
        self.vms = vms
        self.live: dict[str, VMSandbox] = {}

    def _in_roots(self, root: str) -> Callable[[str], Path]:
        """A name in the composed root `root` as a path this process (and QEMU) opens."""
        def inside(name: str) -> Path:
            path = f"{root.rstrip('/')}/{name}"
            return Path(self.roots.path(path) if self.roots is not None else path)
        return inside

    def _layer_images(self, rootfs: str) -> list[Path]:
        """The image files under a composed root, read from the roots namespace's table, as QEMU
        (our child) opens them: a file on the data disk where it is, a lazy layer's FUSE file
        (mounted in the roots namespace only) through it."""
        if self.roots is None:
            return layer_disks.images_under(rootfs)
        return [p if p.exists() else Path(self.roots.path(str(p)))
                for p in layer_disks.images_under(rootfs, self.roots.mountinfo())]

    # -- start and end ----------------------------------------------------------------------

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        if rootfs is None:
            raise LaunchRefused("a microvm has no host view: name its layers, e.g. layers=['base']")
        # With allow rules the guest gets a user-mode NIC: its traffic leaves as QEMU's own sockets
        # in the sandbox's namespace and cgroup, so the agent's veth, BPF allowlist, DNS stub and
        # violation reports apply unchanged (linuxnode/vm/machine.py network_args).
        network = bool(spec.allow)
        if network and not confinement.address:
            raise errors.Unsupported("egress allow rules need the node's egress network, which gave this "
                                     "sandbox no address")
        try:
            guest_mb = machine.guest_memory_mb(spec.memory_mb)
        except ValueError as exc:
            raise LaunchRefused(str(exc)) from None
        try:
            images = await asyncio.to_thread(self._layer_images, rootfs.path)
        except layer_disks.NoLayerImages as exc:
            raise StartFailed(f"no layer images to attach: {exc}") from None
        layers, state = list(rootfs.layers), None
        if spec.machine_state:  # the top layer is the saved machine, not a disk
            if len(images) != len(layers):
                raise StartFailed(f"{len(images)} layer images for {len(layers)} layers")
            images, layers = images[:-1], layers[:-1]
            state = await asyncio.to_thread(machine_state.checked, self._in_roots(rootfs.path), self.LEVEL,
                                            self.vms.needs, guest_mb)
        shape = Shape(vcpus=max(1, math.ceil(spec.cpu)), memory_mb=guest_mb, layers=tuple(layers), network=network)
        holder: list[VMSandbox] = []
        try:
            vm = await self.vms.start(sandbox_id, shape, images, spec.disk_mb, confinement.cgroup_procs,
                                      confinement.netns, lambda why: self._broken(holder, sandbox_id, why),
                                      from_state=state)
        except VMStartError as exc:
            if state is not None:  # QEMU refused the state, or the guest in it never answered
                raise LaunchRefused(f"the machine state was refused: {exc}") from None
            raise StartFailed(str(exc)) from None
        sandbox = VMSandbox(sandbox_id, vm, confinement, asyncio.get_running_loop())
        holder.append(sandbox)
        self.live[sandbox_id] = sandbox
        return sandbox

    def _broken(self, holder: list[VMSandbox], sandbox_id: str, why: str) -> None:
        """The guest broke the protocol or went silent: kill it; the watch fails the sandbox."""
        log.warning("sandbox %s: killing its microVM: %s", sandbox_id, why, extra=about(sandbox_id))
        if holder:
            sandbox = holder[0]
            sandbox.killed = why
            asyncio.ensure_future(process_runtime.kill_async(sandbox.vm.process))

    async def stop(self, sandbox_id: str, anchor: Anchor | None) -> None:
        sandbox = self.live.pop(sandbox_id, None)
        if sandbox is not None:
            sandbox.channel.close()
        process = anchor.process() if anchor is not None else self.vms.qemu_of(sandbox_id)
        await self.vms.stop(sandbox_id, process)

    def alive(self, anchor: Anchor) -> bool:
        return process_runtime.is_alive(anchor.process())

    async def adopt(self, sandbox_id: str, anchor: Anchor, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        holder: list[VMSandbox] = []
        try:
            channel = await self.vms.reconnect(sandbox_id, lambda why: self._broken(holder, sandbox_id, why))
        except (GuestBroken, OSError, TimeoutError) as exc:
            raise StartFailed(f"the microVM's agent cannot be reached again: {exc}") from None
        vm = RunningVM(sandbox_id, anchor.pid, anchor.start_time, self.vms.vms_dir / sandbox_id, channel, False)
        sandbox = VMSandbox(sandbox_id, vm, confinement, asyncio.get_running_loop())
        holder.append(sandbox)
        self.live[sandbox_id] = sandbox
        return sandbox

    def watch(self, instance: Instance, on_exit: Callable[[], None]) -> Callable[[], None]:
        sandbox = _own(instance)

        def exited() -> None:
            if sandbox.killed:
                log.warning("sandbox %s: its microVM was killed: %s", sandbox.sandbox_id, sandbox.killed,
                            extra=about(sandbox.sandbox_id))
            on_exit()

        return watch_exit(sandbox.vm.pid, exited)

    def why_ended(self, instance: Instance) -> str:
        """Why the node killed the guest (it broke the protocol, flooded or went silent), for the
        record's `detail`; "" when QEMU ended by itself."""
        killed = _own(instance).killed
        return f"the node killed the microVM: {killed}" if killed else ""

    async def leftovers(self, keep: set[str]) -> list[str]:
        """VMs a crash left (QEMU still in its directory, or the directory alone) that no kept
        sandbox owns, and boot VMs a crash interrupted."""
        await asyncio.to_thread(self.vms.clear_boots)
        gone = sorted(self.vms.recorded() - keep)
        for sandbox_id in gone:
            await self.vms.stop(sandbox_id, self.vms.qemu_of(sandbox_id))
        return gone

    def close(self) -> None:
        for sandbox in self.live.values():
            sandbox.channel.close()

    # -- commands ---------------------------------------------------------------------------

    def _usable(self, instance: Instance) -> VMSandbox:
        sandbox = _own(instance)
        if sandbox.killed or sandbox.channel.broken:
            raise SandboxGone(f"the microVM is gone: {sandbox.killed or sandbox.channel.broken}")
        if sandbox.frozen:
            raise Unsupported("the microVM is paused: resume it first")
        return sandbox

    async def _start_command(self, sandbox: VMSandbox, command: Command, on_output: Callable[[int, bytes], None],
                             on_exit: Callable[[int], None],
                             terminal: tuple[int, int] | None = None) -> GuestCommand:
        if command.uid >= 0:
            raise self._unsupported("running a command as the image's user")
        try:
            return await sandbox.channel.start(list(command.argv), dict(command.env), command.cwd, on_output, on_exit,
                                               terminal)
        except CommandFailed as exc:
            raise ExecFailed(f"{exc.strerror}: {os.strerror(exc.errno or 0)}") from None
        except GuestBroken as exc:
            raise SandboxGone(f"the microVM is gone: {exc}") from None

    async def exec(self, instance: Instance, command: Command) -> ExecOutcome:
        sandbox = self._usable(instance)
        out, err = bytearray(), bytearray()
        truncated = False

        def on_output(stream: int, data: bytes) -> None:
            nonlocal truncated
            buffer = out if stream == 1 else err
            room = command.max_output - len(out) - len(err)
            if len(data) > room:
                truncated = True
            buffer += data[:max(room, 0)]

        running = await self._start_command(sandbox, command, on_output, lambda status: None)
        timed_out = False
        try:
            if command.stdin:
                sandbox.channel.stdin(running, command.stdin)
            sandbox.channel.close_stdin(running)
            try:
                status = await asyncio.wait_for(asyncio.shield(running.exited), command.timeout_s)
            except TimeoutError:
                timed_out = True
                sandbox.channel.signal(running, signal.SIGKILL)
                try:
                    status = await asyncio.wait_for(asyncio.shield(running.exited), KILL_GRACE_S)
                except TimeoutError:
                    raise sandbox.channel.fail(f"a SIGKILLed command did not end in {KILL_GRACE_S:g} s") from None
        except asyncio.CancelledError:
            if not sandbox.channel.broken:
                sandbox.channel.signal(running, signal.SIGKILL)
            raise
        except (GuestBroken, TimeoutError) as exc:
            raise SandboxGone(f"the microVM is gone: {sandbox.killed or exc}") from None
        return ExecOutcome(exit_code(status), bytes(out), bytes(err), timed_out, truncated)

    async def spawn(self, instance: Instance, command: Command, on_output: Callable[[int, bytes], None],
                    on_exit: Callable[[int], None]) -> RunningCommand:
        sandbox = self._usable(instance)
        running = await self._start_command(sandbox, command, on_output, on_exit)
        return GuestBackground(sandbox.channel, running)

    # -- files: small whole files through the agent --------------------------------------------

    def _on_loop(self, sandbox: VMSandbox, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run an agent request from a worker thread (the launcher calls file operations off the
        event loop); the loop's own thread cannot wait for its own loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # a worker thread, as it should be
        else:
            raise DriverFailure("a microvm file operation was called on the event loop's thread")
        try:
            return asyncio.run_coroutine_threadsafe(make(), sandbox.loop).result()
        except GuestBroken as exc:
            raise SandboxGone(f"the microVM is gone: {exc}") from None

    def read_file(self, instance: Instance, path: str, max_bytes: int) -> bytes:
        sandbox = self._usable(instance)
        return self._on_loop(sandbox, lambda: sandbox.channel.read_file(path, max_bytes))

    def write_file(self, instance: Instance, path: str, data: bytes, mode: int) -> int:
        sandbox = self._usable(instance)
        return self._on_loop(sandbox, lambda: sandbox.channel.write_file(path, data, mode))

    # -- the machine from outside: pause, CPU weight, usage --------------------------------------

    async def freeze(self, instance: Instance) -> None:
        await self._set_frozen(_own(instance), True)

    async def thaw(self, instance: Instance) -> None:
        await self._set_frozen(_own(instance), False)

    @staticmethod
    async def _set_frozen(sandbox: VMSandbox, frozen: bool) -> None:
        await cgroup_controls.set_frozen(sandbox.confinement, frozen)
        sandbox.frozen = frozen

    def set_cpu_weight(self, instance: Instance, idle: bool) -> CpuWeight:
        sandbox = _own(instance)
        return cgroup_controls.set_cpu_weight(sandbox.sandbox_id, sandbox.confinement, idle)

    async def save_machine_state(self, instance: Instance) -> tuple[Path, MachineState]:
        """The whole running machine (its processes, and its writable layer in RAM) saved, with
        what a node restoring it needs, into a new directory beside the VM's sockets: what the
        launcher packs as a memory checkpoint's layer, then removes (`drop_machine_state`).
        The machine runs on afterwards."""
        sandbox = self._usable(instance)
        try:
            return await machine_state.save(self.vms, sandbox.vm, self.LEVEL)
        except VMStartError as exc:
            raise DriverFailure(str(exc)) from None
        except GuestBroken as exc:
            raise SandboxGone(f"the microVM is gone: {exc}") from None

    @staticmethod
    def drop_machine_state(into: Path) -> None:
        shutil.rmtree(into, ignore_errors=True)

    def writable_layer(self, instance: Instance) -> Path:
        raise NoWritableLayer(f"sandbox {_own(instance).sandbox_id} is a {self.LEVEL}: its writable layer is in "
                              "guest RAM, kept by checkpoint(memory=True) with its processes")

    async def usage(self, instance: Instance) -> Usage:
        """QEMU's cgroup (guest RAM and QEMU together); what the guest does inside is not read yet."""
        sandbox = _own(instance)
        try:
            used = await asyncio.to_thread(cgroups.read_usage, sandbox.confinement.cgroup_v2,
                                           sandbox.confinement.cgroup_procs)
        except FileNotFoundError:
            raise SandboxGone("the sandbox's cgroup is gone") from None
        if not process_runtime.is_alive(sandbox.vm.process):
            raise SandboxGone("the microVM is gone")
        return Usage(cpu_s=used.cpu_usec / 1e6 if used.cpu_usec >= 0 else -1.0, memory_bytes=used.memory_bytes,
                     memory_peak_bytes=used.memory_peak_bytes, memory_limit_bytes=used.memory_limit_bytes,
                     disk_bytes=-1, processes=used.processes, interfaces=[])

    # -- ports: through the agent, to the guest's own loopback (linuxnode/vm/ports.py) ----------

    async def connect_port(self, instance: Instance, host: str, port: int) -> socket.socket:
        sandbox = self._usable(instance)
        ipv6 = loopback_is_ipv6(host, self.LEVEL)
        try:
            opened = await sandbox.channel.open_port(ipv6, port)
        except GuestBroken as exc:
            raise SandboxGone(f"the microVM is gone: {exc}") from None
        theirs, ours = vm_ports.make_pair()
        task = asyncio.ensure_future(vm_ports.forward(sandbox.channel, opened, ours))
        sandbox.forwards.add(task)
        task.add_done_callback(sandbox.forwards.discard)
        return theirs

    async def port_listens(self, instance: Instance, host: str, port: int) -> bool:
        """Asked of the guest's agent (its /proc/net/tcp)."""
        sandbox = self._usable(instance)
        try:
            return await sandbox.channel.port_listens(loopback_is_ipv6(host, self.LEVEL), port)
        except GuestBroken as exc:
            raise SandboxGone(f"the microVM is gone: {exc}") from None

    # -- not at this level yet -------------------------------------------------------------------

    def open_upload(self, instance: Instance, path: str, kind: str, mode: int, depth: int) -> UploadSink:
        sandbox = self._usable(instance)
        if kind == "dir":
            raise self._unsupported("uploading a directory tree")
        return self._on_guest(sandbox, lambda call: vm_files.FileSink(sandbox.channel, call, path, mode))

    def open_download(self, instance: Instance, path: str, chunk: int, depth: int) -> DownloadSource:
        sandbox = self._usable(instance)
        return self._on_guest(sandbox, lambda call: vm_files.open_source(sandbox.channel, call, path, chunk))

    _FILE_OPS: dict[str, Callable[..., object]] = {"stat": vm_files.stat, "list": vm_files.list_dir,
                                                   "mkdir": vm_files.mkdir, "remove": vm_files.remove,
                                                   "rename": vm_files.rename}

    def file_op(self, instance: Instance, op: str, *args) -> object:
        sandbox = self._usable(instance)
        found = self._FILE_OPS.get(op)
        if found is None:
            raise ValueError(f"no file operation {op!r}")
        return self._on_guest(sandbox, lambda call: found(sandbox.channel, call, *args))

    def _on_guest(self, sandbox: VMSandbox, work: Callable[[vm_files.Call], T]) -> T:
        """`work(call)` on this worker thread, each of its agent requests run on the loop by `call`."""
        try:
            return work(lambda make: self._on_loop(sandbox, make))
        except GuestBroken as exc:
            raise SandboxGone(f"the microVM is gone: {exc}") from None

    def open_watch(self, instance: Instance, path: str, recursive: bool, max_dirs: int):
        raise self._unsupported("watching files")

    async def spawn_terminal(self, instance: Instance, command: Command, cols: int, rows: int,
                             on_output: Callable[[int, bytes], None], on_exit: Callable[[int], None]) -> RunningTerminal:
        """On a terminal of the guest's own devpts (the agent holds its master)."""
        sandbox = self._usable(instance)
        frames_window(cols, rows)  # ValueError for a bad size, before anything runs
        running = await self._start_command(sandbox, command, on_output, on_exit, terminal=(cols, rows))
        return GuestTerminal(sandbox.channel, running)


@dataclass(frozen=True)
class VMHost:
    """What this node gives a VM level: QEMU, its built guest, the accelerator, the start path."""

    qemu: str
    guest: Any  # the level's guest (GuestImage, or the vm level's)
    accelerator: machine.Accelerator
    snapshots: bool

    @property
    def start(self) -> str:
        return ("restored from saved machine states" if self.snapshots
                else "cold-booted (SANDFLEET_MICROVM_SNAPSHOTS=0)")


async def detect_vm_host(find_guest: Callable[[Path], Any]) -> VMHost | str:
    """QEMU and a guest `find_guest` finds built in the guest directory, or why not (`off: ...`)."""
    qemu = machine.qemu_binary()
    if qemu is None:
        return f"off: no {machine.QEMU} (Debian's qemu-system-x86)"
    guest = await asyncio.to_thread(find_guest, default_dir())
    if isinstance(guest, str):
        return f"off: {guest}"
    accelerator = await asyncio.to_thread(machine.detect_accelerator)
    return VMHost(qemu, guest, accelerator, os.environ.get("SANDFLEET_MICROVM_SNAPSHOTS", "1") != "0")


async def detect_microvm(state_dir: Path) -> tuple[MicroVMDriver | None, str]:
    """The driver, if QEMU and a built guest are here, and the node's status line for the level
    (`on: tcg (no usable KVM: ...)`, `off: <why>`)."""
    host = await detect_vm_host(GuestImage.find)
    if isinstance(host, str):
        return None, host
    vms = MicroVMs(host.guest, host.accelerator, host.qemu, state_dir / "microvm", snapshots=host.snapshots)
    return MicroVMDriver(vms), f"on: {host.accelerator.describe()}, guest {host.guest.release}, {host.start}"

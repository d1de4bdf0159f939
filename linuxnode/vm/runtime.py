"""MicroVMs on this node: start one (restored from a saved machine state, or booted cold),
reach its agent, end it and remove what it left.

**Fast start.** The first VM of a (guest, accelerator, vCPUs, RAM, layer stack) is booted cold
once, without any sandbox: its agent greets, QMP stops it and writes its whole state to a file
under `state_dir/states/`. Every VM of that key then starts from that file (`-incoming fd:3`)
with the same devices and the same layer images, and its writable layer is fresh by
construction (a tmpfs in guest RAM, empty in the saved state; `setup` sizes it to the
sandbox's `disk_mb`). Restoring needs no spawning helper, so QEMU keeps `spawn=deny`.

Everything of one VM lives in `state_dir/vms/<sandbox id>/` (its sockets, QEMU's stderr);
sockets are reached through an O_PATH descriptor of that directory, so a deep data dir never
hits the 108-byte limit of a unix socket's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linuxnode import procfs
from linuxnode.process import InitProcess, kill_async
from linuxnode.vm import machine
from linuxnode.vm.channel import AgentChannel, GuestBroken
from linuxnode.vm.guest_image import GuestImage
from linuxnode.vm.machine import Accelerator, MachineSpec
from linuxnode.vm.qmp import Qmp, QmpError

log = logging.getLogger("sandfleet.vm")

BOOT_TIMEOUT_S = {"tcg": 90.0, "kvm": 20.0}  # a cold boot to the agent's hello
RESTORE_TIMEOUT_S = 20.0  # a restored guest to its first answer
STATES_KEPT = 8  # saved machine states (~90 MB per 256 MB of guest RAM); the oldest go first


class VMStartError(Exception):
    """QEMU or the guest did not come up; the message says which step and why."""


@dataclass
class RunningVM:
    sandbox_id: str
    pid: int
    start_time: int
    run_dir: Path
    channel: AgentChannel
    restored: bool

    @property
    def process(self) -> InitProcess:
        return InitProcess(pid=self.pid, start_time=self.start_time)


@dataclass(frozen=True)
class Shape:
    """What a saved machine state is for: a VM restored from it must match all of it."""

    vcpus: int
    memory_mb: int  # guest RAM
    layers: tuple[str, ...]  # digests, bottom first
    network: bool = False  # a user-mode NIC (a device: a state with one restores only with one)

    def key(self, guest: GuestImage, accelerator: Accelerator) -> str:
        text = f"{guest.digest}|{accelerator.name}|{self.vcpus}|{self.memory_mb}|{','.join(self.layers)}"
        if self.network:
            text += "|net"
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class MachineNeeds:
    """What a running machine's saved state needs of the QEMU that restores it, beside its shape
    (which the sandbox's spec gives both ends): a restore into anything else fails in QEMU, or
    worse, loads and runs a guest on a CPU it did not see."""

    machine: str  # the machine type as this QEMU resolves its alias (pc → pc-i440fx-7.2)
    accelerator: str
    cpu: str  # TCG's fixed model, or under KVM the host's (`host` passes it through)
    qemu: str  # QEMU's version line
    guest: str  # the guest image's digest: its kernel and agent are in the saved RAM

    def mismatch(self, theirs: MachineNeeds) -> str:
        """Why a state saved with `theirs` cannot be restored here ("" if it can)."""
        differ = [f"{name} {getattr(theirs, name)!r} (this node: {getattr(self, name)!r})"
                  for name in ("accelerator", "cpu", "machine", "qemu", "guest")
                  if getattr(theirs, name) != getattr(self, name)]
        return "; ".join(differ)


def _qemu_facts(qemu: str, alias: str) -> tuple[str, str]:
    """(QEMU's version line, what machine alias `alias` resolves to) from QEMU itself."""
    version = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=30).stdout
    machines = subprocess.run([qemu, "-machine", "help"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(rf"^{re.escape(alias)}\s.*\(alias of ([\w.\-]+)\)", machines, re.M)
    return (version.splitlines() or ["unknown"])[0].strip(), found.group(1) if found else alias


def _host_cpu() -> str:
    found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    return f"host: {found.group(1).strip() if found else 'unknown'}"


async def _save_state(run_dir: Path, partial: Path, then_run: bool) -> None:
    """The machine of `run_dir` saved over its QMP socket into the file `partial` (the caller
    renames it into place); `then_run`: the machine runs on afterwards (a save stops it)."""
    qmp: Qmp = await _connect(run_dir, "qmp.sock", Qmp.connect)  # type: ignore[assignment]
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await qmp.save_state(fd)
        finally:
            os.close(fd)
        if then_run:
            await qmp.execute("cont")
    finally:
        qmp.close()


async def _connect(run_dir: Path, name: str, make: Callable[[str], object]) -> object:
    """`make(path)` with the socket's path made short through an O_PATH fd of run_dir."""
    fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return await make(f"/proc/self/fd/{fd}/{name}")  # type: ignore[misc]
    finally:
        os.close(fd)


class MicroVMs:
    MACHINE = "pc"  # the machine's alias on QEMU's command line (machine.py); a full machine's is q35

    def __init__(self, guest: GuestImage, accelerator: Accelerator, qemu: str, state_dir: Path,
                 snapshots: bool = True) -> None:
        self.guest, self.accelerator, self.qemu = guest, accelerator, qemu
        self.snapshots = snapshots
        self.vms_dir, self.states_dir = state_dir / "vms", state_dir / "states"
        self.vms_dir.mkdir(parents=True, exist_ok=True)
        self.states_dir.mkdir(parents=True, exist_ok=True)
        self._saving: dict[str, asyncio.Lock] = {}
        self._needs: MachineNeeds | None = None

    def needs(self) -> MachineNeeds:
        """What a state this node saves needs (blocking: asks QEMU once)."""
        if self._needs is None:
            version, resolved = _qemu_facts(self.qemu, self.MACHINE)
            cpu = _host_cpu() if self.accelerator.name == "kvm" else machine.TCG_CPU
            self._needs = MachineNeeds(resolved, self.accelerator.name, cpu, version, self.guest.digest)
        return self._needs

    # -- start ------------------------------------------------------------------------------

    async def start(self, sandbox_id: str, shape: Shape, images: list[Path], disk_mb: int, cgroup_procs: list[str],
                    netns: str, on_broken: Callable[[str], None], from_state: Path | None = None) -> RunningVM:
        """A VM of `shape`: restored from the shape's saved state (booted and saved first if there
        is none), booted cold without snapshots, or restored from `from_state`, a running
        machine's state (save_running) whose processes go on in the new VM."""
        if from_state is not None:
            state: Path | None = from_state
        else:
            state = await self.saved_state(shape, images) if self.snapshots else None
        run_dir = self.vms_dir / sandbox_id
        run_dir.mkdir()
        spec = self.spec(shape, images, disk_mb=disk_mb, incoming=state is not None, uid=machine.vm_uid(sandbox_id),
                         network="policed" if shape.network else "")
        try:
            pid = machine.spawn(spec, self.qemu, cgroup_procs, netns, state, cwd=run_dir)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise VMStartError(f"QEMU could not be started: {exc}") from None
        stat = procfs.read_stat(pid)
        channel: AgentChannel | None = None
        try:
            if stat is None:
                raise VMStartError(f"QEMU ended at once: {machine.stderr_tail(run_dir)}")
            channel = await self._channel(run_dir, on_broken)
            vm = RunningVM(sandbox_id, pid, stat.start_time, run_dir, channel, restored=state is not None)
            if state is not None:
                await channel.ping(RESTORE_TIMEOUT_S)
                if from_state is not None:
                    kept = await channel.detach()
                    log.info("sandbox %s: restored with %d running command(s)", sandbox_id, kept)
            else:
                await channel.hello(BOOT_TIMEOUT_S[self.accelerator.name])
            await channel.setup(disk_mb)
        except BaseException as exc:
            why = machine.stderr_tail(run_dir) or str(exc) or type(exc).__name__
            if channel is not None:
                channel.close()  # before QEMU goes: its end is ours, not the guest's doing
            await self.stop(sandbox_id, InitProcess(pid, stat.start_time) if stat else None)
            if isinstance(exc, (GuestBroken, OSError, TimeoutError)):
                raise VMStartError(f"the microVM did not start: {why}") from None
            raise
        return vm

    async def _channel(self, run_dir: Path, on_broken: Callable[[str], None]) -> AgentChannel:
        return await _connect(run_dir, "agent.sock", lambda p: AgentChannel.connect(p, on_broken))  # type: ignore[return-value]

    async def reconnect(self, sandbox_id: str, on_broken: Callable[[str], None]) -> AgentChannel:
        """A new channel to a VM that outlived the launcher (QEMU takes the next client)."""
        channel = await self._channel(self.vms_dir / sandbox_id, on_broken)
        killed = await channel.reset()
        if killed:
            log.info("sandbox %s: its guest ended %d command(s) of the launcher before", sandbox_id, killed)
        return channel

    def spec(self, shape: Shape, images: list[Path], **options: object) -> MachineSpec:
        """The machine of `shape` over `images`, its sockets named relative to its directory; a
        level with another machine (full_machine.py) gives its own."""
        return MachineSpec(self.guest, self.accelerator, shape.vcpus, shape.memory_mb, tuple(map(str, images)),
                           Path("."), **options)  # type: ignore[arg-type]

    # -- saved machine states ---------------------------------------------------------------------

    async def saved_state(self, shape: Shape, images: list[Path]) -> Path:
        """The machine state of `shape`, booting and saving it first if there is none yet."""
        key = shape.key(self.guest, self.accelerator)
        state = self.states_dir / f"{key}.state"
        lock = self._saving.setdefault(key, asyncio.Lock())
        async with lock:
            if not state.exists():
                await self._save(key, shape, images, state)
                self._evict(keep=state)
        return state

    async def _save(self, key: str, shape: Shape, images: list[Path], state: Path) -> None:
        run_dir = self.vms_dir / f"boot-{key}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir()
        spec = self.spec(shape, images, uid=machine.vm_uid(key), network="sealed" if shape.network else "")
        pid = machine.spawn(spec, self.qemu, [], "", None, cwd=run_dir)
        stat = procfs.read_stat(pid)
        partial = state.with_suffix(".part")
        try:
            channel = await self._channel(run_dir, lambda why: None)
            try:
                await channel.hello(BOOT_TIMEOUT_S[self.accelerator.name])
            finally:
                channel.close()
            await _save_state(run_dir, partial, then_run=False)
            os.replace(partial, state)
            log.info("saved the machine state %s (%d MiB) for %d layer(s)", key, state.stat().st_size >> 20,
                     len(shape.layers))
        except (GuestBroken, QmpError, OSError, TimeoutError) as exc:
            why = machine.stderr_tail(run_dir) or str(exc) or type(exc).__name__
            raise VMStartError(f"booting the microVM to save its state failed: {why}") from None
        finally:
            if stat is not None:
                await kill_async(InitProcess(pid, stat.start_time))
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            partial.unlink(missing_ok=True)
            shutil.rmtree(run_dir, ignore_errors=True)

    async def save_running(self, vm: RunningVM, state: Path, keep_paused: bool = False) -> None:
        """The whole machine of a running VM (RAM, devices, the guest's processes and files) into
        `state`, for `start(from_state=...)` on a node with the same guest, accelerator, CPU model,
        shape and layer images. The VM runs on afterwards unless `keep_paused` (a migration)."""
        await vm.channel.quiesce()
        partial = state.with_suffix(".part")
        try:
            await _save_state(vm.run_dir, partial, then_run=not keep_paused)
            os.replace(partial, state)
        except (QmpError, OSError, TimeoutError) as exc:
            partial.unlink(missing_ok=True)
            raise VMStartError(f"saving the machine's state failed: {exc}") from None
        finally:
            if not keep_paused and not vm.channel.broken:
                await vm.channel.resume()

    def _evict(self, keep: Path) -> None:
        states = sorted(self.states_dir.glob("*.state"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in [s for s in states if s != keep][STATES_KEPT - 1:]:
            old.unlink(missing_ok=True)

    # -- the end ----------------------------------------------------------------------------------

    async def stop(self, sandbox_id: str, process: InitProcess | None) -> None:
        """Kill QEMU (its pid checked against its start time) and remove the VM's directory."""
        if process is not None:
            await kill_async(process)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, os.WNOHANG)
        shutil.rmtree(self.vms_dir / sandbox_id, ignore_errors=True)

    def recorded(self) -> set[str]:
        """Sandboxes with a VM directory here (boot VMs excluded)."""
        return {p.name for p in self.vms_dir.iterdir() if not p.name.startswith("boot-")}

    def clear_boots(self) -> None:
        """Boot VMs a crash interrupted: their QEMU is ours by its cwd, and ends with us."""
        for run_dir in self.vms_dir.glob("boot-*"):
            for pid in _qemus_in(run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            shutil.rmtree(run_dir, ignore_errors=True)
        for partial in self.states_dir.glob("*.part"):
            partial.unlink(missing_ok=True)

    def qemu_of(self, sandbox_id: str) -> InitProcess | None:
        """The QEMU running in a VM's directory (what a crash left without its record)."""
        for pid in _qemus_in(self.vms_dir / sandbox_id):
            stat = procfs.read_stat(pid)
            if stat is not None:
                return InitProcess(pid, stat.start_time)
        return None


def _qemus_in(run_dir: Path) -> list[int]:
    found = []
    target = str(run_dir.resolve())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == target:
                found.append(int(pid))
        except OSError:
            continue
    return found

"""One QEMU process per microVM: its command line, its start inside the sandbox's cgroups and
network namespace, and which accelerator this node can give it.

The machine is QEMU's `pc` with `-kernel/-initrd`, not `-M microvm`: Debian's kernel hangs at
timer calibration on `microvm` with ACPI, and cannot find virtio-mmio devices without it (it
lacks CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES). What makes it a *micro*VM is the device model: no
defaults, no display, no network unless the sandbox has allow rules (then one user-mode NIC),
no firmware beyond SeaBIOS's direct kernel boot; one
read-only virtio-blk disk per layer (PCI slots in layer order, so the guest's vda is the bottom
layer), and one virtio-serial port for the guest agent. QEMU runs with its seccomp sandbox
(no spawning, no privilege changes), so a machine state is passed in as an open fd
(`-incoming fd:3`), never through a helper command.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from linuxnode.netns import resolve as resolve_netns
from linuxnode.vm.guest_image import GuestImage

QEMU = "qemu-system-x86_64"
TCG_CPU = "qemu64"  # a fixed model: a saved state restores only into the same CPU
# What QEMU itself may take beside guest RAM, within the sandbox's memory limit: ~40 MiB measured
# (its own heap, device state, a restored state's buffers) plus TCG's translation cache, capped.
TB_CACHE_MB = 96
QEMU_OVERHEAD_MB = 160
MIN_GUEST_MB = 96
FIRST_LAYER_SLOT = 4  # PCI slot of the bottom layer's disk; the port's controller sits at 3
STATE_FD = 3
# QEMU drops root once it has opened everything (-runas): to a uid of its own per VM, from a
# range no host user has, so a compromised QEMU is an unprivileged process that shares its uid
# with no other sandbox's (barring a hash collision in 2**24) and can signal or trace none.
VM_UID_BASE = 0x5F000000


def vm_uid(name: str) -> int:
    return VM_UID_BASE + (zlib.crc32(name.encode()) & 0xFFFFFF)
KVM_GET_API_VERSION = 0xAE00


@dataclass(frozen=True)
class Accelerator:
    name: str  # "kvm" or "tcg"
    why: str = ""  # for tcg: why not kvm

    def describe(self) -> str:
        return self.name if not self.why else f"{self.name} ({self.why})"


def detect_accelerator() -> Accelerator:
    """KVM where it can run a stock guest: /dev/kvm answering, and a CPU with hardware
    virtualisation (a PVM-only /dev/kvm, as on this kind of machine, runs only PVM guests)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Accelerator("tcg", f"no usable KVM: /dev/kvm {exc.strerror}")
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return Accelerator("tcg", f"no usable KVM: {exc.strerror}")
    finally:
        os.close(fd)
    flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    if version != 12 or flags is None or not {"vmx", "svm"} & set(flags.group(1).split()):
        return Accelerator("tcg", "no usable KVM: the CPU has no vmx/svm, /dev/kvm runs PVM guests only")
    return Accelerator("kvm")


def qemu_binary() -> str | None:
    return shutil.which(QEMU)


def guest_memory_mb(memory_mb: int) -> int:
    """Guest RAM within the sandbox's memory limit, which holds QEMU too; ValueError if too small."""
    guest = memory_mb - QEMU_OVERHEAD_MB
    if guest < MIN_GUEST_MB:
        raise ValueError(f"a microvm needs memory_mb >= {MIN_GUEST_MB + QEMU_OVERHEAD_MB} "
                         f"(guest RAM plus QEMU's own {QEMU_OVERHEAD_MB} MiB), not {memory_mb}")
    return guest


@dataclass(frozen=True)
class MachineSpec:
    guest: GuestImage
    accelerator: Accelerator
    vcpus: int
    memory_mb: int  # guest RAM
    layers: tuple[str, ...]  # image files, bottom first
    run_dir: Path  # this machine's sockets
    disk_mb: int = 1024  # the writable layer's size at boot (a restored guest is re-sized)
    incoming: bool = False  # the state comes in on fd STATE_FD
    uid: int = 0  # what QEMU runs as once set up (0: stays root)
    console: str = ""  # a file for the guest console (debugging: a guest can fill it), else none
    # A user-mode (slirp) NIC (see network_args): "" none, "policed" (in the sandbox's namespace
    # and cgroup), "sealed" (slirp lets nothing out: the boot VM that saves a state, which has
    # no sandbox's policing around it).
    network: str = ""
    extra: tuple[str, ...] = field(default=())

    @property
    def agent_socket(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    def argv(self, qemu: str) -> list[str]:
        if self.accelerator.name == "kvm":
            accel, cpu = "kvm", "host"
        else:
            # QEMU's default translation cache is 1 GiB, touched as used: a busy guest could grow
            # QEMU past the memory limit. 96 MiB booted as fast as the default here.
            accel, cpu = f"tcg,tb-size={TB_CACHE_MB}", TCG_CPU
        argv = [
            qemu, "-name", "sandfleet-microvm", "-machine", "pc,mem-merge=on", "-accel", accel, "-cpu", cpu,
            "-smp", str(self.vcpus), "-m", str(self.memory_mb),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-monitor", "none",
            "-serial", f"file:{self.console}" if self.console else "none",
            # elevateprivileges=allow lets -runas drop root (deny would kill QEMU at its setuid);
            # after the drop no set*id call can regain anything.
            "-sandbox", f"on,obsolete=deny,elevateprivileges={'allow' if self.uid else 'deny'},spawn=deny,"
                        "resourcecontrol=deny",
            "-kernel", str(self.guest.kernel), "-initrd", str(self.guest.initramfs),
            "-append", f"console=ttyS0 {'' if self.console else 'quiet loglevel=0 '}panic=-1 sandfleet.disk_mb={self.disk_mb}",
            "-device", "virtio-serial-pci,id=ports,addr=3",
            "-chardev", f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
            "-device", "virtserialport,bus=ports.0,chardev=agent,name=org.sandfleet.agent",
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
        ]
        for i, image in enumerate(self.layers):
            argv += ["-drive", f"file={image},if=none,id=layer{i},format=raw,readonly=on",
                     "-device", f"virtio-blk-pci,drive=layer{i},addr={FIRST_LAYER_SLOT + i}"]
        if self.network:
            argv += network_args(sealed=self.network == "sealed")
        if self.incoming:
            argv += ["-incoming", f"fd:{STATE_FD}"]
        if self.uid:
            argv += ["-runas", f"{self.uid}:{self.uid}"]
        return argv + list(self.extra)


# The guest's side of user-mode networking (guest/init configures it when it finds the NIC).
GUEST_NET, GUEST_GATEWAY, GUEST_DNS = "10.0.2.0/24", "10.0.2.2", "10.0.2.3"
NIC_SLOT = 2  # below the agent's port (3) and the layers (4...)


def network_args(sealed: bool = False) -> list[str]:
    """A virtio NIC on QEMU's user-mode stack (slirp): no tap, no host link. The guest's packets
    become QEMU's own sockets, opened in the sandbox's network namespace and cgroup, so every
    connect and sendto passes the cgroup's BPF allowlist (and its DNS redirect to the node's
    stub) exactly as a container's would, and refusals are reported against the sandbox.
    slirp's host alias (10.0.2.2) is QEMU's loopback: the sandbox namespace's own, empty one.
    No IPv6 (the allowlists' IPv6 rules are not needed for a NIC that has none), no forwards."""
    restrict = ",restrict=on" if sealed else ""  # not part of the machine state: a restore may differ
    return ["-netdev", f"user,id=net,ipv6=off,net={GUEST_NET},host={GUEST_GATEWAY},dns={GUEST_DNS}{restrict}",
            "-device", f"virtio-net-pci,netdev=net,addr={NIC_SLOT},mac=52:54:00:5f:00:01"]


# The wrapper that puts QEMU where a sandbox's first process must be before any guest code runs:
# in its directory (its sockets are named relative to it), its pid in every cgroup.procs file,
# then in the sandbox's network namespace, then QEMU.
_ENTER = ('cd "$1" || exit 96; shift; n=$1; shift; '
          'while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 97; shift; n=$((n-1)); done; exec "$@"')


def spawn(spec: MachineSpec, qemu: str, cgroup_procs: list[str], netns: str, state: Path | None, cwd: Path) -> int:
    """Start QEMU in `cwd` (not waited for: the caller reaps it); its stderr goes to cwd/qemu.log.
    `spec.run_dir` is where QEMU names its sockets: "." (relative to cwd)."""
    argv = spec.argv(qemu)
    if netns:
        argv = ["nsenter", f"--net={resolve_netns(netns)}", "--", *argv]  # while the launcher lives: QEMU is in it at once
    wrapped = ["/bin/sh", "-c", _ENTER, "sh", str(cwd), str(len(cgroup_procs)), *cgroup_procs, *argv]
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, str(cwd / "qemu.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
    ]
    if state is not None:
        actions.append((os.POSIX_SPAWN_OPEN, STATE_FD, str(state), os.O_RDONLY, 0))
    return os.posix_spawn("/bin/sh", wrapped, os.environ, file_actions=actions, setsid=True)


def stderr_tail(run_dir: Path, limit: int = 400) -> str:
    try:
        return (run_dir / "qemu.log").read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""

"""The `vm` level's machine: QEMU's q35 with its firmware and a screen, around the same guest
agent, disks and start path as a microVM (machine.py, runtime.py).

What makes it a *full* machine, against the microVM's minimal `pc`:
- **q35** (PCIe root, ICH9 chipset, AHCI, the PS/2 controller) with **SeaBIOS** from Debian's
  `seabios` package as its firmware, which runs POST, enumerates PCI, initialises the VGA card
  through its option ROM and boots the kernel QEMU hands it over fw_cfg (the same Debian kernel
  and initramfs as a microVM, plus display and input modules: vm_guest.py). No boot disk and no
  bootloader: the kernel and initramfs stay the node's, the layers stay read-only disks.
- **A screen**: QEMU's standard VGA (bochs DRM in the guest), its EDID saying the sandbox's
  screen size, so the guest's console and X come up at exactly `width` x `height`.
- **Input**: a virtio tablet (absolute pointer: a node's (x, y) is the guest's (x, y)) and a
  virtio keyboard, fed by QMP `input-send-event` (display.py).
No display backend is opened on the host (`-display none`): the screen is read by QMP
`screendump`, which needs none.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from linuxnode.vm.guest_image import GuestImage
from linuxnode.vm.machine import Accelerator, MachineSpec
from linuxnode.vm.runtime import MicroVMs, RunningVM, Shape

MACHINE = "q35,mem-merge=on"
FIRMWARE = "SeaBIOS"  # QEMU's default for q35: Debian's seabios (bios-256k.bin)
DEFAULT_SCREEN = (1024, 768)  # a `vm` created without a desktop still has a screen
MAX_SCREEN = (2560, 1600)
KEYBOARD_ID, TABLET_ID, VGA_ID = "keyboard", "tablet", "screen"
# What a layer needs to draw on this machine's screen, as Debian packages (what `sandfleet layer
# build NAME --debian` takes): the X server (its modesetting driver runs on the bochs DRM card)
# with the evdev input driver (the tablet and keyboard), core fonts, a window manager that gives
# every window the whole screen, and light programs to drive (xterm; xcalc, xeyes in x11-apps).
VM_DESKTOP_PACKAGES = ["xserver-xorg-core", "xserver-xorg-input-evdev", "xfonts-base",
                       "matchbox-window-manager", "xterm", "x11-apps"]


def vga_memory_mb(width: int, height: int) -> int:
    """The VGA card's memory for one 32-bit frame of this size (a power of two, at least QEMU's 16)."""
    need, mb = width * height * 4, 16
    while mb << 20 < need:
        mb *= 2
    return mb


def screen_size(width: int, height: int) -> tuple[int, int]:
    """The screen a `vm` gets; ValueError for one the card cannot show."""
    if not (64 <= width <= MAX_SCREEN[0] and 64 <= height <= MAX_SCREEN[1]) or width % 8:
        raise ValueError(f"a vm's screen is 64x64 to {MAX_SCREEN[0]}x{MAX_SCREEN[1]} with a width divisible "
                         f"by 8, not {width}x{height}")
    return width, height


@dataclass(frozen=True)
class FullShape(Shape):
    """A microVM's shape plus the screen: a saved state restores only into the same card."""

    width: int = DEFAULT_SCREEN[0]
    height: int = DEFAULT_SCREEN[1]

    def key(self, guest: GuestImage, accelerator: Accelerator) -> str:
        text = f"{super().key(guest, accelerator)}|{MACHINE}|{self.width}x{self.height}"
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class FullMachineSpec(MachineSpec):
    width: int = DEFAULT_SCREEN[0]
    height: int = DEFAULT_SCREEN[1]

    def argv(self, qemu: str) -> list[str]:
        """The microVM's command line with the machine swapped and the screen and input added
        last (QEMU gives them free PCI slots in that order, around the disks' fixed ones)."""
        argv = super().argv(qemu)
        argv[argv.index("-machine") + 1] = MACHINE
        argv[argv.index("-name") + 1] = "sandfleet-vm"
        argv[argv.index("-nographic")] = "-display"
        argv.insert(argv.index("-display") + 1, "none")
        return argv + [
            "-device", f"VGA,id={VGA_ID},edid=on,xres={self.width},yres={self.height},"
                       f"vgamem_mb={vga_memory_mb(self.width, self.height)}",
            "-device", f"virtio-keyboard-pci,id={KEYBOARD_ID}",
            "-device", f"virtio-tablet-pci,id={TABLET_ID}",
        ]


SCREEN_FILE = "screen"  # in a machine's directory: its card's size, for a launcher that adopts it


class FullMachines(MicroVMs):
    """Full machines on this node: started, saved and ended as microVMs are, on their own
    machine (their states and directories under the `vm` level's own state dir). A start's
    screen is what the driver put in `screens` for that sandbox (the default otherwise): the
    microVM's start path above it stays one, whatever the level."""

    MACHINE = MACHINE.partition(",")[0]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.screens: dict[str, tuple[int, int]] = {}

    async def start(self, sandbox_id: str, shape: Shape, *args: Any, **kwargs: Any) -> RunningVM:
        width, height = self.screens.get(sandbox_id, DEFAULT_SCREEN)
        full = FullShape(**{f.name: getattr(shape, f.name) for f in fields(shape)}, width=width, height=height)
        vm = await super().start(sandbox_id, full, *args, **kwargs)
        (vm.run_dir / SCREEN_FILE).write_text(f"{width}x{height}\n")
        return vm

    def screen_of(self, vm: RunningVM) -> tuple[int, int]:
        """The card's size of a running machine (the node's own note, never the guest's word)."""
        try:
            width, _, height = (vm.run_dir / SCREEN_FILE).read_text().strip().partition("x")
            return screen_size(int(width), int(height))
        except (OSError, ValueError):
            return DEFAULT_SCREEN

    def spec(self, shape: Shape, images: list[Path], **options: object) -> MachineSpec:
        width, height = (shape.width, shape.height) if isinstance(shape, FullShape) else DEFAULT_SCREEN
        return FullMachineSpec(self.guest, self.accelerator, shape.vcpus, shape.memory_mb, tuple(map(str, images)),
                               Path("."), width=width, height=height, **options)  # type: ignore[arg-type]

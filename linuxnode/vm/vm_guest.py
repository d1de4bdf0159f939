"""The guest a `vm` boots: the microVM's kernel and initramfs (guest_image.py), with the modules
of a full machine's display and input added, so both levels run the very same kernel, init and
agent, and a desktop layer needs no kernel modules of its own.

The addition is a second `newc` archive appended to the microVM's initramfs: Linux unpacks
concatenated archives in order, a later file replacing an earlier one of the same name, so the
appended `modules/order` (the microVM's modules, then these, dependencies first) replaces the
first and the unchanged /init loads them all. The modules: `bochs` (DRM for QEMU's standard
VGA, whose EDID gives the screen size; its fbdev emulation gives the console and X a
framebuffer), `virtio_input` (the tablet and keyboard the node's input events arrive on) and
`evdev` (their /dev/input nodes for X).

`make install` runs `python -m linuxnode.vm.vm_guest <unpacked kernel package> <out>` after the
microVM's guest is built in `<out>`; it writes `initramfs-vm.img` beside it.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from linuxnode.vm import guest_image
from linuxnode.vm.guest_image import GuestImage

VM_MODULES = ("bochs", "virtio_input", "evdev")
INITRAMFS = "initramfs-vm.img"


def find(directory: Path) -> GuestImage | str:
    """The `vm` guest built into `directory`, or why there is none."""
    base = GuestImage.find(directory)
    if isinstance(base, str):
        return base
    initramfs = directory / INITRAMFS
    if not initramfs.is_file():
        return f"no {initramfs} (make install builds the vm guest)"
    digest = hashlib.sha256(base.digest.encode())
    digest.update(initramfs.read_bytes())
    return GuestImage(base.kernel, initramfs, base.release, digest.hexdigest()[:16])


def build(unpacked: Path, out: Path) -> GuestImage:
    """`out/initramfs-vm.img` from the microVM guest in `out` and the kernel package unpacked at
    `unpacked` (whose modules.dep guest_image.build wrote)."""
    base = GuestImage.find(out)
    if isinstance(base, str):
        raise FileNotFoundError(base)
    release = base.release
    everything = guest_image.module_order(unpacked, release, guest_image.MODULES + VM_MODULES)
    present = set(guest_image.module_order(unpacked, release))
    added = [m for m in everything if m not in present]
    entries: list[tuple[str, int, bytes]] = [
        ("modules/order", 0o100644, "".join(f"{m.name}\n" for m in everything).encode()),
        *((f"modules/{m.name}", 0o100644, m.read_bytes()) for m in added),
    ]
    first = base.initramfs.read_bytes()
    partial = out / (INITRAMFS + ".part")
    # Zeros between archives are skipped by the kernel's unpacker: the second starts 4-aligned.
    partial.write_bytes(first + b"\0" * (-len(first) % 4) + gzip.compress(guest_image.cpio(entries), mtime=0))
    os.replace(partial, out / INITRAMFS)
    found = find(out)
    assert isinstance(found, GuestImage)
    return found


def _depmod(unpacked: Path, release: str) -> None:
    if not (unpacked / "lib" / "modules" / release / "modules.dep").exists():
        subprocess.run(["depmod", "-b", str(unpacked), release], check=True)


if __name__ == "__main__":
    tree, target = Path(sys.argv[1]), Path(sys.argv[2])
    microvm = GuestImage.find(target)
    if isinstance(microvm, str):
        sys.exit(microvm)
    _depmod(tree, microvm.release)
    image = build(tree, target)
    print(f"vm guest {image.release} ({image.digest}) in {image.initramfs}")

"""The guest a microVM boots: Debian's kernel and an initramfs this project builds (busybox,
the /init script and the guest agent beside this module, and the kernel modules they need).

`make install` downloads Debian's kernel package and unpacks it into a temporary directory
(never installing it: a second kernel image on the host would join the host's boot menu and
initramfs hooks), then runs `python -m linuxnode.vm.guest_image <unpacked> <out>`, which keeps
only what a guest needs in `<out>`: `vmlinux`, `initramfs.img` and `release`. Everything is a
module in Debian's kernel, so the initramfs carries the virtio, EROFS and overlay modules in
the order `modprobe --show-depends` gives. A node finds the result with `GuestImage.find`.

The kernel is kept uncompressed (the ELF inside Debian's bzImage, symbols stripped): QEMU boots
it through its PVH entry point, skipping SeaBIOS's real-mode setup and the xz decompression,
which under TCG cost more than the kernel's own start (a cold boot went from ~38 s to ~21 s
on a loaded node, ~12 s of the difference before Linux printed its first line).
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent / "guest"
AGENT_SOURCE = HERE / "agent.c"
INIT_SCRIPT = HERE / "init"
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static
# What /init needs, each with its dependencies: the PCI transport, the layer disks, the agent's
# port, the layers' file system (and libcrc32c's softdep crc32c, which modprobe lists), overlay,
# and the NIC of a sandbox with allow rules.
MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "erofs", "overlay", "virtio_net")


def default_dir() -> Path:
    """Where `make install` puts the guest: inside the environment it installed (the venv)."""
    return Path(os.environ.get("SANDFLEET_GUEST_DIR") or Path(sys.prefix) / "share" / "sandfleet-guest")


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initramfs: Path
    release: str  # the guest kernel's `uname -r`
    digest: str  # of kernel and initramfs: part of a machine-state snapshot's key

    @classmethod
    def find(cls, directory: Path) -> GuestImage | str:
        """The guest built into `directory`, or why there is none."""
        kernel, initramfs, release = directory / "vmlinux", directory / "initramfs.img", directory / "release"
        for path in (kernel, initramfs, release):
            if not path.is_file():
                return f"no {path} (make install builds the guest)"
        digest = hashlib.sha256()
        for path in (kernel, initramfs):
            digest.update(path.read_bytes())
        return cls(kernel, initramfs, release.read_text().strip(), digest.hexdigest()[:16])


def module_order(tree: Path, release: str, names: tuple[str, ...] = MODULES) -> list[Path]:
    """Every module `names` need, each once, dependencies first (as modprobe would load them)."""
    order: list[Path] = []
    for name in names:
        shown = subprocess.run(["modprobe", "-d", str(tree), "-S", release, "--show-depends", name],
                               capture_output=True, text=True, check=True).stdout
        for line in shown.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "insmod":
                path = Path(rest.split()[0])
                if path not in order:
                    order.append(path)
    return order


def compile_agent(out: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError(2, "no C compiler to build the guest agent", str(AGENT_SOURCE))
    subprocess.run([cc, "-O2", "-static", "-Wall", "-o", str(out), str(AGENT_SOURCE)], check=True)


def uncompressed_kernel(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage compressed with xz (Debian's CONFIG_KERNEL_XZ)."""
    at = bzimage.find(b"\xfd7zXZ\x00")
    if at < 0:
        raise ValueError("no xz stream in the kernel image")
    elf = lzma.LZMADecompressor().decompress(bzimage[at:])  # what follows the stream is ignored
    if not elf.startswith(b"\x7fELF"):
        raise ValueError("the kernel image's xz stream is not an ELF kernel")
    return elf


def cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A `newc` archive of (name, mode, content); directories have mode 0o040xxx, links 0o120xxx."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + encoded
        out += b"\0" * (-len(out) % 4) + data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def build(unpacked: Path, out: Path) -> GuestImage:
    """The guest from a kernel package unpacked at `unpacked` (`dpkg-deb -x`), into `out`."""
    [kernel] = sorted((unpacked / "boot").glob("vmlinuz-*"))
    release = kernel.name.removeprefix("vmlinuz-")
    tree = unpacked
    subprocess.run(["depmod", "-b", str(tree), release], check=True)  # the package ships no modules.dep
    modules = module_order(tree, release)
    with tempfile.TemporaryDirectory() as work:
        agent = Path(work) / "agent"
        compile_agent(agent)
        entries: list[tuple[str, int, bytes]] = [
            ("bin", 0o040755, b""), ("modules", 0o040755, b""),
            ("bin/busybox", 0o100755, BUSYBOX.read_bytes()),
            ("init", 0o100755, INIT_SCRIPT.read_bytes()),
            ("agent", 0o100755, agent.read_bytes()),
            ("modules/order", 0o100644, "".join(f"{m.name}\n" for m in modules).encode()),
        ]
        entries += [(f"modules/{m.name}", 0o100644, m.read_bytes()) for m in modules]
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "initramfs.img.part"
    partial.write_bytes(gzip.compress(cpio(entries), compresslevel=6, mtime=0))
    elf = out / "vmlinux.part"
    elf.write_bytes(uncompressed_kernel(kernel.read_bytes()))
    if shutil.which("objcopy"):  # 66 MB with symbols, which nothing here reads
        subprocess.run(["objcopy", "--strip-all", str(elf)], check=True)
    os.replace(elf, out / "vmlinux")
    (out / "vmlinuz").unlink(missing_ok=True)  # what an earlier build kept
    os.replace(partial, out / "initramfs.img")
    (out / "release").write_text(release + "\n")
    found = GuestImage.find(out)
    assert isinstance(found, GuestImage)
    return found


if __name__ == "__main__":
    image = build(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"guest {image.release} ({image.digest}) in {image.kernel.parent}")

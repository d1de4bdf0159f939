"""What bcc needs to compile our programs on this host: kernel headers and tracefs.

A host with headers for its running kernel (/lib/modules/$(uname -r)/build) needs nothing.
Debian hosts whose kernel has no header package (this VM: 6.18 with 6.1 headers) use the
newest `linux-headers-<v>-common` as BCC_KERNEL_SOURCE plus the generated dirs of the
matching arch package; that is safe because the programs read no kernel struct, only the
stable BPF context ABI. tracefs is mounted when missing (as systemd does at boot) so the
socket() tracepoints can be compiled and attached; without it they are left out.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from linuxnode import syscalls as linux

TRACEFS = "/sys/kernel/tracing"
_DEB_ARCH = {"x86_64": ("amd64", "x86"), "aarch64": ("arm64", "arm64")}
_compile_lock = threading.Lock()


class BpfUnavailable(RuntimeError):
    """This host cannot compile or load the programs (no headers, no bcc, no privilege)."""


@dataclass(frozen=True)
class KernelHeaders:
    source: str | None  # BCC_KERNEL_SOURCE, or None when the running kernel's own headers exist
    cflags: tuple[str, ...]


def _version_key(path: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", os.path.basename(path))]


def kernel_headers() -> KernelHeaders:
    if os.path.isdir(f"/lib/modules/{os.uname().release}/build/include"):
        return KernelHeaders(source=None, cflags=())
    machine = os.uname().machine
    if machine not in _DEB_ARCH:
        raise BpfUnavailable(f"no kernel headers for {os.uname().release} and no fallback for {machine}")
    deb_arch, arch_dir = _DEB_ARCH[machine]
    for common in sorted(glob.glob("/usr/src/linux-headers-*-common"), key=_version_key, reverse=True):
        arch = common.removesuffix("-common") + f"-{deb_arch}"
        if not os.path.isdir(arch):
            continue
        dirs = (f"arch/{arch_dir}/include/generated", "include",
                f"arch/{arch_dir}/include/generated/uapi", "include/generated/uapi")
        return KernelHeaders(source=common, cflags=tuple(f"-I{arch}/{d}" for d in dirs))
    raise BpfUnavailable(
        f"no kernel headers for {os.uname().release}: install linux-headers-{deb_arch} "
        f"(Debian's -{deb_arch} and -common header packages)"
    )


def compile_program(source: Path, extra_cflags: Iterable[str] = ()):
    """A bcc BPF object for source (~0.6 s and ~150 MB), built against this host's headers; its
    programs are loaded, not attached. Raises BpfUnavailable when bcc or the compile fails."""
    try:
        from bcc import BPF  # Debian python3-bpfcc, linked into the venv by infra/bcc-in-venv.sh
    except ImportError as exc:
        raise BpfUnavailable("bcc is not importable (python3-bpfcc and infra/bcc-in-venv.sh)") from exc
    headers = kernel_headers()
    cflags = [*headers.cflags, f"-I{source.parent}", "-w", *extra_cflags]
    with _compile_lock:  # BCC_KERNEL_SOURCE is process-wide: one compile at a time
        saved = os.environ.get("BCC_KERNEL_SOURCE")
        if headers.source:
            os.environ["BCC_KERNEL_SOURCE"] = headers.source
        try:
            return BPF(src_file=str(source).encode(), cflags=cflags)
        except Exception as exc:  # bcc raises bare Exception for compile and load errors
            raise BpfUnavailable(f"cannot build {source.name}: {exc}") from exc
        finally:
            if saved is None:
                os.environ.pop("BCC_KERNEL_SOURCE", None)
            else:
                os.environ["BCC_KERNEL_SOURCE"] = saved


def tracefs_ready() -> bool:
    """True once syscall tracepoints can be resolved; mounts tracefs if it is missing."""
    events = f"{TRACEFS}/events/syscalls/sys_enter_socket"
    if os.path.isdir(events):
        return True
    try:
        linux.mount("nodev", TRACEFS, "tracefs", 0)
    except OSError:
        return False
    return os.path.isdir(events)

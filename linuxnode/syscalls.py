"""The Linux syscalls Python 3.11's `os` lacks, called through ctypes: namespaces, mounts,
pivot_root, prctl, capabilities, close_range and openat2.

Every wrapper raises OSError(errno, strerror, <what it acted on>) on failure. The symbols are
resolved at import so that forked children never reach the dynamic loader (which takes locks).
Syscall numbers are known for x86_64 and aarch64.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_mount = _libc.mount
_mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_umount2 = _libc.umount2
_umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_unshare = _libc.unshare
_unshare.argtypes = [ctypes.c_int]
_setns = _libc.setns
_setns.argtypes = [ctypes.c_int, ctypes.c_int]
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_sigmask = _libc.pthread_sigmask
_sigmask.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

CLOSE_RANGE_CLOEXEC = 1 << 2

_SYSCALLS = {  # (x86_64, aarch64)
    "pivot_root": (155, 41),
    "capset": (126, 91),
    "close_range": (436, 436),
    "openat2": (437, 437),
}
_ARCH = 0 if os.uname().machine == "x86_64" else 1
_NR = {name: nrs[_ARCH] for name, nrs in _SYSCALLS.items()}


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


def _b(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def umount2(target: str, flags: int = 0) -> None:
    _check(_umount2(_b(target), flags), f"umount {target}")


def unshare(flags: int) -> None:
    _check(_unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_setns(fd, nstype), "setns")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_syscall(ctypes.c_long(_NR["pivot_root"]), _b(new_root), _b(put_old)), f"pivot_root {new_root}")


SigSet = ctypes.c_ubyte * 128  # glibc's sigset_t
_ALL = SigSet(*([0xFF] * 128))
_NONE = SigSet()


def block_all_signals() -> ctypes.Array:
    """Block every signal for this thread; returns the previous mask for restore_signals.
    (signal.pthread_sigmask turns each signal of a mask into an enum member: ~0.25 ms.)"""
    old = SigSet()
    _sigmask(0, ctypes.addressof(_ALL), ctypes.addressof(old))  # SIG_BLOCK
    return old


def restore_signals(mask: ctypes.Array | None = None) -> None:
    """Set this thread's signal mask (to nothing blocked by default)."""
    _sigmask(2, ctypes.addressof(mask if mask is not None else _NONE), None)  # SIG_SETMASK


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_prctl(option, arg2, arg3, arg4, arg5), f"prctl {option}")


def close_range_cloexec(first: int) -> None:
    """Mark every fd >= first close-on-exec, in one syscall."""
    _check(_syscall(ctypes.c_long(_NR["close_range"]), ctypes.c_ulong(first), ctypes.c_ulong(0xFFFFFFFF),
                    ctypes.c_ulong(CLOSE_RANGE_CLOEXEC)), "close_range")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def cap_last_cap() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


def drop_all_capabilities(last_cap: int) -> None:
    """Empty the bounding and ambient sets, then the effective, permitted and inheritable sets.

    With an empty bounding set, even uid 0 gains nothing at execve; no_new_privs is left to
    the caller because it is also wanted where capabilities are not dropped.
    """
    drop_bounding_set(last_cap)
    clear_capabilities()


def drop_bounding_set(last_cap: int, keep: frozenset[int] = frozenset()) -> None:
    """Empty the bounding set but `keep` (needs CAP_SETPCAP: before giving up root)."""
    for cap in range(last_cap + 1):
        if cap not in keep:
            _check(_prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")


def clear_capabilities(keep: frozenset[int] = frozenset()) -> None:
    """Empty the ambient and inheritable sets, and the effective and permitted ones but `keep`
    (numbers below 32, which must be permitted already)."""
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on kernels without ambient caps
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    mask = sum(1 << cap for cap in keep)
    data[0].effective = data[0].permitted = mask
    _check(_syscall(ctypes.c_long(_NR["capset"]), ctypes.byref(header), ctypes.byref(data)), "capset")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2); the error keeps its errno so callers can map it (FileNotFoundError, ...)."""
    how = _OpenHow(flags, mode, resolve)
    fd = _syscall(ctypes.c_long(_NR["openat2"]), ctypes.c_long(dirfd), os.fsencode(path), ctypes.byref(how),
                  ctypes.c_ulong(ctypes.sizeof(how)))
    return _check(fd, path)


def set_child_subreaper() -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp(filter_bytes: bytes) -> None:
    """Install a classic-BPF seccomp filter (raw `struct sock_filter` array, 8 bytes per
    instruction) on this thread; needs no_new_privs (or CAP_SYS_ADMIN). It is inherited
    across fork and kept across execve."""
    if not filter_bytes or len(filter_bytes) % 8:
        raise OSError(22, "bad seccomp filter length", "seccomp")
    program = ctypes.create_string_buffer(filter_bytes, len(filter_bytes))
    fprog = _SockFprog(len(filter_bytes) // 8, ctypes.addressof(program))
    _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")


def on_own_thread(fn: Callable[[], T], name: str) -> T:
    """Run `fn` on a short-lived thread of its own, which may change namespace (unshare, setns:
    per thread) and ends after, so no thread of a pool is ever left in one; returns what `fn`
    returned or raises what it raised. The caller's thread never moves."""
    done: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            done.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = done[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]

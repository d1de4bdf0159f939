"""A mount made through the kernel's file-descriptor mount API (fsopen, fsconfig, fsmount,
move_mount), for what mount(2) cannot say: mount(2) takes its options as one string of at
most a page, which an overlay over a deep image (one lower layer per OCI layer, each a long
path) overruns; `fsconfig` takes each option, and each `lowerdir+` layer, on its own.

The numbers are the same on every architecture (they came after the syscall tables were
unified). Raises OSError(errno, strerror, <the step>) like linuxnode.syscalls.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

_MOVE_MOUNT, _FSOPEN, _FSCONFIG, _FSMOUNT = 429, 430, 431, 432
FSOPEN_CLOEXEC = 0x1
FSMOUNT_CLOEXEC = 0x1
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


def mount(fstype: str, target: str, options: list[tuple[str, str | None]], attrs: int = 0,
          source: str | None = None) -> None:
    """Mount a new `fstype` at `target`: each option in order (`(key, value)`, a flag when the
    value is None), then create the superblock and attach it. `attrs` are MOUNT_ATTR_* flags."""
    fs = _check(_syscall(ctypes.c_long(_FSOPEN), os.fsencode(fstype), ctypes.c_uint(FSOPEN_CLOEXEC)),
                f"fsopen {fstype}")
    try:
        settings = ([("source", source)] if source is not None else []) + options
        for key, value in settings:
            if value is None:
                _check(_syscall(ctypes.c_long(_FSCONFIG), fs, FSCONFIG_SET_FLAG, os.fsencode(key), None, 0),
                       f"{fstype} option {key}")
            else:
                _check(_syscall(ctypes.c_long(_FSCONFIG), fs, FSCONFIG_SET_STRING, os.fsencode(key),
                                os.fsencode(value), 0), f"{fstype} option {key}={value}")
        _check(_syscall(ctypes.c_long(_FSCONFIG), fs, FSCONFIG_CMD_CREATE, None, None, 0), f"create {fstype}")
        mnt = _check(_syscall(ctypes.c_long(_FSMOUNT), fs, ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(attrs)),
                     f"fsmount {fstype}")
    finally:
        os.close(fs)
    try:
        _check(_syscall(ctypes.c_long(_MOVE_MOUNT), mnt, b"", AT_FDCWD, os.fsencode(target),
                        ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"attach {fstype} at {target}")
    finally:
        os.close(mnt)

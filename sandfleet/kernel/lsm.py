"""Which Linux security modules this kernel offers, read without changing anything."""

from __future__ import annotations

import ctypes
import os

_LANDLOCK_CREATE_RULESET = {"x86_64": 444, "aarch64": 444}
_LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
_libc = ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """Landlock's ABI version, or 0 when the kernel has no (enabled) Landlock."""
    nr = _LANDLOCK_CREATE_RULESET.get(os.uname().machine)
    if nr is None:
        return 0
    version = _libc.syscall(ctypes.c_long(nr), None, ctypes.c_size_t(0), ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(0, version)


def apparmor_enabled() -> bool:
    try:
        with open("/sys/module/apparmor/parameters/enabled") as f:
            return f.read().strip() == "Y"
    except OSError:
        return False

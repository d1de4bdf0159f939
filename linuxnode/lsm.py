"""Which Linux security modules this kernel offers, read without changing anything."""

from __future__ import annotations

from linuxnode import landlock


def landlock_abi() -> int:
    """Landlock's ABI version, or 0 when the kernel has no (enabled) Landlock."""
    return landlock.abi()


def apparmor_enabled() -> bool:
    try:
        with open("/sys/module/apparmor/parameters/enabled") as f:
            return f.read().strip() == "Y"
    except OSError:
        return False

"""Kernel facts for tests, and skips that CI may not take: with SANDFLEET_REQUIRE_KERNEL=1 a
missing kernel feature fails."""

from __future__ import annotations

import functools
import os
import subprocess

import pytest

LSM_LIST = "/sys/kernel/security/lsm"


def require(condition: bool, why: str) -> None:
    if condition:
        return
    if os.environ.get("SANDFLEET_REQUIRE_KERNEL") == "1":
        pytest.fail(f"kernel feature required but missing: {why}")
    print(f"SKIP: {why}")
    pytest.skip(why)


def only_where(condition: bool, why: str) -> None:
    """Skip, with the reason printed, a test of one of two kernels a node may run on (with AppArmor
    and without it): the other kernel's test runs instead, so even CI takes this skip."""
    if not condition:
        print(f"SKIP: {why}")
        pytest.skip(why)


@functools.cache
def active_lsms() -> frozenset[str]:
    """The security modules the kernel runs, as the kernel lists them in securityfs.

    Asked of the kernel's own list rather than the way the node probes (Landlock's syscall,
    AppArmor's module parameter), so a test of what the node reports does not share the
    node's mistakes. Where securityfs is not mounted (this VM), it is mounted in a throwaway
    mount namespace, which leaves nothing on the machine."""
    if os.path.exists(LSM_LIST):
        with open(LSM_LIST) as f:
            return frozenset(f.read().strip().split(","))
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t securityfs securityfs /sys/kernel/security && cat {LSM_LIST}"],
        capture_output=True, text=True, timeout=10, check=True,
    )
    return frozenset(out.stdout.strip().split(","))

"""Skips that CI may not take: with SANDFLEET_REQUIRE_KERNEL=1 a missing kernel feature fails."""

from __future__ import annotations

import os

import pytest


def require(condition: bool, why: str) -> None:
    if condition:
        return
    if os.environ.get("SANDFLEET_REQUIRE_KERNEL") == "1":
        pytest.fail(f"kernel feature required but missing: {why}")
    print(f"SKIP: {why}")
    pytest.skip(why)

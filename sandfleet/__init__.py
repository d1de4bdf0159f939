"""sandfleet: disposable, isolated sandboxes on a NATS bus, for agentic RL.

    async with sandfleet.connect("nats://127.0.0.1:4222") as fleet:
        sb = await fleet.create(isolation="process", layers=["base"])
        r = await sb.exec(["echo", "hi"])

The SDK is imported on first use, so `sandfleet.kernel` loads without the bus client (the
runtime's forking helper runs with no site-packages at all).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BatchProgress", "ExecResult", "Fleet", "RolloutChange", "Sandbox", "connect", "errors"]


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("sandfleet.errors")
    if name in __all__:
        return getattr(importlib.import_module("sandfleet.client"), name)
    raise AttributeError(f"module 'sandfleet' has no attribute {name!r}")

"""sandfleet: disposable, isolated sandboxes on a NATS bus, for agentic RL.

    async with sandfleet.connect("nats://127.0.0.1:4222") as fleet:
        sb = await fleet.create(isolation="process", layers=["base"])
        r = await sb.exec(["echo", "hi"])

This package is the client side (SDK, CLI, bus adapter, telemetry, the `sandfleet up`
supervisor); the node's Linux library is `linuxnode`, which imports nothing of this package.
"""

from __future__ import annotations

from sandfleet import errors
from sandfleet.client import BatchProgress, DesktopSpec, ExecResult, Fleet, RolloutChange, Sandbox, connect

__all__ = ["BatchProgress", "DesktopSpec", "ExecResult", "Fleet", "RolloutChange", "Sandbox", "connect", "errors"]

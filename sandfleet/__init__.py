"""sandfleet: disposable, isolated sandboxes on a NATS bus, for agentic RL.

    async with sandfleet.connect("nats://127.0.0.1:4222") as fleet:
        sb = await fleet.create(isolation="process")
        r = await sb.exec(["echo", "hi"])
"""

from sandfleet import errors
from sandfleet.client import ExecResult, Fleet, Sandbox, connect

__all__ = ["ExecResult", "Fleet", "Sandbox", "connect", "errors"]

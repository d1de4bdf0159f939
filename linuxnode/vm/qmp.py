"""A QMP client (QEMU's JSON monitor on a unix socket): enough to stop a machine, save its
state to a file descriptor the node passes over the socket, and wait for that to finish.
QMP is QEMU's, not the guest's; its lines are still bounded, and events are skipped."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

MAX_LINE = 1 << 20


class QmpError(Exception):
    """QEMU refused a command or its monitor went away."""


class Qmp:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, path: str, timeout: float = 10.0) -> Qmp:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(path, limit=MAX_LINE)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(0.01)
            qmp = cls(reader, writer)
            await qmp._line()  # the greeting
            await qmp.execute("qmp_capabilities")
        return qmp

    async def _line(self) -> dict[str, Any]:
        line = await self._reader.readline()
        if not line:
            raise QmpError("QEMU's monitor closed")
        return json.loads(line)

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, fd: int | None = None,
                      timeout: float = 30.0) -> Any:
        message = json.dumps({"execute": command, **({"arguments": arguments} if arguments else {})}).encode()
        if fd is None:
            self._writer.write(message)
        else:  # SCM_RIGHTS with the command (QMP `getfd`): the socket must be drained first
            await self._writer.drain()
            own = self._writer.get_extra_info("socket").fileno()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(own)) as sock:
                socket.send_fds(sock, [message], [fd])
        async with asyncio.timeout(timeout):
            while True:
                reply = await self._line()
                if "return" in reply:
                    return reply["return"]
                if "error" in reply:
                    raise QmpError(f"{command}: {reply['error'].get('desc', reply['error'])}")

    async def save_state(self, fd: int, timeout: float = 120.0) -> None:
        """Write the machine's whole state (RAM and devices) to `fd`, as a live migration: QEMU
        pauses the machine at the end, and a machine restored from it runs at once (a state
        saved after `stop` would restore paused, and need a `cont` over QMP)."""
        await self.execute("getfd", {"fdname": "state"}, fd=fd)
        await self.execute("migrate", {"uri": "fd:state"})
        async with asyncio.timeout(timeout):
            while True:
                status = (await self.execute("query-migrate")).get("status")
                if status == "completed":
                    return
                if status in ("failed", "cancelled"):
                    raise QmpError(f"saving the machine state: {status}")
                await asyncio.sleep(0.05)

    def close(self) -> None:
        self._writer.close()

"""What a VM level's driver hands the launcher for a command its guest agent runs (the seam's
RunningCommand and RunningTerminal over linuxnode.vm.channel), and the small rules every such
level shares: how a wait status reads as an exit code, which forward address is the guest's."""

from __future__ import annotations

import os
import signal

from linuxnode.vm.channel import AgentChannel, GuestBroken, GuestCommand
from services.launcher.drivers.base import StdinClosed, Unsupported


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def loopback_is_ipv6(host: str, level: str) -> bool:
    """A forward reaches the guest's loopback only: the guest's own NIC address is slirp's, the
    same in every guest, and nothing the node can name from outside."""
    if host in ("127.0.0.1", "localhost"):
        return False
    if host == "::1":
        return True
    raise Unsupported(f"a {level} forwards to its loopback (127.0.0.1 or ::1), not to {host!r}")


class GuestBackground:
    """A background command in the guest, as the seam's RunningCommand."""

    def __init__(self, channel: AgentChannel, running: GuestCommand) -> None:
        self.channel, self.running = channel, running
        self.stdin_open = True

    @property
    def os_pid(self) -> int | None:
        return self.running.pid

    async def write(self, data: bytes) -> int:
        if not self.stdin_open or self.running.exited.done():
            raise StdinClosed("its stdin is closed")
        try:
            self.channel.stdin(self.running, data)
        except GuestBroken as exc:
            raise StdinClosed(str(exc)) from None
        return len(data)

    def close_stdin(self) -> None:
        if self.stdin_open and not self.channel.broken:
            self.channel.close_stdin(self.running)
        self.stdin_open = False

    def signal(self, number: int) -> bool:
        if self.running.exited.done() or self.channel.broken:
            return False
        self.channel.signal(self.running, number)
        return True

    def close(self) -> None:
        self.signal(signal.SIGKILL)


class GuestTerminal(GuestBackground):
    """A command on a terminal of the guest's own devpts (the agent holds its master)."""

    def resize(self, cols: int, rows: int) -> bool:
        if self.running.exited.done() or self.channel.broken:
            return False
        self.channel.resize(self.running, cols, rows)
        return True

"""The launcher's side of a terminal: a background command (background.py) whose stdin, stdout
and stderr are one pty instead of three pipes, plus its window size.

The node opens the pty: its master on the sandbox's own devpts (`/dev/pts/ptmx` resolved in the
init's root, never through a path the sandbox could swap), so the slave is `/dev/pts/N` inside
and `tty` there names it. The slave goes to the exec helper as the command's stdin, stdout and
stderr, which makes it the controlling terminal of a new session (children.py) inside the
sandbox's namespaces, under the same confinement as any exec. The master stays here: keystrokes
are written to it, the output read from it (stream 1, the only one: a terminal merges them), and
a resize is TIOCSWINSZ on it, on which the kernel sends SIGWINCH to the foreground job.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from linuxnode import syscalls as linux
from linuxnode.process.background import PIPE_BYTES, BackgroundCommand, running
from linuxnode.process.execio import check_command, send_command
from linuxnode.process.lifecycle import open_init
from linuxnode.process.model import DEFAULT_ENV, ExecError, InitProcess
from linuxnode.process.protocol import TerminalCommand

if TYPE_CHECKING:
    import asyncio

MAX_SIZE = 1000  # columns or rows: more is a mistake, not a screen (and the kernel's field is 16 bits)
DEFAULT_TERM = "xterm-256color"  # what a caller that names none most likely runs
TIOCGPTPEER = 0x5441  # asm-generic: the slave of a master, opened without a path lookup
TIOCSWINSZ = 0x5414
TIOCSPTLCK = 0x40045431  # unlockpt(): a new slave is locked, and opening it fails with EIO until then
_PTMX = "dev/pts/ptmx"
_PTMX_RDEV = os.makedev(5, 2)
_RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS


def check_size(cols: int, rows: int) -> None:
    """ValueError unless both are 1..MAX_SIZE."""
    for name, value in (("cols", cols), ("rows", rows)):
        if type(value) is not int or not 1 <= value <= MAX_SIZE:
            raise ValueError(f"{name} must be 1..{MAX_SIZE}, not {value!r}")


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def open_master(init: InitProcess) -> int:
    """A new pty master on the sandbox's own devpts; ExecError if it has none."""
    pidfd, root = open_init(init)
    try:
        fd = linux.openat2(root, _PTMX, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC, 0, _RESOLVE)
    except OSError as exc:
        raise ExecError(f"the sandbox has no terminals: cannot open its /{_PTMX} ({exc.strerror})") from None
    finally:
        os.close(pidfd)
        os.close(root)
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != _PTMX_RDEV:
        os.close(fd)
        raise ExecError(f"the sandbox's /{_PTMX} is not a pty multiplexer")
    return fd


class Terminal(BackgroundCommand):
    """A background command on a pty: its output is stream 1, its stdin the keyboard."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fds: dict[str, int], tty: int,
                 on_output: Callable[[int, bytes], None], on_exit: Callable[[int], None],
                 read_bytes: int = PIPE_BYTES) -> None:
        self.tty = tty  # the master, for resizes: kept apart from stdin, which a caller may close
        super().__init__(loop, fds, on_output, on_exit, read_bytes)

    def resize(self, cols: int, rows: int) -> bool:
        """Set the window size (the foreground job gets SIGWINCH); False if the command ended.
        ValueError for a size out of 1..MAX_SIZE."""
        check_size(cols, rows)
        if self.status is not None or self.tty < 0:
            return False
        _set_size(self.tty, cols, rows)
        return True

    def _exited(self) -> None:
        super()._exited()
        self._close_tty()

    def close(self) -> None:
        super().close()
        self._close_tty()

    def _close_tty(self) -> None:
        if self.tty >= 0:
            os.close(self.tty)
            self.tty = -1


async def spawn(init: InitProcess, argv: list[str], *, cgroup_procs: list[str], env: dict[str, str] | None,
                cwd: str, cols: int, rows: int, on_output: Callable[[int, bytes], None],
                on_exit: Callable[[int], None], read_bytes: int = PIPE_BYTES, apparmor: str = "",
                uid: int = -1, gid: int = -1, build: bool = False) -> Terminal:
    """Start argv in the sandbox on a new terminal of `cols` x `rows`; returns once it runs (a
    command not found exits 127, saying so on the terminal). TERM is DEFAULT_TERM unless `env`
    names one. ValueError for a bad size or argv, FileNotFoundError for a missing cwd."""
    import asyncio

    check_size(cols, rows)
    full_env = {**DEFAULT_ENV, "TERM": DEFAULT_TERM, **(env or {})}
    check_command(argv, full_env, cwd)
    loop = asyncio.get_running_loop()
    master = open_master(init)
    opened = [master]
    try:
        _set_size(master, cols, rows)
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slaves = [fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC) for _ in range(3)]
        opened += slaves
        (report_r, _), (_, control_w) = send_command(init, 2, lambda pidfd, root, p: TerminalCommand(
            cgroup_procs=tuple(cgroup_procs), cwd=cwd, argv=tuple(argv), env=full_env, apparmor=apparmor, uid=uid,
            gid=gid, build=build, report=p[0][1], pidfd=pidfd, root=root, stdin=slaves[0], stdout=slaves[1],
            stderr=slaves[2], control=p[1][0]))
    except BaseException:
        for fd in opened:  # send_command closes the slaves only once the spawner holds them
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    os.set_blocking(control_w, False)
    stdin, tty = os.dup(master), os.dup(master)
    return await running(Terminal(loop, {"report": report_r, "control": control_w, "stdin": stdin,
                                         "stdout": master}, tty, on_output, on_exit, read_bytes))

"""The pieces of running a command in a container that are not crun's: joining the sandbox's
cgroups before crun runs, the command's pipes on the event loop, checks made in the
container's root before `crun exec` (so a missing command answers as in a process sandbox),
killing a command's whole tree on timeout, and reaping what crun leaves behind.

The join is a /bin/sh prelude (`joined()`): it writes "0", itself, into each cgroup.procs
file and execs the real argv, so crun and everything it starts are inside the cgroups from
their first instruction; a failed join exits `JOIN_FAILED` with a message of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess

from sandfleet.kernel import layered_root
from sandfleet.kernel.pipes import LoopPipes
from sandfleet.kernel.process import InitProcess

JOIN_FAILED = 125
JOIN_FAILED_MESSAGE = b"sandfleet: cannot join cgroup"
_JOIN = ('while [ "$1" != -- ]; do echo 0 >"$1" || { echo "sandfleet: cannot join cgroup $1" >&2; exit 125; }; '
         'shift; done; shift; exec "$@"')


def joined(argv: list[str], cgroup_procs: list[str]) -> list[str]:
    """argv run by a shell that first joins every cgroup.procs file given."""
    return ["/bin/sh", "-c", _JOIN, "sh", *cgroup_procs, "--", *argv]


# -- checks in the container's root ---------------------------------------------------------------

def check_cwd(init: InitProcess, cwd: str) -> None:
    """FileNotFoundError / NotADirectoryError unless cwd is a directory inside the container."""
    try:
        fd = layered_root.open_in_root(f"/proc/{init.pid}/root", cwd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(exc.errno, "No such file or directory", cwd) from None
        raise OSError(exc.errno, exc.strerror, cwd) from None
    try:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", cwd)
    finally:
        os.close(fd)


def find_command(init: InitProcess, name: str, search: str, cwd: str) -> int:
    """0 if `name` is an executable file in the container (searched in PATH unless it has a
    slash), else the exit code a shell gives: 127 not found, 126 not executable."""
    candidates = [name] if "/" in name else [f"{d or '.'}/{name}" for d in search.split(":")]
    code = 127
    for candidate in candidates:
        path = candidate if candidate.startswith("/") else f"{cwd}/{candidate}"
        try:
            fd = layered_root.open_in_root(f"/proc/{init.pid}/root", path)
        except OSError:
            continue
        try:
            link = f"/proc/self/fd/{fd}"
            if os.path.isfile(link) and os.stat(link).st_mode & 0o111:
                return 0
            code = 126
        finally:
            os.close(fd)
    return code


# -- killing and reaping ----------------------------------------------------------------------

def _descendants(pid: int) -> list[int]:
    """pid and every process below it, parents first (read from /proc/<pid>/task/*/children)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        found.append(current)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{current}/task/{tid}/children") as f:
                    queue += [int(c) for c in f.read().split()]
    return found


def kill_command(command_pid: int, runner: subprocess.Popen) -> None:
    """SIGKILL the command and everything it started (crun exec then ends by itself); before
    the command exists, the join prelude or crun itself (its own process group)."""
    for target in _descendants(command_pid) if command_pid else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    if not command_pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)


def reap_strays() -> None:
    """Reap our zombie children that died inside a sandbox's pid namespace. When `crun exec`
    cannot exec the command it exits without reaping its child, which is then reparented to
    us (a subreaper), and the container's pid namespace cannot end until someone reaps it.
    Host-level children (whose NSpid has one entry) belong to their own waiters."""
    me = os.getpid()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{me}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{me}/task/{tid}/children") as f:
                children = f.read().split()
            for child in children:
                with contextlib.suppress(OSError), open(f"/proc/{child}/status") as f:
                    status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                if status.get("State", "").strip().startswith("Z") and len(status.get("NSpid", "").split()) > 1:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(int(child), os.WNOHANG)


# -- the command's pipes ---------------------------------------------------------------------

class ExecPipes(LoopPipes):
    """One runner process (the prelude, then `crun exec`) and its pipes, driven by the event
    loop. The pipes are ours, not asyncio's, so output a background process of the command
    keeps open is closed when the exec is over."""

    def __init__(self, argv: list[str], stdin: bytes, max_output: int) -> None:
        self.out, self.err = bytearray(), bytearray()
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(argv, stdin=in_r, stdout=out_w, stderr=err_w, start_new_session=True)
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        self.pidfd = os.pidfd_open(self.proc.pid)
        super().__init__(asyncio.get_running_loop(), {out_r: self.out, err_r: self.err}, in_w, stdin, max_output)

    async def wait(self, timeout_s: float | None) -> bool:
        """True once the runner has exited, False if `timeout_s` passed first."""
        if self.proc.poll() is not None:
            return True
        exited = self.loop.create_future()
        self.loop.add_reader(self.pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout_s)
        except TimeoutError:
            return False
        finally:
            self.loop.remove_reader(self.pidfd)
        self.proc.wait()
        return True

    async def drained(self, grace_s: float) -> None:
        await asyncio.wait(list(self.eof.values()), timeout=grace_s)

    def close(self) -> None:
        self.close_pipes()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

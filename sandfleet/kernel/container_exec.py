"""The pieces of running a container that are not crun's: the mount namespace crun runs in
(made once, private, with each container's root attached just for its `crun run`), joining
the sandbox's cgroups before crun runs, the command's pipes on the event loop, checks made in the
container's root before `crun exec` (so a missing command answers as in a process sandbox),
killing a command's whole tree on timeout, and reaping what crun leaves behind.

The join is a /bin/sh prelude (`joined()`): it writes "0", itself, into each cgroup.procs
file and execs the real argv, so crun and everything it starts are inside the cgroups from
their first instruction; a failed join exits `JOIN_FAILED` with a message of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import re
import signal
import subprocess
import threading
import time

from sandfleet.kernel import layered_root
from sandfleet.kernel import syscalls as linux
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
    Host-level children (whose NSpid has one entry) belong to their own waiters.

    A node holds thousands of live inits, all our children: a peek (waitid WNOWAIT) finds in
    O(1) that no child is a zombie, which is the common case, before any /proc scan."""
    try:
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return
    except ChildProcessError:
        return
    for child in _children():
        stat = _stat(child)
        if stat is None or stat[1] != "Z":  # a short read first; status only for zombies
            continue
        with contextlib.suppress(OSError), open(f"/proc/{child}/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        if len(status.get("NSpid", "").split()) > 1:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)


def reap_detached(crun_pid: int, timeout_s: float = 1.0) -> None:
    """Reap the helper `crun run --detach` leaves: crun forks a session leader that forks a
    helper and exits, the helper outlives crun and becomes ours (we are a subreaper), and
    would stay a zombie for good. It is a `crun` child younger than crun (only children
    forked after it are looked at, so this stays cheap among thousands of live inits) that
    leads neither its session (the container's init does) nor shares ours (our own `crun`
    commands do, or lead their own session)."""
    ours = os.getsid(0)
    deadline = time.monotonic() + timeout_s
    for child in _children():
        if not (child > crun_pid or child < crun_pid - (1 << 20)):  # pids grow (and may wrap)
            continue
        while True:
            stat = _stat(child)
            if stat is None or stat[0] != "crun" or stat[2] in (child, ours):
                break
            if stat[1] == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child, os.WNOHANG)
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)


def _children() -> list[int]:
    found: list[int] = []
    me = os.getpid()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{me}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{me}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(command, state, session) of pid, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    head, _, tail = data.rpartition(b")")
    fields = tail.split()
    return head.partition(b"(")[2].decode(errors="replace"), fields[0].decode(), int(fields[3])


# -- crun's own mount namespace (see container.py) -------------------------------------------------------------------------

_OPEN_TREE, _MOVE_MOUNT = 428, 429  # one number on every architecture (the unified syscall table)
_OPEN_TREE_CLONE, _AT_RECURSIVE, _MOVE_MOUNT_F_EMPTY_PATH, _AT_FDCWD = 1, 0x8000, 0x4, -100
_CLONE_FS = 0x200
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def make_crun_namespace(hybrid_v2: str | None, prune: tuple[str, ...]) -> int:
    """A private copy of the host's mount namespace (without cgroup v2 on hybrid hosts, and
    without the mounts beneath the `prune` directories), made by a short-lived thread;
    returns an fd that keeps it."""
    made: list[int | BaseException] = []

    def make() -> None:
        try:
            linux.unshare(linux.CLONE_NEWNS)  # this thread only: it also unshares its filesystem info
            linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)  # nothing propagates either way
            if hybrid_v2:
                linux.umount2(hybrid_v2, linux.MNT_DETACH)
            for point in _mounts_beneath(prune):
                with contextlib.suppress(OSError):  # already gone with a parent
                    linux.umount2(point, linux.MNT_DETACH)
            made.append(os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            made.append(exc)

    thread = threading.Thread(target=make, name="crun-namespace")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _mounts_beneath(roots: tuple[str, ...]) -> list[str]:
    """Mount points strictly beneath any of `roots` in this thread's namespace, deepest first."""
    unescape = lambda p: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p)  # noqa: E731
    with open("/proc/thread-self/mountinfo") as f:
        points = {unescape(line.split()[4]) for line in f}
    inside = [p for p in points if any(p.startswith(root.rstrip("/") + "/") for root in roots)]
    return sorted(inside, key=lambda p: p.count("/"), reverse=True)


def enter_namespace(mnt_fd: int) -> None:
    """Pool thread initializer: move this thread into crun's namespace for good."""
    linux.unshare(_CLONE_FS)  # a thread sharing its filesystem info cannot change mount namespace
    linux.setns(mnt_fd, linux.CLONE_NEWNS)


def clone_tree(path: str) -> int:
    """A detached copy of the mount tree at `path` (a bind mount of it if it is no mount point)."""
    fd = _libc.syscall(_OPEN_TREE, ctypes.c_int(_AT_FDCWD), path.encode(),
                       ctypes.c_uint(_OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def attach_tree(tree: int, target: str) -> None:
    if _libc.syscall(_MOVE_MOUNT, ctypes.c_int(tree), b"", ctypes.c_int(_AT_FDCWD), target.encode(),
                     ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


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

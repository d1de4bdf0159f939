"""The `process` isolation level: a sandbox is a pause-mode init (catatonit -P) that is pid 1
of fresh pid, mount, ipc, uts and cgroup namespaces, inside a given network namespace and
cgroups, on a root it cannot write that shows nothing of the host but read-only /usr.

Every sandbox process is forked by the *spawner*, a small helper interpreter started on
first use. Fork copies the parent's page tables and exec tears the copy down again: on this
VM that costs ~1.5 ms each for a 50 MB launcher and a fraction of it for the 12 MB spawner.
- start: the spawner forks B as pid 1 of a new pid namespace (a pid namespace applies to
  the children of the thread that unshares it, so the spawner unshares, forks once and
  goes back, signals blocked). B joins the cgroups before anything else, enters the netns,
  unshares mount/ipc/uts/cgroup namespaces, builds the root from a plan (see _rootfs_plan),
  pivots into it, drops every capability, sets no_new_privs and execs catatonit.
- exec: the spawner forks C, which joins the cgroups, enters all of the init's namespaces
  (the pid namespace for its children only), chroots into its root, drops every
  capability and vfork-spawns the command D in a new session, then waits for it and
  writes its status. C stays outside the sandbox's pid namespace, so the sandbox never
  sees it, and D's orphans fall to the sandbox's init.
The spawner reaps B and C (and is a subreaper for the rest), so the launcher has no
children to reap and a launcher blocked in kill() never holds up a dying pid namespace.
Children report "step: errno message" on a close-on-exec pipe; they run only os/ctypes
code and leave by exec or os._exit. Files are opened with openat2(RESOLVE_IN_ROOT) from the
init's root, so no path or planted symlink leaves the sandbox. The spawner imports this
module, so nothing heavy is imported at the top (exec imports asyncio).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import marshal
import os
import re
import select
import signal
import socket
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass

from sandfleet.kernel import syscalls as linux

CATATONIT = "/usr/bin/catatonit"
STAGE = "/tmp"  # mount point of the new root inside the child's private mount namespace
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/workspace",
    "LANG": "C.UTF-8",
}
START_TIMEOUT_S = 10.0
OUTPUT_GRACE_S = 0.1  # after the command exits, how long a background process may hold its pipes
_SANDBOX_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_ENTER_NS = linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWCGROUP


class RuntimeStartError(RuntimeError):
    """The sandbox init could not be started; the message names the step and the errno."""


class ExecError(RuntimeError):
    """The command could not be started in the sandbox (init gone, cgroup or namespace join failed)."""


@dataclass(frozen=True)
class ProcessSpec:
    sandbox_id: str
    cgroup_procs: list[str]
    netns: str
    tmp_size_mb: int = 256
    workspace_size_mb: int = 1024
    hostname: str = "sandbox"


@dataclass(frozen=True)
class InitProcess:
    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat: a recycled pid never matches it


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool


# -- the sandbox root: a plan computed once per (sizes, hostname), replayed by each B ------

_HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib64", "lib32", "libx32")
_ETC_BINDS = ("ssl/certs", "alternatives", "ld.so.cache")
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_PROC_MASKED_FILES = ("kcore", "keys", "key-users", "timer_list", "sched_debug", "latency_stats")
_PROC_MASKED_DIRS = ("acpi", "scsi", "asound")
_RO = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV


@dataclass(frozen=True)
class _Step:
    what: str
    call: object
    args: tuple


def _write_new(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@functools.cache
def _host_root() -> tuple[tuple[str, str | None], ...]:
    """(name, symlink target or None for a directory) for each host top-level dir that exists."""
    found = []
    for name in _HOST_DIRS:
        path = "/" + name
        if os.path.islink(path):
            found.append((name, os.readlink(path)))
        elif os.path.isdir(path):
            found.append((name, None))
    return tuple(found)


@functools.cache
def _host_facts() -> dict:
    return {
        "etc": tuple(p for p in _ETC_BINDS if os.path.exists("/etc/" + p)),
        "devices": tuple((d, os.stat("/dev/" + d).st_rdev) for d in _DEVICES if os.path.exists("/dev/" + d)),
        "proc_files": tuple(p for p in _PROC_MASKED_FILES if os.path.isfile("/proc/" + p)),
        "proc_dirs": tuple(p for p in _PROC_MASKED_DIRS if os.path.isdir("/proc/" + p)),
        "last_cap": linux.cap_last_cap(),
    }


def _etc_files(hostname: str) -> dict[str, bytes]:
    return {
        "passwd": b"root:x:0:0:root:/workspace:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": b"root:x:0:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n".encode(),
        "hostname": f"{hostname}\n".encode(),
        "nsswitch.conf": b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
                         b"protocols: files\nservices: files\n",
        "resolv.conf": b"",
    }


@functools.lru_cache(maxsize=64)
def _rootfs_plan(tmp_size_mb: int, workspace_size_mb: int, hostname: str) -> tuple[_Step, ...]:
    """Every step B takes to build the sandbox root on STAGE, pivot into it and seal it."""
    facts = _host_facts()
    r = STAGE
    steps: list[_Step] = []

    def add(what: str, call, *args) -> None:
        steps.append(_Step(what, call, args))

    def mount(what: str, source, target, fstype, flags, data=None) -> None:
        add(what, linux.mount, source, target, fstype, flags, data)

    def bind_ro(source: str, target: str) -> None:
        mount(f"bind {source}", source, target, None, linux.MS_BIND)
        mount(f"make {source} read-only", None, target, None, linux.MS_REMOUNT | linux.MS_BIND | _RO)

    mount("make all mounts private", None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    mount("mount root tmpfs", "sandbox", r, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=16m,mode=0755")
    for name, link in _host_root():
        if link is not None:
            add(f"symlink /{name}", os.symlink, link, f"{r}/{name}")
        else:
            add(f"mkdir /{name}", os.mkdir, f"{r}/{name}", 0o755)
            bind_ro(f"/{name}", f"{r}/{name}")

    add("mkdir /etc", os.mkdir, f"{r}/etc", 0o755)
    for name, content in _etc_files(hostname).items():
        add(f"write /etc/{name}", _write_new, f"{r}/etc/{name}", content, 0o644)
    for rel in facts["etc"]:
        target = f"{r}/etc/{rel}"
        if os.path.isdir("/etc/" + rel):
            add(f"mkdir /etc/{rel}", os.makedirs, target, 0o755)
        else:
            add(f"create /etc/{rel}", _write_new, target, b"", 0o644)
        bind_ro(f"/etc/{rel}", target)

    # Device nodes are made, not bound: a bound host inode could be chmod-ed by its owner, uid 0.
    add("mkdir /dev", os.mkdir, f"{r}/dev", 0o755)
    mount("mount /dev tmpfs", "dev", f"{r}/dev", "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "size=64k,mode=0755")
    for name, rdev in facts["devices"]:
        add(f"mknod /dev/{name}", os.mknod, f"{r}/dev/{name}", 0o666 | stat.S_IFCHR, rdev)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        add(f"symlink /dev/{name}", os.symlink, target, f"{r}/dev/{name}")
    add("mkdir /dev/shm", os.mkdir, f"{r}/dev/shm", 0o755)
    mount("mount /dev/shm", "shm", f"{r}/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
          f"size={max(1, tmp_size_mb // 4)}m,mode=1777")
    mount("make /dev read-only", None, f"{r}/dev", None,
          linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NOEXEC)

    # /proc is read-only as a whole: uid 0 owns its entries and could chmod host-global ones.
    add("mkdir /proc", os.mkdir, f"{r}/proc", 0o555)
    mount("mount /proc", "proc", f"{r}/proc", "proc", _RO | linux.MS_NOEXEC)
    for name in facts["proc_files"]:
        mount(f"mask /proc/{name}", f"{r}/dev/null", f"{r}/proc/{name}", None, linux.MS_BIND)
    for name in facts["proc_dirs"]:
        mount(f"mask /proc/{name}", "masked", f"{r}/proc/{name}", "tmpfs", _RO, "size=4k,mode=0555")

    for name, size, mode in (("tmp", tmp_size_mb, "1777"), ("workspace", workspace_size_mb, "0755")):
        add(f"mkdir /{name}", os.mkdir, f"{r}/{name}", 0o755)
        mount(f"mount /{name}", name, f"{r}/{name}", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
              f"size={size}m,mode={mode}")

    add("set hostname", socket.sethostname, hostname)
    add("chdir to the new root", os.chdir, r)
    add("pivot_root", linux.pivot_root, ".", ".")
    add("detach the host root", linux.umount2, ".", linux.MNT_DETACH)
    add("chdir /", os.chdir, "/")
    mount("make / read-only", None, "/", None, linux.MS_REMOUNT | linux.MS_BIND | _RO)
    return tuple(steps)


# -- reports on the pipes between launcher, spawner and children -----------------------------
# Records: "P" pid (the spawner forked it), "R" (the init is about to exec), "X" the command's
# wait status (from its exec helper), "E" errno + message (a step failed). Each record is one
# write of less than PIPE_BUF bytes, so records from different writers never interleave.

_INT = struct.Struct("<i")
_ERR = struct.Struct("<iH")


def _error_record(err: int, message: str) -> bytes:
    data = message.encode(errors="replace")[:1000]
    return b"E" + _ERR.pack(err, len(data)) + data


def _report(fd: int, step: str, exc: BaseException) -> None:
    """A child's last words before os._exit."""
    if isinstance(exc, OSError) and exc.errno:
        where = f" {exc.filename}" if exc.filename else ""
        record = _error_record(exc.errno, f"{step}: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}{where}")
    else:
        record = _error_record(0, f"{step}: {type(exc).__name__}: {exc}")
    try:
        os.write(fd, record)
    except OSError:
        pass


@dataclass
class _Report:
    pid: int | None = None
    ready: bool = False
    status: int | None = None
    errors: tuple[tuple[int, str], ...] = ()

    @classmethod
    def parse(cls, data: bytes) -> _Report:
        report, errors_, i = cls(), [], 0
        while i < len(data):
            kind = data[i:i + 1]
            if kind == b"R":
                report.ready, i = True, i + 1
            elif kind in (b"P", b"X") and i + 1 + _INT.size <= len(data):
                (value,) = _INT.unpack_from(data, i + 1)
                if kind == b"P":
                    report.pid = value
                else:
                    report.status = value
                i += 1 + _INT.size
            elif kind == b"E" and i + 1 + _ERR.size <= len(data):
                err, length = _ERR.unpack_from(data, i + 1)
                start = i + 1 + _ERR.size
                errors_.append((err, data[start:start + length].decode(errors="replace")))
                i = start + length
            else:
                errors_.append((0, f"garbled report {data[i:]!r}"))
                break
        report.errors = tuple(errors_)
        return report


# -- what the forked children do ----------------------------------------------------------------

def _join_cgroups(paths: list[str]) -> None:
    for path in paths:  # "0" is the writer itself, whatever pid namespace it is in
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _drop_privileges(last_cap: int) -> None:
    """Keep nothing of the spawner across exec but fds 0-2; no capabilities, no_new_privs."""
    linux.restore_signals()  # an empty mask (the spawner's may block some)
    linux.close_range_cloexec(3)
    os.umask(0o022)
    linux.drop_all_capabilities(last_cap)
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)


def _init_child(report: int, netns_fd: int, cgroup_procs: list[str], plan, last_cap: int) -> None:
    """B: pid 1 of the new pid namespace. Never returns."""
    step = "join cgroups"
    try:
        _join_cgroups(cgroup_procs)
        step = "enter netns"
        linux.setns(netns_fd, linux.CLONE_NEWNET)
        step = "unshare namespaces"
        linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWCGROUP)
        for item in plan:
            step = item.what
            item.call(*item.args)
        step = "stdio"
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        step = "drop privileges"
        _drop_privileges(last_cap)
        step = f"exec {CATATONIT}"
        if not os.access(CATATONIT, os.X_OK):
            raise FileNotFoundError(errno.ENOENT, "not executable in the sandbox", CATATONIT)
        # Ready now rather than at exec, which first tears down this copy of the spawner.
        os.write(report, b"R")
        os.close(report)
        os.execve(CATATONIT, ["catatonit", "-P"], {"PATH": DEFAULT_ENV["PATH"]})
    except BaseException as exc:
        _report(report, step, exc)
    os._exit(127)


_SPAWN_DEFAULT_SIGNALS = tuple(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})


def _exec_child(report: int, pidfd: int, root: int, cgroup_procs: list[str], cwd: str, stdio: list[int],
                argv: list[str], env: dict[str, str], last_cap: int) -> None:
    """C: enters the sandbox, vfork-spawns the command into its pid namespace, waits for it
    and writes its status. C stays outside the pid namespace, so the sandbox never sees it.
    SIGTERM (the spawner, on timeout or cancel) kills the command's process group. Never returns."""
    command, killed = 0, False

    def kill_command() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(command, signal.SIGKILL)  # not reaped yet, so the group is still its own

    def terminate(*_) -> None:
        nonlocal killed
        killed = True
        if command:
            kill_command()

    signal.signal(signal.SIGTERM, terminate)
    signal.set_wakeup_fd(-1)
    step = "close inherited fds"
    try:
        _close_all_but({report, pidfd, root, *stdio})  # C lives as long as the command: hold nothing else
        step = "join cgroups"
        _join_cgroups(cgroup_procs)
        step = "enter namespaces"
        linux.setns(pidfd, _ENTER_NS | linux.CLONE_NEWPID)
        step = "enter root"
        os.fchdir(root)
        os.chroot(".")
        step = "chdir " + cwd
        os.chdir(cwd)
        step = "drop privileges"
        _drop_privileges(last_cap)
        step = "spawn"
        path, code = _which(argv[0], env.get("PATH", ""))
        if killed:
            os._exit(1)
        if path is not None:
            try:
                command = os.posix_spawn(
                    path, argv, env, setsid=True, setsigdef=_SPAWN_DEFAULT_SIGNALS, setsigmask=(),
                    file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)],
                )
                if killed:  # SIGTERM arrived while spawning
                    kill_command()
            except OSError as exc:
                code = 127 if exc.errno in (errno.ENOENT, errno.ENOTDIR) else 126
                os.write(stdio[2], f"sandbox: {argv[0]}: {exc.strerror}\n".encode(errors="replace"))
        else:
            why = "command not found" if code == 127 else "Permission denied"
            os.write(stdio[2], f"sandbox: {argv[0]}: {why}\n".encode(errors="replace"))
        for fd in stdio:
            os.close(fd)
        status = os.waitpid(command, 0)[1] if command else code << 8
        os.write(report, b"X" + _INT.pack(status))
        os.close(report)
    except BaseException as exc:
        _report(report, step, exc)
        os._exit(1)
    os._exit(0)


def _close_all_but(keep: set[int]) -> None:
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 30)


def _which(name: str, search: str) -> tuple[str | None, int]:
    """The file execvp would run, else (None, 127 if nothing is there, 126 if not executable)."""
    if "/" in name:
        return name, 0
    code = 127
    for directory in search.split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate, 0
        if os.path.exists(candidate):
            code = 126
    return None, code


# -- the spawner process ------------------------------------------------------------------------

_HOST_PIDNS = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)


@contextlib.contextmanager
def _children_in_new_pidns():
    """Fork this thread's next child as pid 1 of a new pid namespace."""
    blocked = linux.block_all_signals()
    try:
        linux.unshare(linux.CLONE_NEWPID)
        try:
            yield
        finally:
            try:
                linux.setns(_HOST_PIDNS, linux.CLONE_NEWPID)
            except OSError:  # every later child would be born inside a sandbox
                os.write(2, b"sandfleet spawner: cannot leave a sandbox pid namespace\n")
                os.abort()
    finally:
        linux.restore_signals(blocked)


def _spawner_main(sock_fd: int) -> None:
    """Serve fork requests until the launcher closes its end; reap every child."""
    sock = socket.socket(fileno=sock_fd)
    linux.set_child_subreaper()  # a command whose exec helper died is reaped here, not leaked upward
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    last_cap = _host_facts()["last_cap"]
    reports: dict[int, int | None] = {}  # child pid -> report fd of an exec helper (tells if it dies silently)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == wake_r:
                os.read(wake_r, 4096)
                _reap_children(reports)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
            except OSError:
                message, fds = b"", []
            if not message:
                _finish(reports)
                os._exit(0)
            try:
                if message == _LARGE:  # the request itself is in the first fd (a memfd)
                    message, fds = _read_all(fds[0]), fds[1:] + fds[:1]
                _serve(marshal.loads(message), fds, reports, last_cap)
            except Exception as exc:  # a bad request must not take the other sandboxes' execs down
                os.write(2, f"sandfleet spawner: request failed: {exc!r}\n".encode())
                if fds:
                    _report(fds[0], "spawner", exc)
            finally:
                for f in fds:
                    os.close(f)


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _finish(reports: dict[int, int | None]) -> None:
    """The launcher is gone or stopped us: end the execs it can no longer read (they would be
    orphaned, unreaped, on a host whose PID 1 may not reap) and leave the sandboxes running."""
    helpers = {pid: fd for pid, fd in reports.items() if fd is not None}
    for pid in helpers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2
    while helpers and time.monotonic() < deadline:
        _reap_children(helpers)
        time.sleep(0.001)
    for pid in list(helpers):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    _reap_children({})


def _reap_children(reports: dict[int, int | None]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report = reports.pop(pid, None)
        if report is not None:
            if status != 0:  # C died without writing the command's status
                with contextlib.suppress(OSError):
                    os.write(report, _error_record(0, f"exec helper ended with wait status {status:#x}"))
            os.close(report)


def _serve(request: tuple, fds: list[int], reports: dict[int, int | None], last_cap: int) -> None:
    op, args = request
    if op == "ping":
        return
    if op == "kill":  # only a child not yet reaped: its pid cannot be anyone else's
        pid, sig = args
        if pid in reports:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return
    report = fds[0]
    try:
        if op == "start":
            plan = _rootfs_plan(*args[1:])
            with _children_in_new_pidns():
                pid = os.fork()
                if pid == 0:
                    _init_child(report, fds[1], args[0], plan, last_cap)
            reports[pid] = None
        else:
            pid = os.fork()
            if pid == 0:
                _exec_child(report, fds[1], fds[2], args[0], args[1], fds[3:6], args[2], args[3], last_cap)
            reports[pid] = os.dup(report)
        os.write(report, b"P" + _INT.pack(pid))
    except OSError as exc:
        _report(report, f"spawner {op}", exc)


_MAX_MESSAGE = 32 << 10
_LARGE = b"large"


class _Spawner:
    """The launcher's handle on its spawner process, started on first use and again if it died."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc = None
        atexit.register(self.stop)  # or the spawner outlives us as a zombie nobody reaps

    def send(self, request: tuple, fds: list[int]) -> None:
        message = marshal.dumps(request)
        big = -1
        if len(message) > _MAX_MESSAGE:  # argv and env may reach a few MB; a datagram may not
            big = os.memfd_create("sandfleet-request", os.MFD_CLOEXEC)
            os.write(big, message)
            message, fds = _LARGE, [big, *fds]
        try:
            with self.lock:
                for attempt in (0, 1):
                    if self.sock is None or self.proc.poll() is not None:
                        self._start()
                    try:
                        socket.send_fds(self.sock, [message], fds)
                        return
                    except (BrokenPipeError, ConnectionResetError):  # it died: start another
                        self._stop()
                        if attempt:
                            raise
        finally:
            if big >= 0:
                os.close(big)

    def _start(self) -> None:
        import subprocess

        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (f"import sys; sys.path.insert(0, {root!r}); "
                "from sandfleet.kernel.process import _spawner_main; _spawner_main(int(sys.argv[1]))")
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-I", "-c", code, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                cwd="/", stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.sock = ours

    def _stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2)
            except Exception:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        with self.lock:
            self._stop()


_spawner = _Spawner()


def warm_up() -> None:
    """Start the spawner now instead of on the first start or exec (it takes ~50 ms)."""
    _spawner.send(("ping", None), [])


def shutdown() -> None:
    """Stop the spawner (running sandboxes are not touched); the next call starts a new one."""
    _spawner.stop()


# -- start ----------------------------------------------------------------------------------------

def start(spec: ProcessSpec) -> InitProcess:
    """Start the sandbox's init; returns once it is about to exec catatonit (a few ms)."""
    if not _SANDBOX_ID.match(spec.sandbox_id):
        raise RuntimeStartError(f"invalid sandbox id {spec.sandbox_id!r}")
    if not re.match(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$", spec.hostname):
        raise RuntimeStartError(f"invalid hostname {spec.hostname!r}")
    if spec.tmp_size_mb < 1 or spec.workspace_size_mb < 1:
        raise RuntimeStartError("tmp_size_mb and workspace_size_mb must be at least 1 (0 means unlimited to tmpfs)")
    _rootfs_plan(spec.tmp_size_mb, spec.workspace_size_mb, spec.hostname)  # fail here, not in the child
    try:
        netns_fd = os.open(spec.netns, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: open netns {spec.netns}: {exc.strerror}") from None
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        request = ("start", (list(spec.cgroup_procs), spec.tmp_size_mb, spec.workspace_size_mb, spec.hostname))
        _spawner.send(request, [report_w, netns_fd])
    except BaseException as exc:
        os.close(report_r)
        if isinstance(exc, OSError):
            raise RuntimeStartError(f"sandbox {spec.sandbox_id}: cannot reach the spawner: {exc}") from exc
        raise
    finally:
        os.close(report_w)
        os.close(netns_fd)
    try:
        report = _read_start_report(report_r, START_TIMEOUT_S)
    finally:
        os.close(report_r)
    if report.errors or not report.ready:
        if report.pid is not None and not report.errors:  # hung: a failed init exits by itself
            with contextlib.suppress(OSError):
                _spawner.send(("kill", (report.pid, int(signal.SIGKILL))), [])
        why = "; ".join(m for _, m in report.errors) or "init died without a report"
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: {why}")
    info = _read_stat(report.pid)
    if info is None:
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: init vanished")
    return InitProcess(pid=report.pid, start_time=info[2])


def _read_start_report(fd: int, timeout_s: float) -> _Report:
    data, deadline = b"", time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        report = _Report.parse(data)
        if report.pid is not None and (report.ready or report.errors):
            return report
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            report.errors += ((0, f"init not ready within {timeout_s} s"),)
            return report
        chunk = os.read(fd, 65536)
        if not chunk:
            return report
        data += chunk


# -- liveness and kill ------------------------------------------------------------------------------

def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start_time) of a pid, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


def is_alive(init: InitProcess) -> bool:
    info = _read_stat(init.pid)
    return info is not None and info[2] == init.start_time and info[0] not in ("Z", "X")


def kill(init: InitProcess, timeout_s: float = 2.0) -> None:
    """SIGKILL the init, which ends its pid namespace, and wait until it has ended."""
    try:
        pidfd = os.pidfd_open(init.pid)
    except ProcessLookupError:
        return
    try:
        info = _read_stat(init.pid)  # read after pidfd_open: a match proves the pidfd is the init
        if info is None or info[2] != init.start_time:
            return
        if info[0] not in ("Z", "X"):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            select.select([pidfd], [], [], timeout_s)
        if info[1] == os.getpid():  # ours only if the spawner that started it died
            with contextlib.suppress(ChildProcessError):
                os.waitpid(init.pid, os.WNOHANG)
    finally:
        os.close(pidfd)


def _open_init(init: InitProcess) -> tuple[int, int]:
    """(pidfd, root directory fd) of a live init; ExecError if it is gone or was replaced."""
    try:
        pidfd = os.pidfd_open(init.pid)
    except ProcessLookupError:
        raise ExecError(f"sandbox init {init.pid} is not running") from None
    try:
        root = os.open(f"/proc/{init.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        os.close(pidfd)
        raise ExecError(f"sandbox init {init.pid} is not running") from None
    if not is_alive(init):  # checked after opening both: they belong to this init
        os.close(pidfd)
        os.close(root)
        raise ExecError(f"sandbox init {init.pid} is not running")
    return pidfd, root


# -- exec -------------------------------------------------------------------------------------------

async def exec(
    init: InitProcess,
    argv: list[str],
    *,
    cgroup_procs: list[str],
    env: dict[str, str] | None = None,
    cwd: str = "/workspace",
    stdin: bytes = b"",
    timeout_s: float = 60.0,
    max_output: int = 1 << 20,
) -> ExecResult:
    """Run argv in the sandbox in a new session. A missing cwd raises FileNotFoundError (or
    NotADirectoryError); a command that cannot be found exits 127, one that cannot run 126."""
    import asyncio

    if not argv or not argv[0]:
        raise ValueError("argv is empty")
    full_env = {**DEFAULT_ENV, **(env or {})}
    if any("\0" in t for t in (*argv, *full_env, *full_env.values(), cwd)):
        raise ValueError("argv, env and cwd must not contain NUL bytes")
    if any(not k or "=" in k for k in full_env):
        raise ValueError("environment variable names must be non-empty and contain no '='")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pidfd, root = _open_init(init)
    fds = [pidfd, root]
    try:
        for _ in range(4):
            fds += os.pipe2(os.O_CLOEXEC)
        _, _, report_r, report_w, in_r, in_w, out_r, out_w, err_r, err_w = fds
        request = ("exec", (list(cgroup_procs), cwd, list(argv), full_env))
        _spawner.send(request, [report_w, pidfd, root, in_r, out_w, err_w])
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, OSError):
            raise ExecError(f"cannot reach the spawner: {exc}") from exc
        raise
    for fd in (pidfd, root, report_w, in_r, out_w, err_w):
        os.close(fd)
    run = _Run(loop, report_r, out_r, err_r, in_w, stdin, max_output)
    try:
        return await run.result(deadline)
    finally:
        run.close()


class _Run:
    """The launcher's side of one exec: its pipes, driven by the event loop."""

    def __init__(self, loop, report_r: int, out_r: int, err_r: int, in_w: int, stdin: bytes,
                 max_output: int) -> None:
        self.loop, self.report_r, self.max_output = loop, report_r, max_output
        self.report, self.out, self.err = bytearray(), bytearray(), bytearray()
        self.buffers = {report_r: self.report, out_r: self.out, err_r: self.err}
        self.eof = {fd: loop.create_future() for fd in self.buffers}
        self.truncated = False
        self.killed = self.kill_pending = False
        for fd in self.buffers:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)
        self.stdin, self.in_w = memoryview(stdin), in_w
        if stdin:
            os.set_blocking(in_w, False)
            self._writable()
        else:
            self._close_stdin()

    def _readable(self, fd: int) -> None:
        buf = self.buffers[fd]
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._close_reader(fd)
                return
            if fd != self.report_r and len(buf) + len(chunk) > self.max_output:
                chunk = chunk[: max(0, self.max_output - len(buf))]
                self.truncated = True
            buf += chunk
            if fd == self.report_r:
                report = _Report.parse(bytes(buf))
                if self.kill_pending and report.pid is not None:
                    self.kill()
                if report.status is not None or report.errors:
                    self._close_reader(fd)  # settled: no need to wait for the helper's teardown
                    return

    def _close_reader(self, fd: int) -> None:
        if not self.eof[fd].done():
            self.loop.remove_reader(fd)
            os.close(fd)
            self.eof[fd].set_result(None)

    def _writable(self) -> None:
        try:
            while self.stdin:
                self.stdin = self.stdin[os.write(self.in_w, self.stdin[:65536]):]
        except BlockingIOError:
            self.loop.add_writer(self.in_w, self._writable)
            return
        except OSError:  # the command closed its stdin or exited
            pass
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.in_w >= 0:
            self.loop.remove_writer(self.in_w)
            os.close(self.in_w)
            self.in_w = -1

    def kill(self) -> None:
        """Ask the spawner to kill the command's process group (it knows whether it is reaped);
        if the helper's pid has not arrived yet, as soon as it does."""
        pid = _Report.parse(bytes(self.report)).pid
        self.kill_pending = pid is None
        if pid is not None and not self.killed:
            self.killed = True
            with contextlib.suppress(OSError):
                _spawner.send(("kill", (pid, int(signal.SIGTERM))), [])

    async def result(self, deadline: float) -> ExecResult:
        import asyncio

        done = self.eof[self.report_r]  # a status or an error arrived, or every writer closed the pipe
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(done), max(0.0, deadline - self.loop.time()))
        except TimeoutError:
            timed_out = True
            self.kill()
            await done
        report = _Report.parse(bytes(self.report))
        if timed_out and report.status is None:
            report.status = signal.SIGKILL  # killed before the command started
        elif report.status is None:
            err, message = report.errors[0] if report.errors else (0, "the spawner ended before the command")
            if message.startswith("chdir ") and err:
                raise OSError(err, message)
            raise ExecError(message)
        # Output still open belongs to background processes of the command: a short grace.
        pending = [f for f in self.eof.values() if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=OUTPUT_GRACE_S)
        code = os.waitstatus_to_exitcode(report.status)
        return ExecResult(exit_code=128 - code if code < 0 else code, stdout=bytes(self.out),
                          stderr=bytes(self.err), timed_out=timed_out, truncated=self.truncated)

    def close(self) -> None:
        if not self.eof[self.report_r].done():
            self.kill()  # cancelled while running: the command must not outlive its exec
        for fd in list(self.eof):
            if not (fd == self.report_r and self.kill_pending):  # else read on until the pid comes
                self._close_reader(fd)
        self._close_stdin()


# -- files ----------------------------------------------------------------------------------

_RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS


def _sandbox_path(path: str) -> str:
    if "\0" in path:
        raise ValueError("path contains a NUL byte")
    return path if path.startswith("/") else "/workspace/" + path


def _open_in_sandbox(init: InitProcess, path: str, flags: int, mode: int = 0) -> int:
    try:
        root = os.open(f"/proc/{init.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running") from None
    try:
        if not is_alive(init):
            raise ProcessLookupError(errno.ESRCH, f"sandbox init {init.pid} is not running")
        for _ in range(16):
            try:
                return linux.openat2(root, path, flags | os.O_CLOEXEC | os.O_NOCTTY, mode, _RESOLVE)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:  # a rename raced the resolution; resolve again
                    continue
                if exc.errno in (errno.EROFS, errno.EPERM, errno.EACCES):
                    raise PermissionError(exc.errno, exc.strerror, path) from None
                raise OSError(exc.errno, exc.strerror, path) from None
        raise OSError(errno.EAGAIN, "path kept changing while being resolved", path)
    finally:
        os.close(root)


def read_file(init: InitProcess, path: str, max_bytes: int) -> bytes:
    """A regular file of the sandbox; ValueError if it is larger than max_bytes or not regular.
    Relative paths are relative to /workspace."""
    path = _sandbox_path(path)
    fd = _open_in_sandbox(init, path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path} is {st.st_size} bytes, over the limit of {max_bytes}")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ValueError(f"{path} is over the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_file(init: InitProcess, path: str, data: bytes, mode: int = 0o644) -> int:
    """Create or replace a regular file of the sandbox (its directory must exist); returns
    the bytes written. Read-only places raise PermissionError."""
    path = _sandbox_path(path)
    fd = _open_in_sandbox(init, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode & 0o7777)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode & 0o7777)
        return len(data)
    finally:
        os.close(fd)

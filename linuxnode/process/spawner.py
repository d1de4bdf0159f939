"""The spawner: a small helper interpreter, started on first use, that forks every sandbox
process (see the package docstring for why), reaps them and is a subreaper for the rest;
and the launcher's handle on it, which sends it requests over a SOCK_SEQPACKET socket.

Requests are the typed messages of protocol.py. The helper runs `python -S -I`: it has no
site-packages, so nothing this package imports may need more than the standard library and
linuxnode.syscalls.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time

from linuxnode import layered_root, roots_ns, userns
from linuxnode import syscalls as linux
from linuxnode.process import children, protocol, rootfs
from linuxnode.process.protocol import Ping, Request, Signal, StartInit, StartInitOnRoot
from linuxnode.process.reports import error_record, pid_record, report_failure

_HOST_PIDNS = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
_MAX_MESSAGE = 32 << 10
_LARGE = b"large"  # this datagram's first fd is a memfd holding the request


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


def _own_mount_namespace() -> None:
    """Live in a private copy of the host's mount namespace without the sandbox mounts the host
    held when it was made (other nodes' roots, every network namespace's name): each init's
    unshare copies this table, so it stays the size it was whatever the host gains later
    (roots are composed in the node's roots namespace: linuxnode.roots_ns)."""
    try:
        linux.unshare(linux.CLONE_NEWNS)  # the spawner is one thread: the process moves
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
        roots_ns.prune_copied_sandbox_mounts()
    except OSError as exc:  # inits then copy the host's table, as before
        os.write(2, f"sandfleet spawner: no mount namespace of its own: {exc}\n".encode())


def main(sock_fd: int, seccomp: bytes = b"") -> None:
    """Serve fork requests until the launcher closes its end; reap every child. `seccomp` is
    the filter every child installs before exec (built by the launcher: no libseccomp here)."""
    sock = socket.socket(fileno=sock_fd)
    _own_mount_namespace()
    linux.set_child_subreaper()  # a command whose exec helper died is reaped here, not leaked upward
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    last_cap = rootfs.host_facts()["last_cap"]
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
            passed = fds  # the request's own, after a memfd that held the request itself
            try:
                if message == _LARGE:
                    message, passed = _read_all(fds[0]), fds[1:]
                _serve(protocol.decode(message, passed), reports, last_cap, seccomp)
            except Exception as exc:  # a bad request must not take the other sandboxes' execs down
                os.write(2, f"sandfleet spawner: request failed: {exc!r}\n".encode())
                if passed:  # a request's report pipe is its first fd (protocol.py)
                    report_failure(passed[0], "spawner", exc)
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
                    os.write(report, error_record(0, f"exec helper ended with wait status {status:#x}"))
            os.close(report)


_USER_NAMESPACES: dict[int, int] = {}  # id_host -> fd of a user namespace mapping it


def _user_namespace(id_host: int) -> int:
    """The user namespace every sandbox mapping root to `id_host` joins, made on first use and
    kept for the spawner's life. One namespace serves many sandboxes safely: it owns none of
    their other namespaces and they hold no capability in it, so it is only the mapping."""
    fd = _USER_NAMESPACES.get(id_host)
    if fd is None:
        fd = _USER_NAMESPACES[id_host] = userns.make(userns.IdRange(id_host))
    return fd


def _serve(request: Request, reports: dict[int, int | None], last_cap: int, seccomp: bytes) -> None:
    if isinstance(request, Ping):
        return
    if isinstance(request, Signal):  # only a child not yet reaped: its pid cannot be anyone else's
        if request.pid in reports:
            with contextlib.suppress(ProcessLookupError):
                os.kill(request.pid, request.signal)
        return
    try:
        if isinstance(request, StartInit):
            plan = (layered_root.plan(request.root_tree, request.tmp_size_mb, request.hostname, rootfs.STAGE,
                                      request.id_host)
                    if isinstance(request, StartInitOnRoot)
                    else rootfs.plan(request.tmp_size_mb, request.workspace_size_mb, request.hostname, request.id_host))
            user = _user_namespace(request.id_host) if request.id_host else -1
            with _children_in_new_pidns():
                pid = os.fork()
                if pid == 0:
                    children.init_child(request, plan, last_cap, seccomp, user)
            reports[pid] = None
        else:  # ExecCommand
            pid = os.fork()
            if pid == 0:
                children.exec_child(request, last_cap, seccomp)
            reports[pid] = os.dup(request.report)
        os.write(request.report, pid_record(pid))
    except OSError as exc:
        report_failure(request.report, f"spawner {request.TYPE}", exc)


class Spawner:
    """The launcher's handle on its spawner process, started on first use and again if it died."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc = None
        atexit.register(self.stop)  # or the spawner outlives us as a zombie nobody reaps

    def send(self, request: Request) -> None:
        self.send_datagram(*protocol.encode(request))

    def send_datagram(self, message: bytes, fds: list[int]) -> None:
        """Send one encoded request (the tests send malformed ones through it)."""
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

        from linuxnode import seccomp

        self._stop()
        filter_hex = seccomp.filter_bytes().hex()  # built once per launcher; ~18 kB of argv, once
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the directory holding linuxnode/: -I leaves it off the helper's path
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (f"import sys; sys.path.insert(0, {root!r}); "
                "from linuxnode.process.spawner import main; main(int(sys.argv[1]), bytes.fromhex(sys.argv[2]))")
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-I", "-c", code, str(theirs.fileno()), filter_hex], pass_fds=[theirs.fileno()],
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


handle = Spawner()


def send(request: Request) -> None:
    """One request to the spawner, its fds passed beside it (they stay the caller's to close);
    OSError if it cannot be reached."""
    handle.send(request)


def warm_up() -> None:
    """Start the spawner now instead of on the first start or exec (it takes ~50 ms)."""
    handle.send(Ping())


def shutdown() -> None:
    """Stop the spawner (running sandboxes are not touched); the next call starts a new one."""
    handle.stop()

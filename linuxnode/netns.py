"""Named network namespaces, one per sandbox, bind-mounted at /run/netns/sf-<node id>.<sandbox id>.

They are made the way iproute2 makes them, so `ip netns list` shows every one (a leak is
visible) and `ip netns exec` works on them. No process is forked: the calling thread
unshares a fresh network namespace for itself, brings its loopback up, bind-mounts its
own namespace file onto the name and switches back, with signals blocked so nothing can
interrupt it between the switch and the switch back. A namespace lives as long as the
bind mount or a process inside holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Callable, Iterator

from linuxnode import names
from linuxnode import syscalls as linux

RUN_DIR = "/run/netns"
PREFIX = "sf-"

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")
_MS_SHARED = 1 << 20
_run_dir_ready = False


def _mount(source: str, target: str, flags: int) -> None:
    linux.mount(source, target, "none", flags)


def _prefix(node_id: str) -> str:
    # The node is in the name so several nodes (or platforms) on one host never reclaim
    # each other's namespaces; '.' appears in neither a node id nor a sandbox id.
    if not names.is_node_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"{PREFIX}{node_id}."


def path(node_id: str, sandbox_id: str) -> str:
    if not names.is_sandbox_id(sandbox_id):
        raise ValueError(f"invalid sandbox id {sandbox_id!r}")
    return f"{RUN_DIR}/{_prefix(node_id)}{sandbox_id}"


def ensure_run_dir() -> None:
    """Make /run/netns a shared mount point of itself, as `ip netns add` does."""
    global _run_dir_ready
    if _run_dir_ready:
        return
    os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
    try:
        _mount("", RUN_DIR, _MS_SHARED | linux.MS_REC)
    except OSError as exc:
        if exc.errno != 22:  # EINVAL: not a mount point yet
            raise
        _mount(RUN_DIR, RUN_DIR, linux.MS_BIND | linux.MS_REC)
        _mount("", RUN_DIR, _MS_SHARED | linux.MS_REC)
    _run_dir_ready = True


_ensure_run_dir = ensure_run_dir  # the name tests/test_kernel_runtime.py calls it by


def _is_netns(file: str) -> bool:
    """True if file is a mounted namespace (nsfs inodes share one device)."""
    try:
        return os.stat(file).st_dev == os.stat("/proc/thread-self/ns/net").st_dev
    except FileNotFoundError:
        return False


def create(node_id: str, sandbox_id: str) -> str:
    """Create the sandbox's network namespace with loopback up; returns its path. Idempotent."""
    global _run_dir_ready
    target = path(node_id, sandbox_id)
    if _is_netns(target):
        return target
    for attempt in (0, 1):
        ensure_run_dir()
        try:
            os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
            break
        except FileExistsError:
            break  # an empty file left by a crash between create and mount: mount over it
        except FileNotFoundError:
            if attempt:
                raise
            _run_dir_ready = False  # someone removed /run/netns since we made it
    try:
        _bind_new_netns(target)
    except BaseException:
        _unlink(target)
        raise
    return target


@contextlib.contextmanager
def _away(enter: Callable[[], None]) -> Iterator[None]:
    """Run the block in another network namespace (`enter` puts this thread in it) and come back
    to the host's, with signals blocked so no handler runs in between."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    blocked = linux.block_all_signals()
    try:
        enter()
        try:
            yield
        finally:
            try:
                linux.setns(home, linux.CLONE_NEWNET)
            except OSError:
                # This thread would keep working in the sandbox's namespace: never continue.
                os.write(2, b"sandfleet netns: cannot return to the host network namespace\n")
                os.abort()
    finally:
        linux.restore_signals(blocked)
        os.close(home)


def _bind_new_netns(target: str) -> None:
    with _away(lambda: linux.unshare(linux.CLONE_NEWNET)):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            ifreq = bytearray(_IFREQ.pack(b"lo", 0))
            fcntl.ioctl(sock, _SIOCGIFFLAGS, ifreq)
            _, flags = _IFREQ.unpack(ifreq)
            fcntl.ioctl(sock, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))
        _mount("/proc/thread-self/ns/net", target, linux.MS_BIND)


def _unlink(file: str) -> None:
    try:
        os.unlink(file)
    except FileNotFoundError:
        pass


def remove(node_id: str, sandbox_id: str) -> None:
    """Detach and delete the name; the namespace ends with its last process. Idempotent."""
    target = path(node_id, sandbox_id)
    while _is_netns(target):  # stacked mounts (two racing creates) each need an unmount
        try:
            linux.umount2(target, linux.MNT_DETACH)
        except OSError as exc:
            if exc.errno in (22, 2):  # EINVAL: not mounted, ENOENT: gone
                break
            raise
    _unlink(target)


def list_sandboxes(node_id: str) -> list[str]:
    """Ids of this node's sandbox namespace names on this host (for crash recovery)."""
    try:
        entries = os.listdir(RUN_DIR)
    except FileNotFoundError:
        return []
    prefix = _prefix(node_id)
    return sorted(n[len(prefix):] for n in entries if n.startswith(prefix) and names.is_sandbox_id(n[len(prefix):]))



def socket_inside(netns_path: str, family: int = socket.AF_INET) -> socket.socket:
    """A new, unconnected, non-blocking TCP socket of the network namespace at `netns_path`.

    The calling thread setns()es in, creates it and switches back (signals blocked, as in
    `_bind_new_netns`): a few microseconds, so an event loop's own thread may call it, which
    spares a worker-thread hop per connection. A socket keeps the namespace it was made in, so
    its connect and everything after reach that namespace's addresses, never the host's, while
    the thread goes on in the host's namespace."""
    target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sock = _socket_in(target, family)
    finally:
        os.close(target)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect_inside(netns_path: str, host: str, port: int, timeout_s: float = 5.0) -> socket.socket:
    """A TCP socket connected to host:port as seen from inside the network namespace at
    `netns_path` (blocking: for a worker thread); ConnectionRefusedError when nobody listens.
    The socket is returned non-blocking."""
    sock = socket_inside(netns_path, socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.settimeout(timeout_s)
        sock.connect((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _socket_in(target_fd: int, family: int) -> socket.socket:
    with _away(lambda: linux.setns(target_fd, linux.CLONE_NEWNET)):
        return socket.socket(family, socket.SOCK_STREAM)


_LISTEN = "0A"


def _hex_address(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words)


def listens(pid: int, host: str, port: int) -> bool:
    """Whether a TCP socket listens on host:port (or on the wildcard address) in the network
    namespace of process `pid`, read from its /proc/<pid>/net/tcp{,6}: nothing is connected, so
    a server that accepts one connection only is not spent by asking."""
    v6 = ":" in host
    wanted = {host, "::"} if v6 else {host, "0.0.0.0", "::", "::ffff:" + host}
    for table in ("tcp6",) if v6 else ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            if table == "tcp6":
                continue  # IPv6 compiled out
            raise ProcessLookupError(pid) from None
        for line in lines:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == _LISTEN and int(hex_port, 16) == port and _hex_address(address) in wanted:
                return True
    return False

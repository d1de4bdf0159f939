"""Named network namespaces, one per sandbox: sf-<node id>.<sandbox id>, held in the node's
holder, a mount namespace of its own, so the host's mount table does not grow by one mount a
sandbox (each new mount namespace on the host copies that table: a host `unshare -m` took
1.5 ms with none and 71 ms with 5,800 names on it).

The holder is pinned at /run/sandfleet/netns/<node id> (linuxnode.ns_pin) and has a tmpfs of
its own at /run/netns, where the names are bound, as iproute2 binds them: `nsenter
--mount=/run/sandfleet/netns/<node> ip netns list` lists a node's names (a leak is visible
there). It is made with the node's first name and unpinned with its last, so a node with no
sandbox leaves nothing. A name's path (`path()`, what the agent hands the launcher) is its path
inside the holder; `resolve()` turns it into one this process and its children open (through
a directory fd of the holder's /run/netns, /proc/<pid>/fd/<n>/<name>), and `open_ns()` opens it.
`SANDFLEET_NETNS=host` keeps the names on the host's own /run/netns instead (`ip netns list`
on the host shows them; every host mount namespace copies them).

No process is forked: a short thread enters the holder, unshares a fresh network namespace for
itself, brings its loopback up and bind-mounts its own namespace file onto the name. A
namespace lives as long as its name or a process inside holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator

from linuxnode import names, ns_pin
from linuxnode import syscalls as linux

RUN_DIR = "/run/netns"
HOLDER_DIR = "/run/sandfleet/netns"
PREFIX = "sf-"
MODE_ENV = "SANDFLEET_NETNS"  # "host": names on the host's /run/netns (the layout before the holder)

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")
_MS_SHARED = 1 << 20
_run_dir_ready = False
_lock = threading.Lock()  # the holders' views below, and a holder made or unpinned beside a name
_views: dict[str, tuple[int, int]] = {}  # node id -> (an fd of its holder, O_PATH fd of the holder's /run/netns)


def _mount(source: str, target: str, flags: int) -> None:
    linux.mount(source, target, "none", flags)


def _prefix(node_id: str) -> str:
    # The node is in the name so several nodes (or platforms) on one host never reclaim
    # each other's namespaces; '.' appears in neither a node id nor a sandbox id.
    if not names.is_node_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"{PREFIX}{node_id}."


def path(node_id: str, sandbox_id: str) -> str:
    """The name's path where it is bound: inside the holder (on the host with SANDFLEET_NETNS=host)."""
    if not names.is_sandbox_id(sandbox_id):
        raise ValueError(f"invalid sandbox id {sandbox_id!r}")
    return f"{RUN_DIR}/{_prefix(node_id)}{sandbox_id}"


def holder_pin(node_id: str) -> str:
    if not names.is_node_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"{HOLDER_DIR}/{node_id}"


def on_host() -> bool:
    """Names on the host's /run/netns (SANDFLEET_NETNS=host) rather than in a holder."""
    return os.environ.get(MODE_ENV, "") == "host"


def ensure_run_dir() -> None:
    """Make the host's /run/netns a shared mount point of itself, as `ip netns add` does."""
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


def _new_holder() -> int:
    """A new holder (an fd of it): a copy of the host's mount namespace whose /run/netns is a
    tmpfs of its own, so nothing bound on the host's /run/netns comes in and nothing bound here
    goes out."""
    ensure_run_dir()  # a mount point of the host's before the copy, made private in it: else names propagate in
    fd = ns_pin.new_namespace((RUN_DIR,), "netns-holder")

    def own_tmpfs() -> None:
        ns_pin.enter(fd)
        linux.mount("sandfleet-netns", RUN_DIR, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC,
                    "mode=0755,size=1m")
        linux.mount(None, RUN_DIR, None, linux.MS_PRIVATE)

    try:
        linux.on_own_thread(own_tmpfs, "netns-holder")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(node_id: str, make: bool) -> int | None:
    """An fd of the node's holder: the pinned one, a new one pinned now if `make`, else None."""
    pin = holder_pin(node_id)
    fd = ns_pin.open_pinned(pin)
    if fd is None and make:
        fd = _new_holder()
        try:
            ns_pin.pin(pin, fd)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _open_names_dir(ns_fd: int) -> int:
    def inside() -> int:
        ns_pin.enter(ns_fd)
        return os.open(RUN_DIR, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    return linux.on_own_thread(inside, "netns-holder")


def _names_dir(node_id: str, make: bool = False) -> int | None:
    """This process's O_PATH fd of the holder's /run/netns, None if none is pinned (and not
    `make`). Kept per node; a holder pinned again (unpinned with its last name, made anew) is
    followed: the pin's nsfs inode is the one of the holder we keep an fd of only while it is
    that namespace (a namespace's inode number is reused once it ends, so we keep it from
    ending: an unpinned one, empty, lasts here until the next look). Call with _lock held."""
    try:
        ino = os.stat(holder_pin(node_id)).st_ino
    except FileNotFoundError:
        ino = 0
    cached = _views.get(node_id)
    if cached is not None and os.fstat(cached[0]).st_ino == ino:
        return cached[1]
    if cached is not None:
        del _views[node_id]
        os.close(cached[0])
        os.close(cached[1])
    ns_fd = _holder(node_id, make)
    if ns_fd is None:
        return None
    try:
        _views[node_id] = (ns_fd, _open_names_dir(ns_fd))
    except BaseException:
        os.close(ns_fd)
        raise
    return _views[node_id][1]


def resolve(netns_path: str) -> str:
    """A path of the name at `netns_path` (from `path()`) that opens from this process and its
    children while this process lives (what crun's config, nsenter and setns take). A path that
    is no name of a holder's is returned as it is."""
    name = netns_path[len(RUN_DIR) + 1:] if netns_path.startswith(RUN_DIR + "/") else ""
    node = name[len(PREFIX):].partition(".")[0] if name.startswith(PREFIX) else ""
    if on_host() or not names.is_node_id(node):
        return netns_path
    with _lock:
        names_dir = _names_dir(node)
    if names_dir is None:
        return netns_path  # no holder: a name of the host's (an older version's), if any
    local = f"/proc/{os.getpid()}/fd/{names_dir}/{name}"
    return local if os.path.lexists(local) or not os.path.lexists(netns_path) else netns_path


def open_ns(netns_path: str) -> int:
    """An fd of the network namespace named `netns_path` (from `path()`)."""
    return os.open(resolve(netns_path), os.O_RDONLY | os.O_CLOEXEC)


def exists(node_id: str, sandbox_id: str) -> bool:
    """Whether the sandbox's name holds a network namespace (in the holder or on the host)."""
    return _is_netns(resolve(path(node_id, sandbox_id)))


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = bytearray(_IFREQ.pack(b"lo", 0))
        fcntl.ioctl(sock, _SIOCGIFFLAGS, ifreq)
        _, flags = _IFREQ.unpack(ifreq)
        fcntl.ioctl(sock, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


def _bind_new(holder_fd: int, target: str) -> None:
    """On a short thread of its own (in the holder first, if given): a new network namespace
    with loopback up, bound at `target`. Idempotent."""
    def run() -> None:
        if holder_fd >= 0:
            ns_pin.enter(holder_fd)
        if _is_netns(target):
            return
        try:
            os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
        except FileExistsError:
            pass  # an empty file left by a crash between create and mount: mount over it
        try:
            linux.unshare(linux.CLONE_NEWNET)  # this thread only; it ends here
            _loopback_up()
            _mount("/proc/thread-self/ns/net", target, linux.MS_BIND)
        except BaseException:
            _unlink(target)
            raise

    linux.on_own_thread(run, "netns-create")


def create(node_id: str, sandbox_id: str) -> str:
    """Create the sandbox's network namespace with loopback up; returns its path. Idempotent."""
    global _run_dir_ready
    target = path(node_id, sandbox_id)
    if on_host():
        for attempt in (0, 1):
            ensure_run_dir()
            try:
                _bind_new(-1, target)
                break
            except FileNotFoundError:
                if attempt:
                    raise
                _run_dir_ready = False  # someone removed /run/netns since we made it
        return target
    with _lock:
        _names_dir(node_id, make=True)
        _bind_new(_views[node_id][0], target)
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


def _unlink(file: str) -> None:
    try:
        os.unlink(file)
    except FileNotFoundError:
        pass


def _unbind(target: str) -> None:
    while _is_netns(target):  # stacked mounts (two racing creates) each need an unmount
        try:
            linux.umount2(target, linux.MNT_DETACH)
        except OSError as exc:
            if exc.errno in (22, 2):  # EINVAL: not mounted, ENOENT: gone
                break
            raise
    _unlink(target)


def _unbind_in(holder_fd: int, target: str) -> bool:
    """Unbind `target` in the holder; whether the holder has no name left."""
    def run() -> bool:
        ns_pin.enter(holder_fd)
        _unbind(target)
        with os.scandir(RUN_DIR) as entries:
            return next(entries, None) is None  # the first entry only: a full listing grows with the node

    return linux.on_own_thread(run, "netns-remove")


def remove(node_id: str, sandbox_id: str) -> None:
    """Detach and delete the name; the namespace ends with its last process. The holder is
    unpinned with its last name. Idempotent."""
    target = path(node_id, sandbox_id)
    if os.path.lexists(target):
        _unbind(target)  # on the host's /run/netns: SANDFLEET_NETNS=host, or an older version's
    if on_host():
        return
    with _lock:
        if _names_dir(node_id) is None:
            return
        if _unbind_in(_views[node_id][0], target):
            ns_pin.unpin(holder_pin(node_id))
            _names_dir(node_id)  # lets go of the one unpinned


def _own(node_id: str, entries: list[str]) -> list[str]:
    prefix = _prefix(node_id)
    return [n[len(prefix):] for n in entries if n.startswith(prefix) and names.is_sandbox_id(n[len(prefix):])]


def list_sandboxes(node_id: str) -> list[str]:
    """Ids of this node's sandbox namespace names, in its holder and on the host's /run/netns
    (for crash recovery and leak checks)."""
    try:
        found = _own(node_id, os.listdir(RUN_DIR))
    except FileNotFoundError:
        found = []
    if not on_host():
        with _lock:
            names_dir = _names_dir(node_id)
        if names_dir is not None:
            found += _own(node_id, os.listdir(f"/proc/self/fd/{names_dir}"))
    return sorted(set(found))


def holders() -> list[str]:
    """Node ids with a holder pinned on this host."""
    return ns_pin.pinned(HOLDER_DIR)


def socket_inside(netns_path: str, family: int = socket.AF_INET) -> socket.socket:
    """A new, unconnected, non-blocking TCP socket of the network namespace at `netns_path`.

    The calling thread setns()es in, creates it and switches back (signals blocked): a few microseconds, so an event loop's own thread may call it, which
    spares a worker-thread hop per connection. A socket keeps the namespace it was made in, so
    its connect and everything after reach that namespace's addresses, never the host's, while
    the thread goes on in the host's namespace."""
    target = open_ns(netns_path)
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

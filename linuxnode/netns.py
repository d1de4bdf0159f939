"""Named network namespaces, one per sandbox: sf-<node id>.<sandbox id>, bound in the node's
holder (linuxnode.netns_holder), a mount namespace of its own, so the host's mount table does
not grow by one mount a sandbox (each new mount namespace on the host copies that table: a host
`unshare -m` took 1.5 ms with none and 71 ms with 5,800 names on it).

Inside the holder the names are where iproute2 keeps them: `nsenter
--mount=/run/sandfleet/netns/<node> ip netns list` lists a node's names (a leak is visible
there). A name's path (`path()`, what the agent hands the launcher) is its path inside the
holder; `resolve()` turns it into one this process and its children open, `open_ns()` opens
it. The holder is made with the node's first name; the node agent keeps it (`keep_holder`) for
the node's life and unpins it at a clean stop with no name left (`release_holder`); for anyone
else (tests, benchmarks) it is unpinned with the last name. `SANDFLEET_NETNS=host` binds the
names on the host's own /run/netns instead, as before (`ip netns list` on the host shows them;
every host mount namespace copies them). Names an older version left there are listed and
removed either way.

No process is forked: a thread unshares a fresh network namespace for itself, brings its
loopback up, bind-mounts its own namespace file onto the name and switches back, with signals
blocked so nothing can interrupt it between the switch and the switch back. A namespace lives
as long as its name or a process inside holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator

from linuxnode import names, netns_holder, ns_pin
from linuxnode import syscalls as linux
from linuxnode.netns_holder import RUN_DIR

HOLDER_DIR = netns_holder.PIN_DIR
PREFIX = "sf-"
MODE_ENV = "SANDFLEET_NETNS"  # "host": names on the host's /run/netns (the layout before the holder)

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")
_lock = threading.Lock()  # the views below; a holder made or unpinned beside a name bound in it
_views: dict[str, netns_holder.HolderView] = {}  # this process's, by node id
_kept: set[str] = set()  # nodes whose holder this process keeps with no name in it (the agent)


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


holder_pin = netns_holder.pin_path
holders = netns_holder.pinned_nodes
ensure_run_dir = netns_holder.ensure_host_run_dir
_ensure_run_dir = ensure_run_dir  # the name tests/test_kernel_runtime.py calls it by


def on_host() -> bool:
    """Names on the host's /run/netns (SANDFLEET_NETNS=host) rather than in a holder."""
    return os.environ.get(MODE_ENV, "") == "host"


def keep_holder(node_id: str) -> None:
    """Keep the node's holder pinned when its last name goes (the node agent, for the node's
    life: a holder is not made anew for each sandbox of a node that runs one at a time)."""
    _kept.add(node_id)


def release_holder(node_id: str) -> bool:
    """Unpin the node's holder if no name is left in it (the agent's clean stop); whether none
    is pinned now."""
    _kept.discard(node_id)
    with _lock:
        view = netns_holder.look(node_id, _views)
        if view is not None and view.empty():
            ns_pin.unpin(holder_pin(node_id))
            netns_holder.look(node_id, _views)  # lets go of the one unpinned
    return node_id not in holders()


def _is_netns(file: str) -> bool:
    """True if file is a mounted namespace (nsfs inodes share one device)."""
    try:
        return os.stat(file).st_dev == os.stat("/proc/thread-self/ns/net").st_dev
    except FileNotFoundError:
        return False


def resolve(netns_path: str) -> str:
    """A path of the name at `netns_path` (from `path()`) that opens from this process and its
    children while this process lives (what crun's config, nsenter and setns take). A path that
    is no name of a holder's is returned as it is."""
    name = netns_path[len(RUN_DIR) + 1:] if netns_path.startswith(RUN_DIR + "/") else ""
    node = name[len(PREFIX):].partition(".")[0] if name.startswith(PREFIX) else ""
    if on_host() or not names.is_node_id(node):
        return netns_path
    with _lock:
        view = netns_holder.look(node, _views)
    if view is None:
        return netns_path  # no holder: a name of the host's (an older version's), if any
    local = view.local(name)
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


def _bind_new(target: str) -> None:
    """A new network namespace with loopback up, bound at `target` (in the calling thread's
    mount namespace). Idempotent."""
    if _is_netns(target):
        return
    try:
        os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
    except FileExistsError:
        pass  # an empty file left by a crash between create and mount: mount over it
    try:
        with _away(lambda: linux.unshare(linux.CLONE_NEWNET)):
            _loopback_up()
            linux.mount("/proc/thread-self/ns/net", target, "none", linux.MS_BIND)
    except BaseException:
        _unlink(target)
        raise


def create(node_id: str, sandbox_id: str) -> str:
    """Create the sandbox's network namespace with loopback up; returns its path. Idempotent."""
    target = path(node_id, sandbox_id)
    if on_host():
        for again in (False, True):
            ensure_run_dir(again)
            try:
                _bind_new(target)
                break
            except FileNotFoundError:
                if again:
                    raise  # else someone removed /run/netns since we made it
        return target
    with _lock:
        view = netns_holder.look(node_id, _views, make=True)
        assert view is not None
        made = view.submit(lambda: _bind_new(target))
    made.result()
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


def remove(node_id: str, sandbox_id: str) -> None:
    """Detach and delete the name; the namespace ends with its last process. The holder is
    unpinned with its last name unless kept (`keep_holder`). Idempotent."""
    target = path(node_id, sandbox_id)
    if os.path.lexists(target):
        _unbind(target)  # on the host's /run/netns: SANDFLEET_NETNS=host, or an older version's
    if on_host():
        return
    with _lock:
        view = netns_holder.look(node_id, _views)
        if view is None:
            return
        view.submit(lambda: _unbind(target)).result()
        # Under the lock, after every name submitted before: one bound between the look and the
        # unpin would be lost with the holder.
        if node_id not in _kept and view.empty():
            ns_pin.unpin(holder_pin(node_id))
            netns_holder.look(node_id, _views)  # lets go of the one unpinned


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
            view = netns_holder.look(node_id, _views)
            if view is not None:
                found += _own(node_id, view.listing())
    return sorted(set(found))


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

"""The node's roots namespace: one mount namespace per node where every sandbox root is
composed (EROFS layers, overlays, upper-dir tmpfs, the lazy layers' FUSE mount), so the
host's mount table does not grow by a root's mounts however many sandboxes run (each
sandbox's network namespace name, linuxnode.netns, is still one mount of the host's).

Why: every new mount namespace starts as a copy of the one it is made from, and the kernel
copies (and later tears down) each mount. With each sandbox adding its mounts to the host's
table, each process init's unshare, each crun run and every other tool on the host that
unshares paid for every live sandbox (`unshare -m true`: 3 ms with 22 mounts, 45 ms with
8,000). Here the table that grows is one nobody copies: a root leaves it as a detached
clone (`clone()`, open_tree from a thread inside) that the runtime attaches in the
sandbox's own namespace.

It is pinned by a bind mount of its nsfs file at /run/sandfleet/roots/<node id> (made from
the host's namespace, which is older, so the kernel allows it; on a mount that does not
propagate, which a bind of a mount-namespace file needs), so it outlives the processes in
it: a restarted layer-cache enters the same namespace and finds its roots there. Its `/`
is a slave of the host's: mounts the host makes later (a new disk) are seen inside, nothing
made inside reaches the host. It starts as a copy of the host's table without the sandbox
mounts in it (other nodes' roots on the same host: a copy would keep them alive).

The layer-cache (and the FUSE daemon it starts, which inherits it) *lives* in it: `enter()`
at start, before it mounts anything, so its mount code and `/proc/self/mountinfo` read as
they always did. Everyone else looks in through a `RootsView`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import os
import threading

from linuxnode import mount_api, names, netns
from linuxnode import syscalls as linux

RUN_DIR = "/run/sandfleet/roots"
CLONE_FS = 0x200
MS_SLAVE = 1 << 19
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3)


class RootsNamespaceMissing(RuntimeError):
    """No roots namespace is pinned for the node (its layer-cache has not made one)."""


def pin_path(node_id: str) -> str:
    if not names.is_node_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"{RUN_DIR}/{node_id}"


def _open_ns(path: str) -> int | None:
    """An fd of the mount namespace pinned at `path`, or None if nothing (or something else) is there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if fcntl.ioctl(fd, NS_GET_NSTYPE) == linux.CLONE_NEWNS:
            return fd
    except OSError:
        pass  # an empty file (the mount point of a pin that is gone): not a namespace
    os.close(fd)
    return None


def open_pinned(node_id: str) -> int | None:
    """An fd of the node's roots namespace, or None if none is pinned."""
    return _open_ns(pin_path(node_id))


# What sandbox platforms mount on a host: layers, roots, upper-dir tmpfs, namespace names, lazy
# layers' FUSE files. A namespace copied from the host gets a copy of each, which would keep
# its file system alive after the host unmounts it (where `/` is private nothing propagates).
_SANDBOX_TYPES = ("erofs", "overlay", "nsfs")
_SANDBOX_SOURCES = ("upper", "sandfleet-lazy")
_PRUNED_DIRS = ("/run/netns",)
_SYSTEM = ("/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/var", "/boot", "/nix")


def prune_copied_sandbox_mounts() -> int:
    """Detach, in the calling thread's (new, private or slave) mount namespace, every mount a
    sandbox platform made on the host that it was copied with (see _SANDBOX_TYPES), and
    everything beneath /run/netns; never a system directory. Returns how many went. Uses the
    standard library only: the spawner calls it."""
    with open("/proc/thread-self/mountinfo") as f:
        lines = f.read().splitlines()
    points = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].encode().decode("unicode_escape")
        sandbox = (tail[0] in _SANDBOX_TYPES or tail[1] in _SANDBOX_SOURCES
                   or any(point.startswith(d + "/") for d in _PRUNED_DIRS))
        if sandbox and point not in _SYSTEM:
            points.append(point)
    gone = 0
    for point in sorted(points, key=lambda p: p.count("/"), reverse=True):
        try:
            linux.umount2(point, linux.MNT_DETACH)
            gone += 1
        except OSError:
            pass  # gone already with a parent
    return gone


def _new_namespace() -> int:
    def make() -> int:
        linux.unshare(CLONE_FS | linux.CLONE_NEWNS)  # this thread only
        linux.mount(None, "/", None, linux.MS_REC | MS_SLAVE)  # the host's reach in, ours never out
        prune_copied_sandbox_mounts()  # other nodes' on this host, and what an older version left
        # Not the network namespace names, though: as a slave of the host's /run/netns this copy got
        # every name bound there later (+1 mount here per sandbox of every node on the host, each
        # keeping its namespace alive here until the host's unmount reached it).
        linux.mount(None, netns.RUN_DIR, None, linux.MS_PRIVATE)
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    netns.ensure_run_dir()  # a mount point of the host's before the copy: else the first name comes in with it
    return linux.on_own_thread(make, "roots-ns")


def _make_unpropagated(directory: str) -> None:
    """`directory` a private mount of itself: a mount-namespace file may only be bound where
    the bind propagates nowhere (on a host whose `/` is shared, as systemd makes it)."""
    with contextlib.suppress(OSError):
        linux.mount(directory, directory, None, linux.MS_BIND)
    linux.mount(None, directory, None, linux.MS_PRIVATE)


def ensure(node_id: str) -> int:
    """An fd of the node's roots namespace: the pinned one, or a new one pinned now."""
    pin = pin_path(node_id)
    found = _open_ns(pin)
    if found is not None:
        return found
    os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
    os.close(os.open(pin, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    fd = _new_namespace()
    try:
        try:
            linux.mount(f"/proc/self/fd/{fd}", pin, None, linux.MS_BIND)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _make_unpropagated(RUN_DIR)
            linux.mount(f"/proc/self/fd/{fd}", pin, None, linux.MS_BIND)
    except BaseException:
        os.close(fd)
        raise
    return fd


def enter(ns_fd: int) -> None:
    """Move the calling thread into the namespace for good; threads it starts later are born
    there. A service calls it first thing, before any thread of its own exists."""
    linux.unshare(CLONE_FS)  # a thread sharing its filesystem info may not change mount namespace
    linux.setns(ns_fd, linux.CLONE_NEWNS)


def remove(node_id: str, host_ns: int = -1) -> None:
    """Unpin the node's namespace (it ends with the last process in it, and its mounts with
    it) and delete the pin's file. Idempotent. The pin is a mount of the host's namespace: a
    caller living in the roots namespace passes an fd of the host's (`host_ns`, kept from
    before it entered) and the unpinning runs on a thread there."""
    if host_ns >= 0:
        def from_host() -> None:
            enter(host_ns)
            remove(node_id)

        return linux.on_own_thread(from_host, "roots-ns")
    pin = pin_path(node_id)
    while (fd := _open_ns(pin)) is not None:
        os.close(fd)
        try:
            linux.umount2(pin, linux.MNT_DETACH)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                break
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pin)


def pinned_nodes() -> list[str]:
    """Node ids with a roots namespace pinned on this host."""
    try:
        entries = sorted(os.listdir(RUN_DIR))
    except FileNotFoundError:
        return []
    found = []
    for name in entries:
        fd = _open_ns(f"{RUN_DIR}/{name}")
        if fd is not None:
            os.close(fd)
            found.append(name)
    return found


def read_mountinfo(node_id: str) -> str | None:
    """The roots namespace's mount table (mountinfo text), or None if none is pinned."""
    fd = open_pinned(node_id)
    if fd is None:
        return None
    try:
        return linux.on_own_thread(lambda: _read_inside(fd), "roots-ns")
    finally:
        os.close(fd)


def _read_inside(ns_fd: int) -> str:
    enter(ns_fd)
    with open("/proc/thread-self/mountinfo") as f:
        return f.read()


class RootsView:
    """A process outside the roots namespace (the launcher) looking in: a detached clone of a
    root to attach in a sandbox's own namespace, a path resolving inside (through a directory
    fd of the namespace's `/`), the namespace's mount table. One thread lives inside for the
    calls that must be made from there (open_tree clones only mounts of the caller's own
    namespace). A namespace pinned again (its layer-cache made a new one) is followed. Where
    none is pinned, roots are looked for in the caller's own namespace (a layer-cache run in
    the host's, as the tests of its own do)."""

    def __init__(self, node_id: str) -> None:
        self.pin = pin_path(node_id)
        self._lock = threading.Lock()
        self._ino = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._root = -1  # O_PATH fd of the namespace's `/`

    def _inside(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The thread inside the pinned namespace (made again if the pin changed), None if none is pinned."""
        try:
            ino = os.stat(self.pin).st_ino
        except FileNotFoundError:
            ino = 0
        with self._lock:
            if ino == self._ino and (self._pool is not None or not ino):
                return self._pool
            self._close()
            fd = _open_ns(self.pin)
            if fd is None:
                self._ino = 0
                return None
            try:
                pool = concurrent.futures.ThreadPoolExecutor(1, "roots-view", initializer=enter, initargs=(fd,))
                self._root = pool.submit(os.open, "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC).result()
            finally:
                os.close(fd)
            self._pool, self._ino = pool, ino
            return pool

    def clone(self, path: str) -> int:
        """A detached recursive clone of the mount tree at `path` (an fd; attach it with
        mount_api.attach, close it after). Blocking (one hop to the inside thread)."""
        pool = self._inside()
        if pool is None:
            return mount_api.clone_tree(path, recursive=True)
        return pool.submit(mount_api.clone_tree, path, True).result()

    def path(self, path: str) -> str:
        """`path` (absolute, as the namespace sees it) as a path that resolves inside from this
        process and its children (QEMU opening a lazy layer's file), while it lives."""
        if self._inside() is None:
            return path
        return f"/proc/{os.getpid()}/fd/{self._root}{path}"

    def mountinfo(self) -> str:
        pool = self._inside()
        if pool is None:
            with open("/proc/self/mountinfo") as f:
                return f.read()
        return pool.submit(_read_own_mountinfo).result()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def close(self) -> None:
        with self._lock:
            self._close()
            self._ino = 0


def _read_own_mountinfo() -> str:
    with open("/proc/thread-self/mountinfo") as f:
        return f.read()

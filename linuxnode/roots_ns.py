"""The node's roots namespace: one mount namespace per node where every sandbox root is
composed (EROFS layers, overlays, upper-dir tmpfs, the lazy layers' FUSE mount), so the
host's mount table does not grow by a root's mounts however many sandboxes run (each
sandbox's network namespace name is held likewise, in linuxnode.netns's holder).

Why: every new mount namespace starts as a copy of the one it is made from, and the kernel
copies (and later tears down) each mount. With each sandbox adding its mounts to the host's
table, each process init's unshare, each crun run and every other tool on the host that
unshares paid for every live sandbox (`unshare -m true`: 3 ms with 22 mounts, 45 ms with
8,000). Here the table that grows is one nobody copies: a root leaves it as a detached
clone (`clone()`, open_tree from a thread inside) that the runtime attaches in the
sandbox's own namespace.

It is pinned at /run/sandfleet/roots/<node id> (linuxnode.ns_pin), so it outlives the
processes in it: a restarted layer-cache enters the same namespace and finds its roots
there. Its `/` is a slave of the host's: mounts the host makes later (a new disk) are seen
inside, nothing made inside reaches the host.

The layer-cache (and the FUSE daemon it starts, which inherits it) *lives* in it: `enter()`
at start, before it mounts anything, so its mount code and `/proc/self/mountinfo` read as
they always did. Everyone else looks in through a `RootsView`.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from linuxnode import mount_api, names, netns, ns_pin
from linuxnode import syscalls as linux
from linuxnode.ns_pin import CLONE_FS, MS_SLAVE, prune_copied_sandbox_mounts  # noqa: F401 - named here by callers

RUN_DIR = "/run/sandfleet/roots"


class RootsNamespaceMissing(RuntimeError):
    """No roots namespace is pinned for the node (its layer-cache has not made one)."""


def pin_path(node_id: str) -> str:
    if not names.is_node_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"{RUN_DIR}/{node_id}"


_open_ns = ns_pin.open_pinned


def open_pinned(node_id: str) -> int | None:
    """An fd of the node's roots namespace, or None if none is pinned."""
    return _open_ns(pin_path(node_id))


def _new_namespace() -> int:
    # Not the network namespace names of the host's /run/netns either (made with SANDFLEET_NETNS=host,
    # or by `ip netns`): as a slave of the host's /run/netns this copy would get every name bound
    # there later (+1 mount here per name, each keeping its namespace alive here until the host's
    # unmount reached it).
    # A mount point of the host's before the copy (else the first name comes in with it), checked
    # again each time: another process on the host may have unmounted or removed it since.
    netns.ensure_run_dir(again=True)
    return ns_pin.new_namespace((netns.RUN_DIR,), "roots-ns")


def ensure(node_id: str) -> int:
    """An fd of the node's roots namespace: the pinned one, or a new one pinned now."""
    return ns_pin.pinned_or_new(pin_path(node_id), _new_namespace)


def enter(ns_fd: int) -> None:
    """Move the calling thread into the namespace for good; threads it starts later are born
    there. A service calls it first thing, before any thread of its own exists."""
    ns_pin.enter(ns_fd)


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
    ns_pin.unpin(pin_path(node_id))


def pinned_nodes() -> list[str]:
    """Node ids with a roots namespace pinned on this host."""
    return ns_pin.pinned(RUN_DIR)


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

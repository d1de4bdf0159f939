"""The node's network namespace holder (the names themselves are linuxnode.netns's): a mount
namespace per node, pinned at /run/sandfleet/netns/<node id> (linuxnode.ns_pin), whose
/run/netns is a tmpfs of its own, so nothing bound on the host's /run/netns comes in and
nothing bound here goes out: the host's table holds the pin only, however many names.

A process looks in through a `HolderView`: an fd of the holder, an O_PATH fd of its /run/netns
(paths of names that open from this process and its children, /proc/<pid>/fd/<n>/<name>), and
one thread living inside, made at first need, where names are bound and unbound (a mount of
the holder's is made or undone only from inside it), one after another.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import TypeVar

from linuxnode import names, ns_pin
from linuxnode import syscalls as linux

T = TypeVar("T")
RUN_DIR = "/run/netns"  # where names are bound, inside the holder as iproute2 binds them on a host
PIN_DIR = "/run/sandfleet/netns"
_MS_SHARED = 1 << 20
_host_run_dir_ready = False


def pin_path(node_id: str) -> str:
    if not names.is_node_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}")
    return f"{PIN_DIR}/{node_id}"


def pinned_nodes() -> list[str]:
    """Node ids with a holder pinned on this host."""
    return ns_pin.pinned(PIN_DIR)


def ensure_host_run_dir(again: bool = False) -> None:
    """Make the host's /run/netns a shared mount point of itself, as `ip netns add` does (`again`:
    someone may have removed it since)."""
    global _host_run_dir_ready
    if _host_run_dir_ready and not again:
        return
    os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
    try:
        linux.mount("", RUN_DIR, "none", _MS_SHARED | linux.MS_REC)
    except OSError as exc:
        if exc.errno != 22:  # EINVAL: not a mount point yet
            raise
        linux.mount(RUN_DIR, RUN_DIR, "none", linux.MS_BIND | linux.MS_REC)
        linux.mount("", RUN_DIR, "none", _MS_SHARED | linux.MS_REC)
    _host_run_dir_ready = True


def _new_holder() -> int:
    """A new holder, an fd of it. The host's /run/netns is a mount point before the copy,
    private in the copy: else names bound on the host's later come in. Checked again for each
    holder (once a node): another process on the host may have unmounted or removed it since."""
    ensure_host_run_dir(again=True)
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


def _open_names_dir(ns_fd: int) -> int:
    def inside() -> int:
        ns_pin.enter(ns_fd)
        return os.open(RUN_DIR, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    return linux.on_own_thread(inside, "netns-holder")


class HolderView:
    """One process's hold on one pinned holder. It keeps an fd of the holder, so the holder's
    nsfs inode number (which the pin is compared with to see whether it is still this holder:
    an ended namespace's number is given to the next one) is not reused while it looks; a
    holder unpinned elsewhere (empty) lasts here until the next look lets it go."""

    def __init__(self, ns_fd: int) -> None:
        self.ns_fd = ns_fd
        self.ino = os.fstat(ns_fd).st_ino
        self.names_dir = _open_names_dir(ns_fd)
        self._inside: concurrent.futures.ThreadPoolExecutor | None = None

    def local(self, name: str) -> str:
        """The name's path from this process (and its children, while it lives)."""
        return f"/proc/{os.getpid()}/fd/{self.names_dir}/{name}"

    def listing(self) -> list[str]:
        return os.listdir(f"/proc/self/fd/{self.names_dir}")

    def empty(self) -> bool:
        """No name is bound (the first entry only; still a read of up to a buffer's worth of
        names, so the agent, which keeps its holder, never asks per name)."""
        with os.scandir(f"/proc/self/fd/{self.names_dir}") as entries:
            return next(entries, None) is None

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the thread inside the holder (made now if it is not yet), after what was
        submitted before. Call with the views' lock held (the thread is made once)."""
        if self._inside is None:
            self._inside = concurrent.futures.ThreadPoolExecutor(1, "netns-holder", initializer=ns_pin.enter,
                                                                 initargs=(self.ns_fd,))
        return self._inside.submit(fn)

    def close(self) -> None:
        if self._inside is not None:
            self._inside.shutdown(wait=True)
        os.close(self.names_dir)
        os.close(self.ns_fd)


def look(node_id: str, views: dict[str, HolderView], make: bool = False) -> HolderView | None:
    """`views`' view of the node's holder, followed to the one pinned now (a new one made and
    pinned if none is and `make`); None if none is pinned. Call with `views`' lock held."""
    try:
        ino = os.stat(pin_path(node_id)).st_ino
    except FileNotFoundError:
        ino = 0
    view = views.get(node_id)
    if view is not None and view.ino == ino:
        return view
    if view is not None:
        del views[node_id]
        view.close()
    pin = pin_path(node_id)
    fd = ns_pin.pinned_or_new(pin, _new_holder) if make else ns_pin.open_pinned(pin)
    if fd is None:
        return None
    try:
        views[node_id] = HolderView(fd)
    except BaseException:
        os.close(fd)
        raise
    return views[node_id]

"""Mount namespaces of the node's own, made from the host's and pinned on the host by a bind
mount of their nsfs file, so they outlive every process in them: the roots namespace
(linuxnode.roots_ns) and the network namespace names' holder (linuxnode.netns). One pin is
one mount of the host's per node, whatever the namespace holds.

A pin is made from the host's namespace, which is older than the one pinned, so the kernel
allows it, on a mount that does not propagate (a bind of a mount-namespace file needs that).
A namespace made here starts as a copy of the host's table without the sandbox mounts in it
(other nodes' roots, names and pins on the same host: a copy would keep them alive).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable

from linuxnode import syscalls as linux

CLONE_FS = 0x200
MS_SLAVE = 1 << 19
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3)

# What sandbox platforms mount on a host: layers, roots, upper-dir tmpfs, namespace names and
# pins, lazy layers' FUSE files. A namespace copied from the host gets a copy of each, which would
# keep its file system alive after the host unmounts it (where `/` is private nothing propagates).
_SANDBOX_TYPES = ("erofs", "overlay", "nsfs")
_SANDBOX_SOURCES = ("upper", "sandfleet-lazy")
_PRUNED_DIRS = ("/run/netns",)
_SYSTEM = ("/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/var", "/boot", "/nix")


def open_pinned(path: str) -> int | None:
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


def enter(ns_fd: int) -> None:
    """Move the calling thread into the mount namespace for good; threads it starts later are
    born there."""
    linux.unshare(CLONE_FS)  # a thread sharing its filesystem info may not change mount namespace
    linux.setns(ns_fd, linux.CLONE_NEWNS)


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


def new_namespace(private: tuple[str, ...], name: str) -> int:
    """A new mount namespace copied from the caller's (the host's), an fd of it: its `/` a slave
    of the host's (the host's mounts reach in, its own never out), the copied sandbox mounts
    gone, and each of `private` (mount points) propagating nothing in."""
    def make() -> int:
        linux.unshare(CLONE_FS | linux.CLONE_NEWNS)  # this thread only
        linux.mount(None, "/", None, linux.MS_REC | MS_SLAVE)
        prune_copied_sandbox_mounts()  # other nodes' on this host, and what an older version left
        for point in private:
            linux.mount(None, point, None, linux.MS_PRIVATE)
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    return linux.on_own_thread(make, name)


def _make_unpropagated(directory: str) -> None:
    """`directory` a private mount of itself: a mount-namespace file may only be bound where
    the bind propagates nowhere (on a host whose `/` is shared, as systemd makes it)."""
    with contextlib.suppress(OSError):
        linux.mount(directory, directory, None, linux.MS_BIND)
    linux.mount(None, directory, None, linux.MS_PRIVATE)


def pin(path: str, ns_fd: int) -> None:
    """Bind the namespace `ns_fd` at `path` (made, with its directory, if missing)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    try:
        linux.mount(f"/proc/self/fd/{ns_fd}", path, None, linux.MS_BIND)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _make_unpropagated(directory)
        linux.mount(f"/proc/self/fd/{ns_fd}", path, None, linux.MS_BIND)


def pinned_or_new(path: str, make: Callable[[], int]) -> int:
    """An fd of the namespace pinned at `path`, or of the one `make` returns, pinned there now."""
    found = open_pinned(path)
    if found is not None:
        return found
    fd = make()
    try:
        pin(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unpin(path: str) -> None:
    """Undo every pin at `path` and delete its file. Idempotent. The namespace ends with the
    last process (or fd) holding it, and its mounts with it."""
    while (fd := open_pinned(path)) is not None:
        os.close(fd)
        try:
            linux.umount2(path, linux.MNT_DETACH)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                break
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def pinned(directory: str) -> list[str]:
    """Names of the mount namespaces pinned in `directory`."""
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = []
    for name in entries:
        fd = open_pinned(f"{directory}/{name}")
        if fd is not None:
            os.close(fd)
            found.append(name)
    return found

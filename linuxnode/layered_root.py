"""A sandbox root made from layers: the composed overlay (the layer-cache's `Rootfs.path`, in
the node's roots namespace: linuxnode.roots_ns) used as `/`, writable, with the sandbox's own
/dev, /proc and /tmp mounted into it. It reaches the sandbox's namespace as a detached clone
of the overlay (open_tree), attached there: it is never mounted in the host's table.

The overlay's content is the user's: any path in it may be a symlink planted to point at
the host (`dev -> /`), and every mount below is made as root before the sandbox is sealed.
So no path is ever resolved through the overlay the ordinary way: each mount point is
opened with openat2(RESOLVE_IN_ROOT) from the root, created inside the root when missing,
and mounted on through its /proc/self/fd link. Both runtimes use this: `plan()` gives the
`process` runtime's init child its steps (the shape of `linuxnode.process`'s host-view
plan: what, call, args; os and ctypes only, as code after fork must be), and
`ensure_dir()` / `open_in_root()` serve the `container` runtime and the file APIs.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import stat
from typing import NamedTuple

from linuxnode import mount_api, procfs, userns
from linuxnode import syscalls as linux

INIT_BINARY = "/usr/bin/catatonit"  # where the process runtime's init execs it from, inside the root
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
              ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"))
# As rootfs.py (host view) and crun's maskedPaths: kpage*: uid 0 may read them without any
# capability, and a scan of kpagecgroup crashed a host.
_RO = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV
_RESOLVE = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_MAGICLINKS


class Step(NamedTuple):
    what: str
    call: object
    args: tuple


# -- resolving inside a root ------------------------------------------------------------------

def open_in_root(root: str | int, rel: str, *, create: str = "", mode: int = 0o755) -> int:
    """An O_PATH fd of `rel` resolved inside `root` (a path or a directory fd), symlinks
    included but never leaving it. `create="dir"` or `"file"` makes a missing last component
    (and missing parent directories) inside the root; otherwise ENOENT is raised."""
    root_fd = root if isinstance(root, int) else os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _resolve(root_fd, rel.strip("/"), create, mode)
    finally:
        if root_fd is not root:
            os.close(root_fd)


def _resolve(root_fd: int, rel: str, create: str, mode: int) -> int:
    flags = os.O_PATH | os.O_CLOEXEC | (os.O_DIRECTORY if create == "dir" else 0)
    for _ in range(3):
        try:
            return linux.openat2(root_fd, rel or ".", flags, 0, _RESOLVE)
        except OSError as exc:
            if exc.errno != errno.ENOENT or not create or not rel:
                raise
        parent_rel, _, name = rel.rpartition("/")
        parent = _resolve(root_fd, parent_rel, "dir", 0o755)
        try:
            if create == "dir":
                os.mkdir(name, mode, dir_fd=parent)
            else:
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 mode, dir_fd=parent))
        except FileExistsError:
            pass  # made meanwhile, or a dangling symlink: resolving again tells
        finally:
            os.close(parent)
    raise OSError(errno.ELOOP, "cannot make it inside the root (a dangling symlink?)", rel)


def ensure_dir(root: str, rel: str, mode: int = 0o755) -> None:
    """Make `rel` a directory inside `root` if nothing is there."""
    os.close(open_in_root(root, rel, create="dir", mode=mode))


def ensure_owned_dir(root: str, rel: str, id_host: int) -> None:
    """`ensure_dir`, and one this made (owned by the host's root) given to the sandbox's root."""
    fd = open_in_root(root, rel, create="dir")
    try:
        if id_host and os.fstat(fd).st_uid == 0:
            os.chown(_fd_path(fd), id_host, id_host)  # through the fd's link: the directory resolved, no path again
    finally:
        os.close(fd)


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _mount_in(root: str, rel: str, source: str | None, fstype: str | None, flags: int, data: str | None = None,
              create: str = "dir") -> None:
    target = open_in_root(root, rel, create=create)
    try:
        linux.mount(source, _fd_path(target), fstype, flags, data)
    finally:
        os.close(target)


def _bind_in(root: str, source_rel: str, rel: str, flags: int = 0) -> None:
    """Bind a path of the root onto another path of the root (masking /proc entries)."""
    source = open_in_root(root, source_rel)
    try:
        _mount_in(root, rel, _fd_path(source), None, linux.MS_BIND | flags, create="")
    finally:
        os.close(source)


def _bind_file_ro(root: str, host_file: str, rel: str) -> None:
    _mount_in(root, rel, host_file, None, linux.MS_BIND, create="file")
    _remount_in(root, rel, _RO)  # resolved again: the first fd is of the file beneath the mount


def _remount_in(root: str, rel: str, flags: int) -> None:
    _mount_in(root, rel, None, None, linux.MS_REMOUNT | linux.MS_BIND | flags, create="")


def _make_in(root: str, dir_rel: str, kind: str, entries: tuple) -> None:
    """Device nodes (name, rdev) or symlinks (name, target) in a directory this plan mounted."""
    parent = open_in_root(root, dir_rel)
    # An O_PATH fd cannot be a dir_fd for mknod: reopen the directory through its link.
    directory = os.open(_fd_path(parent), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    os.close(parent)
    try:
        for name, value in entries:
            if kind == "device":
                os.mknod(name, 0o666 | stat.S_IFCHR, value, dir_fd=directory)
                # 0666 whatever the umask: they are the host root's, and with a user namespace
                # the sandbox's root is only "others" to them
                os.chmod(name, 0o666, dir_fd=directory)
            else:
                os.symlink(value, name, dir_fd=directory)
    finally:
        os.close(directory)


# -- the process runtime's plan -------------------------------------------------------------------

@functools.cache
def _host_facts() -> tuple[tuple, tuple, tuple]:
    return (
        tuple((d, os.stat("/dev/" + d).st_rdev) for d in _DEVICES if os.path.exists("/dev/" + d)),
        tuple(p for p in procfs.MASKED_FILES if os.path.isfile("/proc/" + p)),
        tuple(p for p in procfs.MASKED_DIRS if os.path.isdir("/proc/" + p)),
    )


def check(rootfs_dir: str) -> None:
    """Refuse, before forking, a root the plan cannot use. Its path is the roots namespace's
    (linuxnode.roots_ns), so it is not looked for here: cloning it tells."""
    if not os.path.isabs(rootfs_dir):
        raise ValueError(f"root {rootfs_dir!r} is not an absolute path")
    if not os.access(INIT_BINARY, os.X_OK):
        raise ValueError(f"{INIT_BINARY} is missing on the host")


def plan(root_tree: int, tmp_size_mb: int, hostname: str, stage: str, id_host: int = 0) -> tuple[Step, ...]:
    """Every step the init child takes, in its private mount namespace, to attach the root (the
    detached mount tree `root_tree`, cloned from where the root is composed: the node's roots
    namespace, so the host's table never holds it) on `stage`, give it /dev, /proc, /tmp and
    the init binary, and pivot into it. Unlike the host
    view, `/` stays writable (writes go to the sandbox's own upper dir) and /workspace is the
    overlay's own directory, so a task layer can bring one; it is made if no layer has it.
    With a user namespace (`id_host`) the layers are idmapped by the layer-cache, so the root's
    content is its root's already; what this plan makes belongs to it too."""
    devices, proc_files, proc_dirs = _host_facts()
    ids = userns.owner_options(id_host)
    steps: list[Step] = []

    def add(what: str, call, *args) -> None:
        steps.append(Step(what, call, args))

    add("make all mounts private", linux.mount, None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    add("attach the root", mount_api.attach, root_tree, stage)
    add("make the root nosuid", linux.mount, None, stage, None,
        linux.MS_REMOUNT | linux.MS_BIND | linux.MS_NOSUID | linux.MS_NODEV)

    # Device nodes are made, not bound: a bound host inode could be chmod-ed by its owner, uid 0.
    add("mount /dev", _mount_in, stage, "dev", "dev", "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC,
        "size=64k,mode=0755" + ids)
    add("make /dev nodes", _make_in, stage, "dev", "device", devices)
    add("make /dev links", _make_in, stage, "dev", "symlink", _DEV_LINKS)
    # Its own devpts (as a container's): the node opens the sandbox's terminals on its ptmx.
    add("mount /dev/pts", _mount_in, stage, "dev/pts", "devpts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620" + ids)
    add("mount /dev/shm", _mount_in, stage, "dev/shm", "shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
        f"size={max(1, tmp_size_mb // 4)}m,mode=1777" + ids)
    add("make /dev read-only", _remount_in, stage, "dev", linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NOEXEC)

    # /proc is read-only as a whole: uid 0 owns its entries and could chmod host-global ones.
    add("mount /proc", _mount_in, stage, "proc", "proc", "proc", _RO | linux.MS_NOEXEC)
    for name in proc_files:
        add(f"mask /proc/{name}", _bind_in, stage, "dev/null", f"proc/{name}")
    for name in proc_dirs:
        add(f"mask /proc/{name}", _mount_in, stage, f"proc/{name}", "masked", "tmpfs", _RO, "size=4k,mode=0555", "")

    add("mount /tmp", _mount_in, stage, "tmp", "tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
        f"size={tmp_size_mb}m,mode=1777" + ids)
    add("make /workspace", ensure_owned_dir, stage, "workspace", id_host)
    add(f"bind the init at {INIT_BINARY}", _bind_file_ro, stage, INIT_BINARY, INIT_BINARY)

    add("set hostname", socket.sethostname, hostname)
    add("chdir to the new root", os.chdir, stage)
    add("pivot_root", linux.pivot_root, ".", ".")
    add("detach the host root", linux.umount2, ".", linux.MNT_DETACH)
    add("chdir /", os.chdir, "/")
    return tuple(steps)

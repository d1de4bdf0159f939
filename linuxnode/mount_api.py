"""The kernel's file-descriptor mount API (open_tree, move_mount, fsopen, fsconfig, fsmount,
mount_setattr), called through ctypes, for what mount(2) cannot do:
- a mount made detached (attached nowhere, an fd) and changed before anything can see it: an
  EROFS layer idmapped to the node's sandbox ids from its first moment (linuxnode.userns);
- options given one by one: mount(2) takes them as one string of at most a page, which an
  overlay over a deep image (one lower layer per OCI layer, each a long path) overruns,
  where `fsconfig` takes each `lowerdir+` on its own;
- a copy of a mount tree (`clone_tree`) carried into another mount namespace (crun's) and
  attached there.

The numbers are the same on every architecture (allocated after the syscall tables were
unified). Every call raises OSError(errno, strerror, <the step>) like linuxnode.syscalls.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

_NR = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "mount_setattr": 442}
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
FSOPEN_CLOEXEC = 1
FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MOUNT_ATTR_IDMAP = 0x00100000

Options = list[tuple[str, str | None]]  # (key, value) in order; a flag where the value is None


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


def _call(name: str, *args) -> int:
    return _syscall(ctypes.c_long(_NR[name]), *args)


def options_of(data: str) -> Options:
    """mount(2)'s data string (`key=value,flag`) as fsconfig options."""
    found: Options = []
    for item in filter(None, data.split(",")):
        key, eq, value = item.partition("=")
        found.append((key, value if eq else None))
    return found


def new_mount(fstype: str, options: Options, attrs: int = 0, source: str | None = None) -> int:
    """A detached mount (an fd) of a new `fstype`, attached nowhere; `attrs` are MOUNT_ATTR_* flags."""
    fs = _check(_call("fsopen", os.fsencode(fstype), ctypes.c_uint(FSOPEN_CLOEXEC)), f"fsopen {fstype}")
    try:
        for key, value in ([("source", source)] if source is not None else []) + options:
            if value is None:
                _check(_call("fsconfig", ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_SET_FLAG), os.fsencode(key), None,
                             ctypes.c_int(0)), f"{fstype} option {key}")
            else:
                _check(_call("fsconfig", ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_SET_STRING), os.fsencode(key),
                             os.fsencode(value), ctypes.c_int(0)), f"{fstype} option {key}={value}")
        _check(_call("fsconfig", ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0)),
               f"create {fstype}")
        return _check(_call("fsmount", ctypes.c_int(fs), ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(attrs)),
                      f"fsmount {fstype}")
    finally:
        os.close(fs)


def set_attributes(mount_fd: int, attr_set: int, userns_fd: int = 0, attr_clr: int = 0) -> None:
    """mount_setattr(2) on a (detached) mount; MOUNT_ATTR_IDMAP with `userns_fd` idmaps it
    (EINVAL: the file system cannot be idmapped)."""
    attr = _MountAttr(attr_set, attr_clr, 0, userns_fd)
    _check(_call("mount_setattr", ctypes.c_int(mount_fd), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr),
                 ctypes.c_size_t(ctypes.sizeof(attr))), "mount_setattr")


def attach(mount_fd: int, target: str) -> None:
    """move_mount(2) a detached mount onto `target`."""
    _check(_call("move_mount", ctypes.c_int(mount_fd), b"", ctypes.c_int(AT_FDCWD), os.fsencode(target),
                 ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), f"attach at {target}")


def clone_tree(path: str | int, recursive: bool = False) -> int:
    """A detached copy (OPEN_TREE_CLONE) of the mount at `path` (or fd), a bind mount of it if it
    is no mount point: attached nowhere, it goes away with its last fd unless attached."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    if isinstance(path, int):
        return _check(_call("open_tree", ctypes.c_int(path), b"", ctypes.c_uint(flags | AT_EMPTY_PATH)), "open_tree")
    return _check(_call("open_tree", ctypes.c_int(AT_FDCWD), os.fsencode(path), ctypes.c_uint(flags)),
                  f"open_tree {path}")


def mount(fstype: str, target: str, options: Options, attrs: int = 0, source: str | None = None,
          idmap_userns: int = -1) -> None:
    """Mount a new `fstype` at `target`; with `idmap_userns` (an fd), idmapped through that
    namespace's map before it is attached, so nothing ever sees it unmapped."""
    mnt = new_mount(fstype, options, attrs, source)
    try:
        if idmap_userns >= 0:
            set_attributes(mnt, MOUNT_ATTR_IDMAP, idmap_userns)
        attach(mnt, target)
    finally:
        os.close(mnt)

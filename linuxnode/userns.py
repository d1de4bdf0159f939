"""User namespaces for sandbox roots: a sandbox's uid/gid 0 is an unprivileged host range.

A sandbox sees a range of `RANGE` ids (`IdRange`): inside, root is 0; on the host it is
`range.host`, an id no host user has. One range per node (`node_range`, from
SANDFLEET_USERNS): every sandbox of a node runs in a user namespace with that one mapping,
so each layer stays one idmapped EROFS mount per node; sandboxes are kept apart from each
other by their pid, mount and network namespaces, as before.

The kernel pieces are here too, called through ctypes: a user namespace with a given mapping
is made by a short-lived helper that unshares one and whose maps we write (`make`); the fd
mount API (linuxnode.mount_api: mount_setattr with MOUNT_ATTR_IDMAP on a detached mount)
mounts a layer's one EROFS mount idmapped to the node's range from its first moment, so its
root-owned files are the sandboxes' root's without a copy or a chown. Only
the namespace's *mapping* is used: every other namespace of a sandbox stays owned by the
host's user namespace and every capability is still dropped, so root inside gains nothing but
a different owner on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass

RANGE = 65536  # ids per sandbox: a whole 16-bit id space, as a distribution's userland expects
DEFAULT_BASE = 1 << 20  # first host id handed out: above any subuid range useradd gives (100000+)

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWUSER = 0x10000000
PIDFD_GET_USER_NAMESPACE = 0xFF09  # _IO(PIDFS_IOCTL_MAGIC 0xFF, 9): the user namespace of a pidfd's process


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


# -- the node's mapping ------------------------------------------------------------------------

@dataclass(frozen=True)
class IdRange:
    """Host ids `host` .. `host + count - 1` seen inside as 0 .. count - 1 (uids and gids alike)."""

    host: int
    count: int = RANGE

    def uid_map(self) -> str:
        return f"0 {self.host} {self.count}\n"


def node_range(setting: str | None = None) -> IdRange | None:
    """The node's mapping, from `setting` (sandfleet.config.ServiceConfig.userns, which reads
    SANDFLEET_USERNS once; None: read the variable here): "" or "on" for the default base, a
    number for another base, "off" for none (roots are the host's uid 0, as before user
    namespaces). The launcher and the layer-cache of a node take the same setting: the layer
    mounts are idmapped for the range the sandboxes run in."""
    value = (os.environ.get("SANDFLEET_USERNS", "") if setting is None else setting).strip().lower()
    if value == "off":
        return None
    host = DEFAULT_BASE if value in ("", "on") else int(value)
    if host < RANGE or host + RANGE > 1 << 32:
        raise ValueError(f"SANDFLEET_USERNS={value}: the base must be at least {RANGE} "
                         "and leave a whole range below 2^32")
    return IdRange(host)


def owner_options(id_host: int) -> str:
    """Mount options that make a tmpfs's root (or a devpts's new terminals) belong to the
    sandbox's root where it has a user namespace (`id_host`: its host uid and gid; 0: none).
    They are read in the mounter's namespace, the host's: B mounts before it joins its own."""
    return f",uid={id_host},gid={id_host}" if id_host else ""


@contextlib.contextmanager
def acting_as(id_host: int) -> Iterator[None]:
    """Within it, this thread creates files as the sandbox's root (`id_host`; 0: as itself):
    its filesystem uid and gid are set (setfsuid is per thread, so the launcher's other threads
    are untouched), which also drops its filesystem capabilities there, so the node writes into a
    sandbox with the rights the sandbox's root has, no more."""
    if not id_host:
        yield
        return
    old_gid = _libc.setfsgid(ctypes.c_uint(id_host))
    old_uid = _libc.setfsuid(ctypes.c_uint(id_host))
    try:
        yield
    finally:
        _libc.setfsuid(ctypes.c_uint(old_uid))
        _libc.setfsgid(ctypes.c_uint(old_gid))


def mapped_root(pid: int) -> int:
    """The host uid that is root inside `pid`'s user namespace, 0 if it is the host's (its
    uid_map is the record: it outlives any restart of the node's services)."""
    with open(f"/proc/{pid}/uid_map") as f:
        for line in f:
            inside, outside, _ = line.split()
            if inside == "0":
                return int(outside)
    return 0


# -- the namespace ----------------------------------------------------------------------------------

def make(ids: IdRange, timeout_s: float = 5.0) -> int:
    """An fd of a new user namespace mapping `ids` (uids and gids), owned by the host's root.
    util-linux `unshare --user` makes it and waits on its stdin (`cat`); we write its maps,
    keep a reference to the namespace, which outlives the helper, and let the helper go. A
    process, not a fork of ours: the callers are services on an event loop (uvloop) whose
    forked copies are not safe to run, and the spawner needs one per mapping for its life."""
    import subprocess  # not at the top: the spawner imports this module and rarely needs it
    import time

    helper = subprocess.Popen(["unshare", "--user", "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, close_fds=True)
    try:
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + timeout_s
        while True:  # until it has unshared (it then execs cat, which waits)
            try:
                if os.readlink(f"/proc/{helper.pid}/ns/user") != own:
                    break
            except FileNotFoundError:
                pass
            if helper.poll() is not None or time.monotonic() > deadline:
                ended = helper.poll() is not None
                why = helper.stderr.read().decode(errors="replace").strip() if ended else "timed out"
                raise OSError(errno.EPERM, f"unshare --user: {why or 'failed'}", "user namespace")
            time.sleep(0.0005)
        for name in ("uid_map", "gid_map"):
            fd = os.open(f"/proc/{helper.pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, ids.uid_map().encode())
            finally:
                os.close(fd)
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        if helper.poll() is None:
            try:
                helper.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
        helper.stderr.close()


def enter(userns_fd: int) -> None:
    """Join a sandbox's user namespace as its root (host `range.host`), for code after fork.
    Called last before capabilities are dropped: the namespaces joined before it are owned by
    the host's user namespace, which this process has no capability in once it is here."""
    _setns(userns_fd)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def _setns(fd: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(CLONE_NEWUSER)), "setns user namespace")



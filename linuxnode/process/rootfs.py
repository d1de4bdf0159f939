"""The sandbox root: a plan of steps computed once per (sizes, hostname) from what the host
has, and replayed by each init child (B) in its private mount namespace. It builds a tmpfs
root on STAGE with the host's /usr, /bin and /lib* bound read-only, a few /etc entries,
fresh /dev (with a devpts of its own), /proc, /tmp and /workspace, pivots into it and makes it read-only."""

from __future__ import annotations

import functools
import os
import socket
import stat
from dataclasses import dataclass

from linuxnode import procfs, userns
from linuxnode import syscalls as linux

STAGE = "/tmp"  # mount point of the new root inside the child's private mount namespace

_HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib64", "lib32", "libx32")
_ETC_BINDS = ("ssl/certs", "alternatives", "ld.so.cache")
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# kpage*: uid 0 may read them without any capability, and a scan of kpagecgroup crashed a host.
_RO = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV


@dataclass(frozen=True)
class Step:
    what: str
    call: object
    args: tuple


def _write_new(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@functools.cache
def _host_root() -> tuple[tuple[str, str | None], ...]:
    """(name, symlink target or None for a directory) for each host top-level dir that exists."""
    found = []
    for name in _HOST_DIRS:
        path = "/" + name
        if os.path.islink(path):
            found.append((name, os.readlink(path)))
        elif os.path.isdir(path):
            found.append((name, None))
    return tuple(found)


@functools.cache
def host_facts() -> dict:
    """What the plan and the children need of the host: which of the /etc entries, devices
    and /proc entries it knows exist here, and the last capability number."""
    return {
        "etc": tuple(p for p in _ETC_BINDS if os.path.exists("/etc/" + p)),
        "devices": tuple((d, os.stat("/dev/" + d).st_rdev) for d in _DEVICES if os.path.exists("/dev/" + d)),
        "proc_files": tuple(p for p in procfs.MASKED_FILES if os.path.isfile("/proc/" + p)),
        "proc_dirs": tuple(p for p in procfs.MASKED_DIRS if os.path.isdir("/proc/" + p)),
        "last_cap": linux.cap_last_cap(),
    }


def _etc_files(hostname: str) -> dict[str, bytes]:
    return {
        "passwd": b"root:x:0:0:root:/workspace:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": b"root:x:0:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n".encode(),
        "hostname": f"{hostname}\n".encode(),
        "nsswitch.conf": b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
                         b"protocols: files\nservices: files\n",
        "resolv.conf": b"",
    }


@functools.lru_cache(maxsize=64)
def plan(tmp_size_mb: int, workspace_size_mb: int, hostname: str, id_host: int = 0) -> tuple[Step, ...]:
    """Every step B takes to build the sandbox root on STAGE, pivot into it and seal it."""
    facts = host_facts()
    r = STAGE
    ids = userns.owner_options(id_host)
    steps: list[Step] = []

    def add(what: str, call, *args) -> None:
        steps.append(Step(what, call, args))

    def mount(what: str, source, target, fstype, flags, data=None) -> None:
        add(what, linux.mount, source, target, fstype, flags, data)

    def bind_ro(source: str, target: str) -> None:
        mount(f"bind {source}", source, target, None, linux.MS_BIND)
        mount(f"make {source} read-only", None, target, None, linux.MS_REMOUNT | linux.MS_BIND | _RO)

    mount("make all mounts private", None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    mount("mount root tmpfs", "sandbox", r, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=16m,mode=0755" + ids)
    for name, link in _host_root():
        if link is not None:
            add(f"symlink /{name}", os.symlink, link, f"{r}/{name}")
        else:
            add(f"mkdir /{name}", os.mkdir, f"{r}/{name}", 0o755)
            bind_ro(f"/{name}", f"{r}/{name}")

    add("mkdir /etc", os.mkdir, f"{r}/etc", 0o755)
    for name, content in _etc_files(hostname).items():
        add(f"write /etc/{name}", _write_new, f"{r}/etc/{name}", content, 0o644)
    for rel in facts["etc"]:
        target = f"{r}/etc/{rel}"
        if os.path.isdir("/etc/" + rel):
            add(f"mkdir /etc/{rel}", os.makedirs, target, 0o755)
        else:
            add(f"create /etc/{rel}", _write_new, target, b"", 0o644)
        bind_ro(f"/etc/{rel}", target)

    # Device nodes are made, not bound: a bound host inode could be chmod-ed by its owner, uid 0
    # (without a user namespace; with one, they are the host's uid 0's, whom nothing inside is).
    add("mkdir /dev", os.mkdir, f"{r}/dev", 0o755)
    mount("mount /dev tmpfs", "dev", f"{r}/dev", "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "size=64k,mode=0755" + ids)
    for name, rdev in facts["devices"]:
        add(f"mknod /dev/{name}", os.mknod, f"{r}/dev/{name}", 0o666 | stat.S_IFCHR, rdev)
        # 0666 whatever the umask: with a user namespace the sandbox's root is "others" to them
        add(f"chmod /dev/{name}", os.chmod, f"{r}/dev/{name}", 0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        add(f"symlink /dev/{name}", os.symlink, target, f"{r}/dev/{name}")
    # A devpts of its own, as a container has: the node opens terminals for it here (its ptmx),
    # so `tty` inside names /dev/pts/N, and the sandbox may make ptys of its own (tmux, script).
    add("mkdir /dev/pts", os.mkdir, f"{r}/dev/pts", 0o755)
    mount("mount /dev/pts", "devpts", f"{r}/dev/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
          "newinstance,ptmxmode=0666,mode=0620" + ids)
    add("symlink /dev/ptmx", os.symlink, "pts/ptmx", f"{r}/dev/ptmx")
    add("mkdir /dev/shm", os.mkdir, f"{r}/dev/shm", 0o755)
    mount("mount /dev/shm", "shm", f"{r}/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
          f"size={max(1, tmp_size_mb // 4)}m,mode=1777" + ids)
    mount("make /dev read-only", None, f"{r}/dev", None,
          linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NOEXEC)

    # /proc is read-only as a whole: uid 0 owns its entries and could chmod host-global ones.
    add("mkdir /proc", os.mkdir, f"{r}/proc", 0o555)
    mount("mount /proc", "proc", f"{r}/proc", "proc", _RO | linux.MS_NOEXEC)
    for name in facts["proc_files"]:
        mount(f"mask /proc/{name}", f"{r}/dev/null", f"{r}/proc/{name}", None, linux.MS_BIND)
    for name in facts["proc_dirs"]:
        mount(f"mask /proc/{name}", "masked", f"{r}/proc/{name}", "tmpfs", _RO, "size=4k,mode=0555")

    for name, size, mode in (("tmp", tmp_size_mb, "1777"), ("workspace", workspace_size_mb, "0755")):
        add(f"mkdir /{name}", os.mkdir, f"{r}/{name}", 0o755)
        mount(f"mount /{name}", name, f"{r}/{name}", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
              f"size={size}m,mode={mode}" + ids)

    add("set hostname", socket.sethostname, hostname)
    add("chdir to the new root", os.chdir, r)
    add("pivot_root", linux.pivot_root, ".", ".")
    add("detach the host root", linux.umount2, ".", linux.MNT_DETACH)
    add("chdir /", os.chdir, "/")
    mount("make / read-only", None, "/", None, linux.MS_REMOUNT | linux.MS_BIND | _RO)
    return tuple(steps)

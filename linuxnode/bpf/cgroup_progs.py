"""Attaching, detaching and listing BPF programs on v2 cgroups, through libbpf.

bcc's own attach_func raises a bare Exception and cannot list what a cgroup holds, which a
restarted agent needs (a legacy cgroup attachment outlives the process that made it). So
these few calls go to libbpf.so.1 directly (libbcc links it, so it is there wherever bcc
is) and fail with OSError carrying the errno.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

BPF_F_ALLOW_MULTI = 1 << 1
_OBJ_NAME_LEN = 16
_NAME_OFFSET = 64  # offsetof(struct bpf_prog_info, name)
_RUN_TIME_OFFSET = 192  # offsetof(struct bpf_prog_info, run_time_ns); run_cnt follows
_BPF_STATS_RUN_TIME = 0
_INFO_SIZE = 256


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    u32p = ctypes.POINTER(ctypes.c_uint32)
    lib.bpf_prog_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint]
    lib.bpf_prog_detach2.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.bpf_prog_query.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint32, u32p, u32p, u32p]
    lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint32]
    lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p, u32p]
    lib.bpf_enable_stats.argtypes = [ctypes.c_int]
    return lib


_lib = _load()


def _check(rc: int, what: str) -> int:
    if rc < 0:
        code = -rc if rc != -1 else (ctypes.get_errno() or errno.EIO)  # libbpf 1.x returns -errno
        raise OSError(code, os.strerror(code), what)
    return rc


@contextmanager
def open_cgroup(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def attach(prog_fd: int, cgroup_fd: int, attach_type: int) -> bool:
    """Attach in multi mode (other programs on the cgroup keep running); False if already there."""
    rc = _lib.bpf_prog_attach(prog_fd, cgroup_fd, attach_type, BPF_F_ALLOW_MULTI)
    if rc < 0 and -rc in (errno.EEXIST, errno.EINVAL) and program_id(prog_fd) in attached_ids(cgroup_fd, attach_type):
        return False  # the kernel refuses the same program twice on one hook (EINVAL since 5.x)
    _check(rc, "bpf_prog_attach")
    return True


def detach(prog_fd: int, cgroup_fd: int, attach_type: int) -> bool:
    """Detach one program; False if it was not attached there."""
    try:
        _check(_lib.bpf_prog_detach2(prog_fd, cgroup_fd, attach_type), "bpf_prog_detach2")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return True


def attached_ids(cgroup_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached to this very cgroup (not inherited ones) for one hook."""
    size = 64
    while True:
        ids = (ctypes.c_uint32 * size)()
        count, flags = ctypes.c_uint32(size), ctypes.c_uint32(0)
        rc = _lib.bpf_prog_query(cgroup_fd, attach_type, 0, ctypes.byref(flags), ids, ctypes.byref(count))
        if rc < 0 and -rc == errno.ENOSPC:  # count now says how many there are
            size = max(count.value, size * 2)
            continue
        _check(rc, "bpf_prog_query")
        return list(ids[: count.value])


@dataclass(frozen=True)
class ProgramRef:
    """A loaded program found by id: an fd the caller must close, and its name."""

    id: int
    fd: int
    name: str


def program_by_id(prog_id: int) -> ProgramRef | None:
    """Open a program by id; None if it is gone."""
    try:
        fd = _check(_lib.bpf_prog_get_fd_by_id(prog_id), f"bpf_prog_get_fd_by_id {prog_id}")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    try:
        info = _info(fd)
    except BaseException:
        os.close(fd)
        raise
    raw = bytes(info[_NAME_OFFSET : _NAME_OFFSET + _OBJ_NAME_LEN])
    return ProgramRef(id=prog_id, fd=fd, name=raw.split(b"\0", 1)[0].decode(errors="replace"))


def program_id(prog_fd: int) -> int:
    info = _info(prog_fd)
    return ctypes.c_uint32.from_buffer(info, 4).value  # offsetof(struct bpf_prog_info, id)


def _info(prog_fd: int) -> ctypes.Array:
    info = (ctypes.c_ubyte * _INFO_SIZE)()
    size = ctypes.c_uint32(_INFO_SIZE)
    _check(_lib.bpf_obj_get_info_by_fd(prog_fd, info, ctypes.byref(size)), "bpf_obj_get_info_by_fd")
    return info


def enable_run_stats() -> int:
    """Count run time of every BPF program until the returned fd is closed (BPF_ENABLE_STATS)."""
    return _check(_lib.bpf_enable_stats(_BPF_STATS_RUN_TIME), "bpf_enable_stats")


def run_stats(prog_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program, counted while run stats are enabled."""
    info = _info(prog_fd)
    return (ctypes.c_uint64.from_buffer(info, _RUN_TIME_OFFSET).value,
            ctypes.c_uint64.from_buffer(info, _RUN_TIME_OFFSET + 8).value)

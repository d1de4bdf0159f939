"""A sandbox's file tree from the host: list, stat, mkdir, remove, rename.

Reads resolve in the sandbox's root (RESOLVE_IN_ROOT), changes beneath it (RESOLVE_BENEATH:
a path through a symlink pointing out is refused with `Escapes`); the last component is never
followed (a symlink is listed, removed or renamed as itself), and a listing never descends
through a symlink. Errors are the OSError subclasses of the failure (FileNotFoundError,
NotADirectoryError, ...).
"""

from __future__ import annotations

import os
import shutil
import stat

from linuxnode.process.model import InitProcess
from linuxnode.process.resolve import IN_ROOT, as_sandbox_root, check_path, open_in_sandbox, open_parent


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _entry(path: str, st: os.stat_result, target: str = "") -> dict:
    return {"path": path, "kind": _kind(st.st_mode), "size": st.st_size, "mode": stat.S_IMODE(st.st_mode),
            "mtime": st.st_mtime, "target": target}


def _split(path: str) -> tuple[str, str]:
    parent, _, name = check_path(path).rstrip("/").rpartition("/")
    return parent or "/", name


def stat_path(init: InitProcess, path: str) -> dict:
    parent, name = _split(path)
    if not name:
        fd = open_in_sandbox(init, "/", os.O_PATH | os.O_DIRECTORY, IN_ROOT)
        try:
            return _entry("/", os.fstat(fd))
        finally:
            os.close(fd)
    fd = open_in_sandbox(init, parent, os.O_PATH | os.O_DIRECTORY, IN_ROOT)
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
        return _entry(check_path(path).rstrip("/") or "/", st, target)
    finally:
        os.close(fd)


def list_dir(init: InitProcess, path: str, depth: int, limit: int) -> tuple[list[dict], bool]:
    """Entries under the directory `path`, `depth` levels down, at most `limit` (and whether more)."""
    top = check_path(path).rstrip("/") or "/"
    fd = open_in_sandbox(init, top, os.O_RDONLY | os.O_DIRECTORY, IN_ROOT)
    entries: list[dict] = []
    try:
        truncated = _walk(fd, top.rstrip("/"), depth, limit, entries)
    finally:
        os.close(fd)
    return entries, truncated


def _walk(dirfd: int, prefix: str, depth: int, limit: int, out: list[dict]) -> bool:
    for name in sorted(os.listdir(dirfd)):
        if len(out) >= limit:
            return True
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        target = os.readlink(name, dir_fd=dirfd) if stat.S_ISLNK(st.st_mode) else ""
        out.append(_entry(f"{prefix}/{name}", st, target))
        if depth > 1 and stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            try:
                if _walk(sub, f"{prefix}/{name}", depth - 1, limit, out):
                    return True
            finally:
                os.close(sub)
    return False


def mkdir(init: InitProcess, path: str, parents: bool, mode: int) -> None:
    path = check_path(path).rstrip("/")
    names = [p for p in path.split("/") if p]
    start = 0 if parents else len(names) - 1
    for i in range(max(start, 0), len(names)):
        parent, name = open_parent(init, "/" + "/".join(names[:i + 1]))
        try:
            with as_sandbox_root(init):
                os.mkdir(name, mode & 0o7777, dir_fd=parent)
        except FileExistsError:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            last = i == len(names) - 1
            if not parents and last:
                raise
            if not stat.S_ISDIR(st.st_mode) and not (stat.S_ISLNK(st.st_mode) and not last):
                raise NotADirectoryError(20, "Not a directory", "/" + "/".join(names[:i + 1])) from None
        finally:
            os.close(parent)


def remove(init: InitProcess, path: str, recursive: bool) -> None:
    parent, name = open_parent(init, path)
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
        elif recursive:
            shutil.rmtree(name, dir_fd=parent)  # fd-based: never follows a symlink
        else:
            os.rmdir(name, dir_fd=parent)
    finally:
        os.close(parent)


def rename(init: InitProcess, src: str, dst: str) -> None:
    src_parent, src_name = open_parent(init, src)
    try:
        dst_parent, dst_name = open_parent(init, dst)
        try:
            os.rename(src_name, dst_name, src_dir_fd=src_parent, dst_dir_fd=dst_parent)
        finally:
            os.close(dst_parent)
    finally:
        os.close(src_parent)

"""Watching a sandbox directory from the host: the directory is opened with RESOLVE_IN_ROOT from
the init's root and watched by that fd's inode (inotify through /proc/self/fd), so a symlink
never leads the watch out. With `recursive`, subdirectories are watched too (opened O_NOFOLLOW
from their parent, never through a symlink), up to `max_dirs` of them.

Events come out as (kind, path, is_dir): `created`, `modified`, `removed`, `overflow` (the
kernel's queue overflowed: events were lost) and `ended` (the watched directory went away).
"""

from __future__ import annotations

import os

from linuxnode import inotify
from linuxnode.process.model import InitProcess
from linuxnode.process.resolve import IN_ROOT, check_path, open_in_sandbox

_MASK = (inotify.IN_CREATE | inotify.IN_MOVED_TO | inotify.IN_MODIFY | inotify.IN_CLOSE_WRITE | inotify.IN_DELETE
         | inotify.IN_MOVED_FROM | inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF)
_CREATED = inotify.IN_CREATE | inotify.IN_MOVED_TO
_REMOVED = inotify.IN_DELETE | inotify.IN_MOVED_FROM
_MODIFIED = inotify.IN_MODIFY | inotify.IN_CLOSE_WRITE

Change = tuple[str, str, bool]


class DirWatch:
    def __init__(self, init: InitProcess, path: str, recursive: bool, max_dirs: int) -> None:
        self.init = init
        self.top = check_path(path).rstrip("/") or "/"
        self.recursive, self.max_dirs = recursive, max_dirs
        self.ino = inotify.Inotify()
        self.dirs: dict[int, str] = {}  # watch descriptor -> the directory's sandbox path
        self.ended = False
        try:
            fd = open_in_sandbox(init, self.top, os.O_RDONLY | os.O_DIRECTORY, IN_ROOT)
            try:
                self._add(fd, self.top)
            finally:
                os.close(fd)
        except BaseException:
            self.ino.close()
            raise

    @property
    def fd(self) -> int:
        return self.ino.fd

    def _add(self, fd: int, where: str) -> None:
        if len(self.dirs) >= self.max_dirs:
            return  # bounded: deeper directories go unwatched
        self.dirs[self.ino.add(fd, _MASK)] = where
        if not self.recursive:
            return
        for name in sorted(os.listdir(fd)):
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                continue  # not a directory (or a symlink to one), or gone
            try:
                self._add(sub, f"{where.rstrip('/')}/{name}")
            finally:
                os.close(sub)

    def changes(self) -> list[Change]:
        out: list[Change] = []
        for event in self.ino.read():
            if event.mask & inotify.IN_Q_OVERFLOW:
                out.append(("overflow", self.top, False))
                continue
            where = self.dirs.get(event.wd)
            if where is None:
                continue
            if event.mask & inotify.IN_IGNORED:
                self.dirs.pop(event.wd, None)
                if where == self.top and not self.ended:
                    self.ended = True
                    out.append(("ended", self.top, True))
                continue
            if event.mask & (inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF):
                if where == self.top and not self.ended:
                    self.ended = True
                    out.append(("ended", self.top, True))
                continue
            path = f"{where.rstrip('/')}/{event.name}"
            is_dir = bool(event.mask & inotify.IN_ISDIR)
            if event.mask & _CREATED:
                out.append(("created", path, is_dir))
                if is_dir and self.recursive:
                    self._watch_new(path)
            elif event.mask & _REMOVED:
                out.append(("removed", path, is_dir))
            elif event.mask & _MODIFIED and not is_dir:
                out.append(("modified", path, False))
        return out

    def _watch_new(self, path: str) -> None:
        """A directory created under a watched one (resolved again in the root, its last
        component not followed: a symlink swapped in meanwhile is not watched)."""
        try:
            fd = open_in_sandbox(self.init, path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, IN_ROOT)
        except (OSError, ValueError):
            return  # gone again, or not a directory now
        try:
            self._add(fd, path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.ino.close()

"""The runtime seam: what a driver (one per isolation level) does for the launcher, and the
typed outcomes and errors it answers with.

A driver owns every operation a sandbox supports on a node: start and stop it, run a
command in it, read and write its files, freeze and thaw it, change its CPU weight, give a
checkpoint its writable layer, and tell whether a sandbox recorded before a restart still
runs and take it back. The launcher orchestrates (records, confinement, roots, timeouts,
quarantine) and never reaches into what a driver made: `start` returns an opaque
`Instance` the launcher keeps and hands back to every later call; the only thing it reads
from it is the `Anchor` it records, so that a restarted launcher can find the sandbox again.

Namespace levels (`process`, `container`) implement it by entering the sandbox from the
host (setns, openat2, cgroup files); a VM level would implement it through its guest agent
(over virtio-serial) and its hypervisor process, the anchor being that process.

How a new level plugs in: one module in this package with a class implementing `Driver`
(its own `Instance` type inside), and one line in `Drivers.open` (drivers/__init__.py)
that registers it under its level name where the node can run it. Later operations
(streamed exec, background processes with stdin and re-attach, PTYs, port forwarding) are
new methods here, implemented by each driver; the launcher's orchestration stays as it is.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field
import socket
from pathlib import Path
from typing import Protocol

from linuxnode.process import InitProcess
from schemas.layers import Rootfs
from schemas.node import Confinement
from schemas.sandbox import SandboxSpec


class LaunchRefused(Exception):
    """This node cannot start what was asked (a level it lacks, a container without a root)."""


class StartFailed(Exception):
    """The runtime could not start the sandbox; the message names the step and why."""


class ExecFailed(Exception):
    """The command could not be started in the sandbox (its init is gone, a join failed)."""


class SandboxGone(Exception):
    """The sandbox's processes are gone: there is nothing left to read, write or run in."""


class DriverFailure(Exception):
    """The runtime failed in a way the caller cannot fix (a freeze that never settled)."""


class Unsupported(Exception):
    """This sandbox cannot do what was asked on this node (no CPU weight file to change)."""


class NoWritableLayer(Exception):
    """The sandbox has no writable layer of its own to pack (it runs on the host view)."""


@dataclass(frozen=True)
class Anchor:
    """What a sandbox's record keeps of its instance: the host process that holds it (an init,
    later a hypervisor) and that process's start time, so a recycled pid never matches."""

    pid: int
    start_time: int

    def process(self) -> InitProcess:
        """The host process it names, as the process runtime checks and ends one."""
        return InitProcess(pid=self.pid, start_time=self.start_time)


class Instance(Protocol):
    """A running sandbox as its driver made it; opaque to the launcher but for its anchor."""

    @property
    def anchor(self) -> Anchor: ...


@dataclass(frozen=True)
class Command:
    """One command to run to its end in a sandbox, its output captured."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "/workspace"
    stdin: bytes = b""
    timeout_s: float = 60.0
    max_output: int = 1 << 20  # a background command's: its output buffer (reads of at most half)
    uid: int = -1  # who it runs as in the sandbox (an image's `User`); -1: the sandbox's root
    gid: int = -1


@dataclass(frozen=True)
class ExecOutcome:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool


@dataclass(frozen=True)
class CpuWeight:
    """The weight a hint set: where it was written and the value."""

    file: str
    value: int


@dataclass(frozen=True)
class Usage:
    """What a sandbox uses now (see schemas/health.py for each figure); -1 where unreadable."""

    cpu_s: float
    memory_bytes: int
    memory_peak_bytes: int
    memory_limit_bytes: int
    disk_bytes: int
    processes: int
    interfaces: list[tuple[str, int, int]]  # (name, rx bytes, tx bytes) of each interface of its netns


class RunningCommand(Protocol):
    """A background command as a driver runs it (see the driver's `spawn`)."""

    os_pid: int | None  # as the sandbox sees it
    stdin_open: bool

    async def write(self, data: bytes) -> int:
        """All of data to its stdin, waiting while the pipe is full; StdinClosed if it is closed."""

    def close_stdin(self) -> None: ...

    def signal(self, number: int) -> bool:
        """To its process group; False if it has ended."""

    def close(self) -> None:
        """Stop reading its output; kill it if it still runs."""


class RunningTerminal(RunningCommand, Protocol):
    """A background command on a terminal (see the driver's `spawn_terminal`)."""

    def resize(self, cols: int, rows: int) -> bool:
        """Its window size (the foreground job gets SIGWINCH); False if it has ended."""


class StdinClosed(Exception):
    """A background command's stdin is closed (by the caller, or the command ended)."""


class Driver(Protocol):
    """One isolation level. File operations raise OSError subclasses with the errno of the
    failure (FileNotFoundError, PermissionError, IsADirectoryError...), ValueError for a path or
    file the request cannot have, and SandboxGone when the sandbox has ended."""

    async def start(self, sandbox_id: str, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance: ...

    async def stop(self, sandbox_id: str, anchor: Anchor | None) -> None:
        """End the sandbox and remove what the runtime keeps of it; idempotent. It works from the
        anchor alone (or none), since after a restart the record is all there is."""

    def alive(self, anchor: Anchor) -> bool:
        """Whether the recorded instance still runs (a restarted launcher re-adopts it)."""

    async def adopt(self, sandbox_id: str, anchor: Anchor, spec: SandboxSpec, confinement: Confinement,
                    rootfs: Rootfs | None) -> Instance:
        """The instance of a sandbox that outlived the launcher, as `start` would have made it."""

    def watch(self, instance: Instance, on_exit: Callable[[], None]) -> Callable[[], None]:
        """Call `on_exit` (on the event loop) when the sandbox ends on its own; returns the unwatch."""

    def why_ended(self, instance: Instance) -> str:
        """Why a sandbox that ended on its own ended, when the node knows more than that its
        init is gone (a VM the node killed for breaking its protocol): the record's `detail`."""

    async def exec(self, instance: Instance, command: Command) -> ExecOutcome: ...

    def read_file(self, instance: Instance, path: str, max_bytes: int) -> bytes: ...

    def write_file(self, instance: Instance, path: str, data: bytes, mode: int) -> int: ...

    async def freeze(self, instance: Instance) -> None:
        """Stop every process of the sandbox until `thaw`; a kill still ends it. Raises OSError if
        the sandbox is going away, DriverFailure if the freeze did not settle."""

    async def thaw(self, instance: Instance) -> None: ...

    def set_cpu_weight(self, instance: Instance, idle: bool) -> CpuWeight:
        """The sandbox's relative CPU weight, lowest when idle (its CPU limit stays); Unsupported
        if this sandbox has none to change."""

    def writable_layer(self, instance: Instance) -> Path:
        """The directory holding everything the sandbox wrote over its layers, to be packed into a
        layer while the sandbox is frozen; NoWritableLayer if it has none."""

    async def leftovers(self, keep: set[str]) -> list[str]:
        """Remove what a crash left of sandboxes not in `keep`; their ids."""

    def close(self) -> None: ...

    # -- health: what a sandbox uses, read from outside it ------------------------------------

    async def usage(self, instance: Instance) -> Usage:
        """CPU time, memory, disk of its writable layer, processes and network bytes, read from
        outside the sandbox (a VM level asks its hypervisor and guest agent); SandboxGone if it
        has ended."""

    # -- background processes (issue 12: processes) --------------------------------------

    async def spawn(self, instance: Instance, command: Command, on_output: Callable[[int, bytes], None],
                    on_exit: Callable[[int], None]) -> RunningCommand:
        """Start a command in the background (its `stdin` and `timeout_s` unused: stdin stays
        open for writes, the caller ends it). `on_output(stream, chunk)` with stream 1 or 2 as it
        comes, `on_exit(wait_status)` once. Raises as `exec` does for what cannot start."""
    # -- ports: forwarding a TCP connection to the sandbox's own ports ---------------------

    async def connect_port(self, instance: Instance, host: str, port: int) -> socket.socket:
        """A non-blocking TCP socket connected to `port` of the sandbox itself: its loopback
        (`host` "127.0.0.1", "::1", "localhost") or its own egress address ("own"). Nothing else
        is reachable through it (not the host, not another sandbox). ConnectionRefusedError when
        nobody listens there, Unsupported for "own" without an egress address, SandboxGone when
        the sandbox has ended."""

    async def port_listens(self, instance: Instance, host: str, port: int) -> bool:
        """Whether something listens on `port` at that address of the sandbox (as `connect_port`
        names it), found without connecting; SandboxGone when the sandbox has ended. Awaited: a
        VM's guest is asked over its channel."""
    # -- files: uploads and downloads of any size, the file tree -----------------------------

    def open_upload(self, instance: Instance, path: str, kind: str, mode: int, depth: int) -> UploadSink:
        """Where an upload of a file (`kind` "file") or a tar stream ("dir") to `path` is written;
        nothing is visible at `path` until `commit`. Blocking: call it off the event loop. An
        escaping path raises ValueError (linuxnode's Escapes) and changes nothing."""

    def open_download(self, instance: Instance, path: str, chunk: int, depth: int) -> DownloadSource:
        """What a download of `path` reads: its bytes, or a directory as a tar stream. Blocking."""

    def file_op(self, instance: Instance, op: str, *args) -> object:
        """One operation on the sandbox's tree, by name: `stat` (path) and `list` (path, depth,
        limit) answer entries as dicts of schemas.files.Entry's fields; `mkdir` (path, parents,
        mode), `remove` (path, recursive), `rename` (src, dst). Blocking; reads resolve in the
        root, changes beneath it (an escaping path raises ValueError and changes nothing)."""

    def open_watch(self, instance: Instance, path: str, recursive: bool, max_dirs: int) -> DirectoryWatch:
        """An inotify watch of the directory `path` resolved in the sandbox's root."""

    # -- PTY: a background command on a terminal the node holds -----------------------------

    async def spawn_terminal(self, instance: Instance, command: Command, cols: int, rows: int,
                             on_output: Callable[[int, bytes], None],
                             on_exit: Callable[[int], None]) -> RunningTerminal:
        """`spawn`, but its stdin, stdout and stderr are one terminal of `cols` x `rows` (1..1000)
        whose master the node holds, the command leading a session with it as controlling tty;
        its output comes as stream 1. ValueError for a bad size; ExecFailed if the sandbox has no
        terminals (no devpts of its own)."""


class DirectoryWatch(Protocol):
    """Readable on `fd` when changes are queued; `changes` drains them without blocking, as
    (kind, path, is_dir) with kind created/modified/removed, overflow or ended."""

    fd: int

    def changes(self) -> list[tuple[str, str, bool]]: ...

    def close(self) -> None: ...


class UploadSink(Protocol):
    """One upload being written; methods block and are called one at a time."""

    size: int

    def write(self, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None:
        """Remove whatever was written; idempotent."""


class DownloadSource(Protocol):
    """One download being read a chunk at a time (b"" at its end); methods block."""

    kind: str  # "file" or "dir"
    size: int  # of a file; -1 for a tree's tar stream
    mode: int
    sent: int

    def read(self) -> bytes: ...

    def close(self) -> None: ...


def reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (adopted after a restart): the supervisor reaps it


def watch_exit(pid: int, on_exit: Callable[[], None]) -> Callable[[], None]:
    """Call `on_exit` once, on the running loop, when process `pid` has ended (its pidfd turns
    readable; at once if it is gone already), reaping it first where it is our child. Returns
    what stops the watch: every driver's `watch` for a sandbox that is one host process."""
    loop = asyncio.get_running_loop()
    watching: list[int] = []

    def unwatch() -> None:
        if watching:
            loop.remove_reader(watching[0])
            os.close(watching.pop())

    def exited() -> None:
        unwatch()
        reap(pid)
        on_exit()

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return loop.call_soon(exited).cancel
    watching.append(pidfd)
    loop.add_reader(pidfd, exited)
    return unwatch

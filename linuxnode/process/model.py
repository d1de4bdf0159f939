"""What callers of the `process` runtime pass in and get back, its two errors, and the fixed
init binary and default environment every sandbox process is given."""

from __future__ import annotations

from dataclasses import dataclass

CATATONIT = "/usr/bin/catatonit"
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/workspace",
    "LANG": "C.UTF-8",
    # System content is read-only under Landlock: Python writing .pyc next to /usr modules
    # would be refused and reported as a `file.landlock` violation on every import.
    "PYTHONDONTWRITEBYTECODE": "1",
}


class RuntimeStartError(RuntimeError):
    """The sandbox init could not be started; the message names the step and the errno."""


class ExecError(RuntimeError):
    """The command could not be started in the sandbox (init gone, cgroup or namespace join failed)."""


@dataclass(frozen=True)
class ProcessSpec:
    sandbox_id: str
    cgroup_procs: list[str]
    netns: str
    tmp_size_mb: int = 256
    workspace_size_mb: int = 1024
    hostname: str = "sandbox"
    rootfs_dir: str | None = None  # a composed root (see linuxnode.layered_root); None: the host view
    # The root as a detached mount tree (an fd, the caller's to close), cloned where it is mounted
    # (linuxnode.roots_ns.RootsView.clone); -1: cloned from `rootfs_dir` in the caller's namespace.
    root_tree: int = -1
    apparmor_profile: str = ""  # loaded by the node agent where the kernel runs AppArmor
    # The host uid/gid that is root inside (linuxnode.userns); 0: no user namespace, root is the host's.
    id_host: int = 0


@dataclass(frozen=True)
class InitProcess:
    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat: a recycled pid never matches it


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool

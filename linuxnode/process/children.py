"""What the spawner's forked children do: B, the sandbox's init, and C, the exec helper that
spawns one command inside the sandbox. They run only os/ctypes code between fork and exec,
report "step: errno message" on a close-on-exec pipe, and leave by exec or os._exit."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal

from linuxnode import landlock, userns
from linuxnode import syscalls as linux
from linuxnode.process.model import CATATONIT, DEFAULT_ENV
from linuxnode.process.protocol import ExecCommand, SpawnCommand, StartInit, TerminalCommand
from linuxnode.process.reports import READY, command_record, report_failure, status_record

_LANDLOCK_ABI = landlock.abi()  # asked once, in the spawner: 0 where the kernel has none
# Opt every sandbox process in to KSM page merging (inherited over fork and exec); ksmd only
# merges while the node's reclaimer runs it (services/reclaimer). Needs CAP_SYS_RESOURCE.
PR_SET_MEMORY_MERGE = 67
# What a build sandbox's root keeps (linux/capability.h numbers): what dpkg and apt need to
# install files as their packages own them (chown, fowner, fsetid, dac_override) and to run
# apt's download methods as `_apt` (setuid, setgid, kill). Each holds only within the
# sandbox's user namespace, over ids it maps; nothing to mount, trace or reach the host with.
CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID, CAP_SETUID = 0, 1, 3, 4, 5, 6, 7
BUILD_CAPABILITIES = frozenset((CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID, CAP_SETUID))
_ENTER_NS = linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWCGROUP


def _join_cgroups(paths: tuple[str, ...]) -> None:
    for path in paths:  # "0" is the writer itself, whatever pid namespace it is in
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _tag_for_audit(cgroup_procs: tuple[str, ...]) -> None:
    """Name the sandbox in the audit records of its processes (see landlock.audit_tag)."""
    with contextlib.suppress(OSError):  # attribution only: the agent falls back to /proc/<pid>/cgroup
        landlock.set_audit_tag(landlock.audit_tag(cgroup_procs))


def _exec_under_apparmor(profile: str) -> None:
    """Run the next exec under `profile` (the kernel's attr/exec interface, which crun also
    uses; inherited by a fork, so a command posix_spawned after this takes it on). Written while
    /proc is still the host's, before the pid, mount and root change."""
    if not profile:
        return
    for path in ("/proc/thread-self/attr/apparmor/exec", "/proc/thread-self/attr/exec"):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.write(fd, f"exec {profile}".encode())
        finally:
            os.close(fd)
        return
    raise FileNotFoundError(errno.ENOENT, "the kernel has no AppArmor attr/exec", profile)


def _drop_privileges(last_cap: int, seccomp: bytes, user: int = -1, ids: tuple[int, int] = (-1, -1),
                     build: bool = False) -> None:
    """Keep nothing of the spawner across exec but fds 0-2; the sandbox's user namespace
    (`user`, an fd; -1: none), the uid and gid `ids` in it (an image's `User`; -1: its root),
    no capabilities, no_new_privs, the Landlock policy of the root this process now has
    (linuxnode.landlock), and the sandbox seccomp filter (linuxnode.seccomp), installed last.
    `build`: a build sandbox's command, whose root keeps BUILD_CAPABILITIES (its bounding set
    and no_new_privs keep the same at exec) and may write all of its root."""
    linux.restore_signals()  # an empty mask (the spawner's may block some)
    linux.close_range_cloexec(3)
    os.umask(0o022)
    with contextlib.suppress(OSError):  # EINVAL on a kernel without KSM: nothing to merge, nothing lost
        linux.prctl(PR_SET_MEMORY_MERGE, 1)  # needs CAP_SYS_RESOURCE in the host's namespace: before `user`
    if build and user < 0:  # capabilities here would be the host's
        raise PermissionError(errno.EPERM, "a build command needs the sandbox's user namespace")
    if user >= 0:
        userns.enter(user)
    keep = BUILD_CAPABILITIES if build else frozenset()
    linux.drop_bounding_set(last_cap, keep)  # while still root: it takes CAP_SETPCAP
    uid, gid = ids
    if uid >= 0:  # giving up root clears the effective and permitted sets by itself
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        keep = frozenset()
    linux.clear_capabilities(keep)
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    landlock.confine_sandbox(_LANDLOCK_ABI, build)
    if seccomp:
        linux.install_seccomp(seccomp)


def init_child(request: StartInit, plan, last_cap: int, seccomp: bytes, user: int = -1) -> None:
    """B: pid 1 of the new pid namespace. Its other namespaces are made and its root built as
    the host's root; the user namespace (`user`, -1: none) is joined last. Never returns."""
    report = request.report
    step = "join cgroups"
    try:
        _join_cgroups(request.cgroup_procs)
        _tag_for_audit(request.cgroup_procs)
        step = "set the AppArmor profile"
        _exec_under_apparmor(request.apparmor)
        step = "enter netns"
        linux.setns(request.netns, linux.CLONE_NEWNET)
        step = "unshare namespaces"
        linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWCGROUP)
        for item in plan:
            step = item.what
            item.call(*item.args)
        step = "stdio"
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        step = "drop privileges"
        _drop_privileges(last_cap, seccomp, user)
        step = f"exec {CATATONIT}"
        if not os.access(CATATONIT, os.X_OK):
            raise FileNotFoundError(errno.ENOENT, "not executable in the sandbox", CATATONIT)
        # Ready now rather than at exec, which first tears down this copy of the spawner.
        os.write(report, READY)
        os.close(report)
        os.execve(CATATONIT, ["catatonit", "-P"], {"PATH": DEFAULT_ENV["PATH"]})
    except BaseException as exc:
        report_failure(report, step, exc)
    os._exit(127)


_SPAWN_DEFAULT_SIGNALS = tuple(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})


def exec_child(request: ExecCommand, last_cap: int, seccomp: bytes) -> None:
    """C: enters the sandbox, vfork-spawns the command into its pid namespace, waits for it
    and writes its status. C stays outside the pid namespace, so the sandbox never sees it.
    SIGTERM (the spawner, on timeout or cancel) kills the command's process group. Never returns."""
    report, pidfd, root, argv, env = request.report, request.pidfd, request.root, request.argv, request.env
    stdio = (request.stdin, request.stdout, request.stderr)
    control = request.control if isinstance(request, SpawnCommand) else -1
    command, killed = 0, False

    def kill_command() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(command, signal.SIGKILL)  # not reaped yet, so the group is still its own

    def terminate(*_) -> None:
        nonlocal killed
        killed = True
        if command:
            kill_command()

    signal.signal(signal.SIGTERM, terminate)
    signal.set_wakeup_fd(-1)
    step = "close inherited fds"
    try:
        _close_all_but({report, pidfd, root, *stdio, control} - {-1})  # C lives as long as the command: hold nothing else
        step = "join cgroups"
        _join_cgroups(request.cgroup_procs)
        _tag_for_audit(request.cgroup_procs)
        step = "set the AppArmor profile"
        _exec_under_apparmor(request.apparmor)
        step = "enter namespaces"
        user = _user_namespace_of(pidfd)  # joined last, by _drop_privileges: see init_child
        linux.setns(pidfd, _ENTER_NS | linux.CLONE_NEWPID)
        step = "enter root"
        os.fchdir(root)
        os.chroot(".")
        step = "chdir " + request.cwd
        os.chdir(request.cwd)
        step = "drop privileges"
        _drop_privileges(last_cap, seccomp, user, (request.uid, request.gid), request.build)
        step = "spawn"
        path, code = _which(argv[0], env.get("PATH", ""))
        if killed:
            os._exit(1)
        if path is not None:
            try:
                if isinstance(request, TerminalCommand):
                    command = _spawn_on_terminal(path, argv, env, stdio)
                else:
                    command = os.posix_spawn(
                        path, argv, env, setsid=True, setsigdef=_SPAWN_DEFAULT_SIGNALS, setsigmask=(),
                        file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)],
                    )
                if killed:  # SIGTERM arrived while spawning
                    kill_command()
                elif control >= 0:
                    os.write(report, command_record(command))
            except OSError as exc:
                code = 127 if exc.errno in (errno.ENOENT, errno.ENOTDIR) else 126
                os.write(stdio[2], f"sandbox: {argv[0]}: {exc.strerror}\n".encode(errors="replace"))
        else:
            why = "command not found" if code == 127 else "Permission denied"
            os.write(stdio[2], f"sandbox: {argv[0]}: {why}\n".encode(errors="replace"))
        for fd in stdio:
            os.close(fd)
        if command and control >= 0:
            _forward_signals(command, control)
        status = os.waitpid(command, 0)[1] if command else code << 8
        os.write(report, status_record(status))
        os.close(report)
    except BaseException as exc:
        report_failure(report, step, exc)
        os._exit(1)
    os._exit(0)


TIOCSCTTY = 0x540E  # the same number on every Linux architecture we run (asm-generic)


def _spawn_on_terminal(path: str, argv: tuple[str, ...], env: dict[str, str], stdio: tuple[int, int, int]) -> int:
    """Fork the command as the leader of a new session whose controlling terminal is the pty
    slave `stdio` holds, then exec it: posix_spawn can setsid but has no TIOCSCTTY step. The
    slave came from the launcher (TIOCGPTPEER on the master it opened), so it is never looked
    up by a path the sandbox could change. Returns once the child has exec'd or died (as
    posix_spawn does), so its session exists for every signal sent after. An exec that fails
    says so on the terminal and exits 127 or 126, as a command spawned the other way would.
    Every fd past stdio is close-on-exec already (_drop_privileges)."""
    execd_r, execd_w = os.pipe2(os.O_CLOEXEC)  # EOF once the child exec'd or ended
    command = os.fork()
    if command:
        os.close(execd_w)
        os.read(execd_r, 1)
        os.close(execd_r)
        return command
    try:
        os.setsid()
        fcntl.ioctl(stdio[0], TIOCSCTTY, 0)
        for number in _SPAWN_DEFAULT_SIGNALS:  # SIG_IGN would survive exec (the spawner ignores SIGINT)
            with contextlib.suppress(OSError, ValueError):
                signal.signal(number, signal.SIG_DFL)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        os.execve(path, argv, env)
    except OSError as exc:
        code = 127 if exc.errno in (errno.ENOENT, errno.ENOTDIR) else 126
        with contextlib.suppress(OSError):
            os.write(2, f"sandbox: {argv[0]}: {exc.strerror}\r\n".encode(errors="replace"))
        os._exit(code)
    except BaseException:
        os._exit(126)
    os._exit(126)  # not reached: execve returned


def _forward_signals(command: int, control: int) -> None:
    """Until the command exits, send each signal number read from `control` to its process
    group; the launcher closing `control` (it went away) leaves the command running."""
    import select  # a built-in module: nothing is read from disk in the sandbox's root

    exited = os.pidfd_open(command)
    poll = select.poll()
    poll.register(exited, select.POLLIN)
    poll.register(control, select.POLLIN)
    while True:
        ready = dict(poll.poll())
        if exited in ready:
            return
        if control in ready:
            data = os.read(control, 64)
            if not data:
                poll.unregister(control)
            for number in data:
                with contextlib.suppress(ProcessLookupError, OSError):
                    os.killpg(command, number)  # not reaped yet, so the group is still its own


def _user_namespace_of(pidfd: int) -> int:
    """An fd of the init's user namespace if it is not this process's own, else -1. Asked of the
    kernel (PIDFD_GET_USER_NAMESPACE, Linux 6.11+; before setns, while /proc is the host's), so
    a sandbox started before a restart, or by a runtime that made its own (crun), is entered
    the same way; ENOTTY on older kernels, where no sandbox has one of ours."""
    try:
        fd = fcntl.ioctl(pidfd, userns.PIDFD_GET_USER_NAMESPACE)
    except OSError as exc:
        if exc.errno == errno.ENOTTY:
            return -1
        raise
    if os.fstat(fd).st_ino == os.stat("/proc/self/ns/user").st_ino:
        os.close(fd)
        return -1
    return fd


def _close_all_but(keep: set[int]) -> None:
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 30)


def _which(name: str, search: str) -> tuple[str | None, int]:
    """The file execvp would run, else (None, 127 if nothing is there, 126 if not executable)."""
    if "/" in name:
        return name, 0
    code = 127
    for directory in search.split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate, 0
        if os.path.exists(candidate):
            code = 126
    return None, code

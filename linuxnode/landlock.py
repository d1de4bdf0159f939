"""Landlock for sandbox processes: the one file-access policy every sandbox process runs
under, built and applied by the process itself (Landlock only ever restricts its caller),
through ctypes so the spawner's forked children can call it (os and ctypes only; symbols
resolved at import).

The policy, evaluated inside the sandbox's root after pivot_root/chroot (Landlock rules
name inodes, and a restricted process may no longer change its mounts):
- `/` and everything below it: read, list and execute. That is the sandbox's own root and
  nothing else: other sandboxes, the platform's data dir and the host are not beneath any
  rule, so even a path that reached them (a leaked fd, a bind mount, a namespace escape)
  is refused.
- system content stays read-only: `/usr`, `/bin`, `/sbin`, `/lib*`, `/etc`, `/opt`,
  `/boot` (overwriting `/bin/bash` or shadowing a tool in `/usr/local/bin` is refused and
  logged, even where the overlay root itself is writable), as do `/proc`, `/sys`, `/dev`.
- every other top-level directory the root has when the sandbox starts (`/workspace`,
  `/tmp`, `/var`, `/home`, `/root`, `/run`, a task's own `/app`...) gets every access, as
  does `/dev/shm`; the device nodes under `/dev` may be written (`> /dev/null`).
- nothing may be created, renamed or removed at the top level.
A build sandbox (SandboxSpec.build: a Dockerfile RUN, a package manager) gets write on the
whole of its root instead, top level and system content included: what keeps it in is still
that nothing outside its root is beneath a rule, and the kernel's own checks on /proc and /sys,
whose files its root (an unprivileged host id) does not own.
Network (TCP bind/connect) is not handled here: the node agent's eBPF allowlists own it,
with the DNS stub that opens allowed names, and Landlock cannot follow those rules. Scoping
of signals and abstract sockets is off too: every exec gets a Landlock domain of its own,
and a scoped domain could not signal a process an earlier exec left running.

With ABI 7 the domain logs its denials to audit (LOG_NEW_EXEC_ON: the sandbox is always a
later exec); the node agent reads them (agents/node/audit.py). Each sandbox process also
gets an audit login uid derived from its cgroups (`audit_tag`), so a denial names its
sandbox even after the process that caused it is gone.
"""

from __future__ import annotations

import ctypes
import os
import stat
import zlib

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

_NR = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}.get(os.uname().machine)

CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1  # ABI 7

READ = EXECUTE | READ_FILE | READ_DIR
_MAKE = MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_BLOCK | MAKE_SYM
WRITE = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | _MAKE | REFER | TRUNCATE
DEVICES = READ_FILE | READ_DIR | WRITE_FILE | TRUNCATE | IOCTL_DEV

READ_ONLY_DIRS = frozenset(("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt", "boot",
                            "proc", "sys", "dev"))

# Access names as the audit records spell them (`blockers=fs.write_file`), for readers of events.
NAMES = {
    EXECUTE: "execute", WRITE_FILE: "write_file", READ_FILE: "read_file", READ_DIR: "read_dir",
    REMOVE_DIR: "remove_dir", REMOVE_FILE: "remove_file", MAKE_CHAR: "make_char", MAKE_DIR: "make_dir",
    MAKE_REG: "make_reg", MAKE_SOCK: "make_sock", MAKE_FIFO: "make_fifo", MAKE_BLOCK: "make_block",
    MAKE_SYM: "make_sym", REFER: "refer", TRUNCATE: "truncate", IOCTL_DEV: "ioctl_dev",
}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed))
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)
    return result


def abi() -> int:
    """Landlock's ABI version, or 0 when the kernel has no (enabled) Landlock."""
    if _NR is None:
        return 0
    return max(0, _syscall(ctypes.c_long(_NR[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION)))


def handled_fs(version: int) -> int:
    """Every filesystem access right this ABI can restrict."""
    mask = (1 << 13) - 1
    if version >= 2:
        mask |= REFER
    if version >= 3:
        mask |= TRUNCATE
    if version >= 5:
        mask |= IOCTL_DEV
    return mask


def sandbox_rules(root: str = "/", writable_system: bool = False) -> list[tuple[str, int]]:
    """(path, allowed access) for the sandbox whose root is `root`: read on all of it, write
    on each top-level directory that is not system content, devices under /dev. With
    `writable_system` (a build sandbox), write on all of it."""
    rules = [(root, (READ | WRITE) if writable_system else READ)]
    with os.scandir(root) as entries:
        for entry in entries:
            # A symlink gets no rule of its own: what it points at has one, or is read-only.
            if not writable_system and entry.name not in READ_ONLY_DIRS and entry.is_dir(follow_symlinks=False):
                rules.append((entry.path, READ | WRITE))
    dev = os.path.join(root, "dev")
    if os.path.isdir(dev):
        rules.append((dev, DEVICES))
        if os.path.isdir(dev + "/shm"):
            rules.append((dev + "/shm", READ | WRITE))
    return rules


def restrict_self(rules: list[tuple[str, int]], version: int) -> None:
    """Restrict this thread (and everything it later forks or execs) to `rules`. The caller
    must have set no_new_privs (or hold CAP_SYS_ADMIN). Missing paths are skipped."""
    handled = handled_fs(version)
    attr = _RulesetAttr(handled, 0, 0)
    size = ctypes.sizeof(attr) if version >= 6 else 16  # `scoped` exists from ABI 6 on
    ruleset = _check(_syscall(ctypes.c_long(_NR[0]), ctypes.byref(attr), ctypes.c_size_t(size),
                              ctypes.c_uint32(0)), "landlock_create_ruleset")
    try:
        for path, access in rules:
            try:
                # Followed if a link (a root given as /proc/<pid>/root); sandbox_rules names no
                # symlink, and nothing in the sandbox may change its top level.
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                # A rule on a file may only carry file rights (no READ_DIR, MAKE_*, REMOVE_*).
                allowed = access & handled
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
                beneath = _PathBeneathAttr(allowed, fd)
                _check(_syscall(ctypes.c_long(_NR[1]), ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                                ctypes.byref(beneath), ctypes.c_uint32(0)), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        flags = RESTRICT_SELF_LOG_NEW_EXEC_ON if version >= 7 else 0
        _check(_syscall(ctypes.c_long(_NR[2]), ctypes.c_int(ruleset), ctypes.c_uint32(flags)),
               "landlock_restrict_self")
    finally:
        os.close(ruleset)


def confine_sandbox(version: int, writable_system: bool = False) -> None:
    """Apply the sandbox policy to this process, whose root is now the sandbox's. Nothing
    happens on a kernel without Landlock (version 0); the node reports Landlock as off."""
    if version > 0:
        restrict_self(sandbox_rules("/", writable_system), version)


# -- audit attribution ------------------------------------------------------------------------------

def audit_tag(cgroup_procs: list[str]) -> int:
    """The audit login uid of a sandbox's processes: derived from its cgroup.procs files, which
    the node agent also knows, so a denial record (`auid=`) names the sandbox without asking the
    kernel about a process that may be gone. Never -1 (unset) nor a low, real uid."""
    return 0x40000000 | (zlib.crc32("\n".join(cgroup_procs).encode()) & 0x3FFFFFFF)


def set_audit_tag(tag: int) -> None:
    """Set this process's audit login uid (inherited by everything it forks). Needs
    CAP_AUDIT_CONTROL where the kernel makes login uids immutable; the sandbox later cannot
    change it: its /proc is read-only and Landlock grants no write there."""
    fd = os.open("/proc/self/loginuid", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(tag).encode())
    finally:
        os.close(fd)


# -- the exec shim of `container` sandboxes (confine_shim.c) ------------------------------------------

SHIM_PATH = "/dev/sandfleet-confine"  # where a container sees it (bound read-only, as its init is)
_SHIM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine_shim.c")


def build_shim(directory: str) -> str:
    """The shim binary, compiled (static, so any root can run it) once per source version
    into `directory`. OSError when there is no C compiler or the build fails."""
    import hashlib
    import shutil
    import subprocess

    with open(_SHIM_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    binary = os.path.join(directory, f"sandfleet-confine-{digest}")
    if os.access(binary, os.X_OK):
        return binary
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError(2, "no C compiler (cc) to build the Landlock exec shim", _SHIM_SOURCE)
    partial = f"{binary}.{os.getpid()}.tmp"
    done = subprocess.run([cc, "-O2", "-static", "-o", partial, _SHIM_SOURCE], capture_output=True, timeout=120)
    if done.returncode != 0:
        raise OSError(8, f"building the Landlock exec shim failed: {done.stderr.decode(errors='replace')[-500:]}",
                      _SHIM_SOURCE)
    os.replace(partial, binary)
    return binary


def shim_argv(root_on_host: str, cgroup_procs: list[str], version: int) -> list[str]:
    """The argv prefix that runs a command under the sandbox policy in a container whose root
    the host sees at `root_on_host`; rule paths are the container's. The container's own
    mounts (/tmp, /dev, /dev/shm) are named whether or not the root has them yet."""
    rules: dict[str, int] = {}
    for path, access in sandbox_rules(root_on_host):
        rules["/" + os.path.relpath(path, root_on_host).removeprefix(".")] = access
    rules.update({"/tmp": READ | WRITE, "/dev": DEVICES, "/dev/shm": READ | WRITE})
    tag = str(audit_tag(cgroup_procs)) if cgroup_procs else "-"
    flags = RESTRICT_SELF_LOG_NEW_EXEC_ON if version >= 7 else 0
    return [SHIM_PATH, tag, f"{handled_fs(version):x}", f"{flags:x}",
            *(f"{access:x}:{path}" for path, access in rules.items()), "--"]

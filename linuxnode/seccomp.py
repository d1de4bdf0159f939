"""The seccomp filter every sandbox process runs under: default allow, and the syscalls a
sandbox never needs (and an agent could use to escape, snoop or attack the host) refused
with EPERM.

Built once per launcher with libseccomp (PyPI `pyseccomp`) and exported as raw classic-BPF
bytes (`filter_bytes()`), which the spawner installs in each child with
`syscalls.install_seccomp` as the last step before exec (the spawner runs without
site-packages, so it never imports libseccomp). `oci_seccomp()` is the same policy as an OCI
`linux.seccomp` section for crun.

- clone with any CLONE_NEW* flag: EPERM; clone3: ENOSYS (its flags sit in a struct seccomp
  cannot read, so glibc falls back to clone, the common container practice).
- ioctl by command: the ones that change inode flags, project ids or versions and so get
  around access controls (FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR, ...) and terminal input
  injection (TIOCSTI) get EPERM, and the node agent reports them. Reflink and dedupe
  (FICLONE, FICLONERANGE, FIDEDUPERANGE) get EOPNOTSUPP instead: `cp` tries FICLONE on
  every copy and falls back quietly on that errno, as on any filesystem without reflinks,
  so an ordinary copy is never reported as an attack. The kernel reads the command as 32
  bits, so only those are compared (a caller cannot dodge the rule with high bits set).
- personality: only the default persona values are allowed (0, PER_LINUX32, UNAME26 and
  both, and the 0xffffffff query); libseccomp cannot AND two comparisons on one argument,
  so that check is a few hand-written BPF instructions put in front of libseccomp's program.
- Syscalls of another ABI (i386 `int 0x80`, x32) kill the process (libseccomp's bad-arch
  action), so they cannot bypass the list.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
import tempfile

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "pivot_root",
    "mount_setattr", "unshare", "setns",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "iopl", "ioperm",
    "clock_settime", "settimeofday", "adjtimex", "clock_adjtime", "syslog",
)
CLONE_NS_FLAGS = {
    "CLONE_NEWTIME": 0x00000080, "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000,
}
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
IOCTLS_REFUSED = {  # name -> command (the _IOW numbers are the same on every Linux architecture we run)
    "FS_IOC_SETFLAGS": 0x40086602, "FS_IOC32_SETFLAGS": 0x40046602, "FS_IOC_SETVERSION": 0x40087602,
    "FS_IOC32_SETVERSION": 0x40047602, "FS_IOC_FSSETXATTR": 0x401C5820, "TIOCSTI": 0x5412,
}
IOCTLS_UNSUPPORTED = {"FICLONE": 0x40049409, "FICLONERANGE": 0x4020940D, "FIDEDUPERANGE": 0xC0189436}
_IOCTL_CMD_MASK = 0xFFFFFFFF

_ARCH = {  # machine -> (AUDIT_ARCH_*, personality syscall number)
    "x86_64": (0xC000003E, 135),
    "aarch64": (0xC00000B7, 92),
}
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15     # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06     # BPF_RET | BPF_K


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _personality_prefix() -> bytes:
    """BPF that refuses personality() outside PERSONALITY_ALLOWED and otherwise falls through
    to the instruction right after it (jumps are relative and forward, so libseccomp's
    program, appended after, runs unchanged). The kernel reads the argument as 32 bits."""
    arch, nr = _ARCH[os.uname().machine]
    allowed = PERSONALITY_ALLOWED
    body = [(_LD_W_ABS, 0, 0, 4)]  # seccomp_data.arch
    total = 5 + len(allowed) + 1  # instructions in the prefix; a jump to index `total` leaves it
    body.append((_JEQ_K, 0, total - 2, arch))  # not native: leave (libseccomp handles it)
    body.append((_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
    body.append((_JEQ_K, 0, total - 4, nr))
    body.append((_LD_W_ABS, 0, 0, 16 if struct.pack("=I", 1)[0] else 20))  # low word of args[0]
    for i, value in enumerate(allowed):
        left = len(allowed) - i  # this jeq, the ones after it, then the ret
        body.append((_JEQ_K, left, 0, value))
    body.append((_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM))
    assert len(body) == total
    return b"".join(_insn(*i) for i in body)


@functools.cache
def filter_bytes() -> bytes:
    """The filter as raw `struct sock_filter` instructions (8 bytes each), ready for
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER). Raises if libseccomp is unavailable."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except (OSError, ValueError):  # not a syscall on this architecture (iopl on aarch64)
            continue
    for bit in CLONE_NS_FLAGS.values():
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for cmd in IOCTLS_REFUSED.values():
        f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, _IOCTL_CMD_MASK, cmd))
    for cmd in IOCTLS_UNSUPPORTED.values():
        f.add_rule(sc.ERRNO(errno.EOPNOTSUPP), "ioctl", sc.Arg(1, sc.MASKED_EQ, _IOCTL_CMD_MASK, cmd))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise RuntimeError(f"libseccomp exported a {len(program)}-byte filter")
    return _personality_prefix() + program


@functools.cache
def refused_syscalls() -> dict[int, str]:
    """Native syscall number -> name of every call the filter can answer with EPERM (what the
    node agent watches for at syscall exit). Raises if libseccomp is unavailable."""
    import pyseccomp as sc

    found: dict[int, str] = {}
    for name in (*DENIED, "clone", "ioctl", "personality"):
        try:
            nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        except (OSError, ValueError):
            continue
        if nr >= 0:  # libseccomp gives a negative pseudo-number for a call this arch lacks
            found[nr] = name
    return found


def oci_seccomp() -> dict:
    """The same policy as an OCI `linux.seccomp` section (personality is left to crun's
    default: its allowed values cannot be expressed as one rule per argument)."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    syscalls = [{"names": list(DENIED), **eperm}]
    syscalls += [{"names": ["clone"], **eperm,
                  "args": [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}]}
                 for bit in CLONE_NS_FLAGS.values()]
    syscalls.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    for errno_, cmds in ((errno.EPERM, IOCTLS_REFUSED), (errno.EOPNOTSUPP, IOCTLS_UNSUPPORTED)):
        syscalls += [{"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno_,
                      "args": [{"index": 1, "value": _IOCTL_CMD_MASK, "valueTwo": cmd, "op": "SCMP_CMP_MASKED_EQ"}]}
                     for cmd in cmds.values()]
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": syscalls}

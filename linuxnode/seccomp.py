"""The seccomp filter every sandbox process runs under: an allowlist. The syscalls a normal
userland needs (linuxnode/seccomp_allowlist.py, with why) are allowed; every other syscall
the kernel has gets EPERM, and the node agent reports it as a `syscall.<name>` violation
(`refused_syscalls()` is the list it watches, so the two never disagree).

One policy, two forms: `oci_seccomp()` is the OCI `linux.seccomp` section crun compiles for a
container's init, and `filter_bytes()` is that same section compiled with libseccomp (PyPI
`pyseccomp`) the way crun does, behind a hand-written prefix that decides native calls the
same way in fewer instructions: raw classic-BPF bytes the spawner installs in every child
with `syscalls.install_seccomp` as the last step before exec (the spawner runs without
site-packages, so it never imports libseccomp). Built once per launcher.

- Numbers libseccomp does not know (above the highest it names: calls newer than the
  library, or none at all) get ENOSYS, not EPERM, in `filter_bytes()`: that is what glibc
  and musl fall back on when a kernel lacks a call (as they do for clone3), so a newer libc
  keeps working, as if on an older kernel, and a new kernel's calls are never allowed by
  default. It is in hand-written BPF in front of libseccomp's program (an OCI section cannot
  say it; the container's init, catatonit, makes no such call), which decides every native
  call through a tree of comparisons, the same policy faster (`_prefix` says why).
- clone with any CLONE_NEW* flag: EPERM; clone3: ENOSYS (its flags sit in a struct seccomp
  cannot read, so glibc falls back to clone, the common container practice).
- ioctl by command: the ones that change inode flags, project ids or versions and so get
  around access controls (FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR, ...) and terminal input
  injection (TIOCSTI) get EPERM, and the node agent reports them. Reflink and dedupe
  (FICLONE, FICLONERANGE, FIDEDUPERANGE) get EOPNOTSUPP instead: `cp` tries FICLONE on
  every copy and falls back quietly on that errno, as on any filesystem without reflinks,
  so an ordinary copy is never reported as an attack.
- socket: the families of an ordinary userland (unix, inet, inet6, netlink, and packet,
  which the kernel refuses without CAP_NET_RAW and the egress programs report); any other
  (vsock, alg, tipc, rds, bluetooth, ...: rarely used, often buggy) gets EAFNOSUPPORT, as
  on a kernel built without it, which every caller handles.
- personality: only the default persona values (0, PER_LINUX32, UNAME26 and both, and the
  0xffffffff query); anything else (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC) gets EPERM.
- The kernel reads ioctl commands, socket families and personas as 32 bits, so only those are
  compared (a caller cannot dodge a rule with high bits set). libseccomp cannot AND two
  comparisons of one argument, so "any command but these" is written as the few dozen
  masked prefixes that cover every other 32-bit value (`_all_but`).
- Syscalls of another ABI (i386 `int 0x80`, x32) kill the process (libseccomp's bad-arch
  action), so they cannot bypass the list.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
import tempfile

from linuxnode.seccomp_allowlist import ALLOWED, ARGUMENT_CHECKED

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
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
IO_URING = ("io_uring_setup", "io_uring_enter", "io_uring_register")
_LOW32 = 0xFFFFFFFF

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # machine -> AUDIT_ARCH_*
_X32_BIT = 0x40000000  # x32 calls arrive with the x86_64 arch and this bit set
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15     # BPF_JMP | BPF_JEQ | BPF_K
_JGT_K = 0x25     # BPF_JMP | BPF_JGT | BPF_K
_JGE_K = 0x35     # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06     # BPF_RET | BPF_K


def _all_but(values, bits: int = 32) -> list[tuple[int, int]]:
    """(mask, value) pairs, each matching x when x & mask == value, that together match every
    `bits`-bit x outside `values` and none inside: at each bit where a branch of the binary
    trie of `values` holds none of them, that branch's whole prefix is one pair."""
    full = (1 << bits) - 1
    pairs: list[tuple[int, int]] = []

    def split(group: list[int], bit: int, prefix: int) -> None:
        mask = full ^ ((1 << bit) - 1)  # the bits above `bit`, and `bit` itself
        for side in (0, 1 << bit):
            under = [v for v in group if v & (1 << bit) == side]
            if not under:
                pairs.append((mask, prefix | side))
            elif bit:
                split(under, bit - 1, prefix | side)

    split(sorted(set(values)), bits - 1, 0)
    return pairs


def _masked(index: int, mask: int, value: int) -> dict:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def oci_seccomp() -> dict:
    """The policy as an OCI `linux.seccomp` section (what crun compiles for a container)."""
    allow = {"action": "SCMP_ACT_ALLOW"}

    def refuse(code: int) -> dict:
        return {"action": "SCMP_ACT_ERRNO", "errnoRet": code}

    ns = 0
    for bit in CLONE_NS_FLAGS.values():
        ns |= bit
    ioctls = {**IOCTLS_REFUSED, **IOCTLS_UNSUPPORTED}.values()
    syscalls = [{"names": list(ALLOWED), **allow},
                {"names": ["clone"], **allow, "args": [_masked(0, ns, 0)]},
                {"names": ["clone3"], **refuse(errno.ENOSYS)}]
    syscalls += [{"names": ["ioctl"], **allow, "args": [_masked(1, m, v)]} for m, v in _all_but(ioctls)]
    syscalls += [{"names": ["ioctl"], **refuse(errno.EOPNOTSUPP), "args": [_masked(1, _LOW32, cmd)]}
                 for cmd in IOCTLS_UNSUPPORTED.values()]
    syscalls += [{"names": ["personality"], **allow, "args": [_masked(0, _LOW32, v)]} for v in PERSONALITY_ALLOWED]
    syscalls += [{"names": ["socket"], **allow, "args": [_masked(0, _LOW32, f)]} for f in SOCKET_FAMILIES.values()]
    syscalls += [{"names": ["socket"], **refuse(errno.EAFNOSUPPORT), "args": [_masked(0, m, v)]}
                 for m, v in _all_but(SOCKET_FAMILIES.values())]
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": errno.EPERM, "syscalls": syscalls}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


_JA = 0x05    # BPF_JMP | BPF_JA: the one jump whose offset is 32 bits
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_LITTLE = struct.pack("=I", 1)[0] == 1


def _arg_low(index: int) -> int:
    """Offset of the low 32 bits of seccomp_data.args[index] (what the kernel reads of an int)."""
    return 16 + 8 * index + (0 if _LITTLE else 4)


def _one_of(arg: int, values, yes: int, no: int) -> list[tuple]:
    """Return `yes` when the low 32 bits of the argument are one of `values`, else `no`."""
    values = list(values)
    body = [(_LD_W_ABS, 0, 0, _arg_low(arg))]
    body += [(_JEQ_K, len(values) - i, 0, v) for i, v in enumerate(values)]  # to the last ret
    return body + [(_RET_K, 0, 0, no), (_RET_K, 0, 0, yes)]


def _by_arguments(name: str) -> list[tuple]:
    """The calls whose arguments decide, written out as `oci_seccomp()` says them."""
    allow, eperm = _SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO | errno.EPERM
    if name == "clone":
        ns = functools.reduce(lambda a, b: a | b, CLONE_NS_FLAGS.values())
        return [(_LD_W_ABS, 0, 0, _arg_low(0)), (_JSET_K, 0, 1, ns), (_RET_K, 0, 0, eperm), (_RET_K, 0, 0, allow)]
    if name == "clone3":
        return [(_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS)]
    if name == "ioctl":
        body = [(_LD_W_ABS, 0, 0, _arg_low(1))]
        for code, cmds in ((errno.EPERM, IOCTLS_REFUSED), (errno.EOPNOTSUPP, IOCTLS_UNSUPPORTED)):
            for cmd in cmds.values():
                body += [(_JEQ_K, 0, 1, cmd), (_RET_K, 0, 0, _SECCOMP_RET_ERRNO | code)]
        return body + [(_RET_K, 0, 0, allow)]
    if name == "personality":
        return _one_of(0, PERSONALITY_ALLOWED, allow, eperm)
    if name == "socket":
        return _one_of(0, SOCKET_FAMILIES.values(), allow, _SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT)
    raise ValueError(name)


def _answers(highest: int) -> list[int | str]:
    """For each native number up to `highest`: the action the policy gives it whatever its
    arguments (ALLOW, or EPERM for a refused or unnamed number), or the name of a call whose
    arguments decide (clone, clone3, ioctl, personality, socket)."""
    known, allowed, asked = known_syscalls(), set(ALLOWED), {*ARGUMENT_CHECKED, "clone3"}
    return [_SECCOMP_RET_ALLOW if known.get(nr) in allowed else known[nr] if known.get(nr) in asked
            else _SECCOMP_RET_ERRNO | errno.EPERM for nr in range(highest + 1)]


def _dispatch_tree(answers: list[int | str]) -> list[tuple]:
    """A balanced tree of comparisons over the runs of equal answers, each leaf a return:
    a call's number reaches its answer in ~7 comparisons instead of walking libseccomp's list."""
    runs = [nr for nr in range(len(answers)) if nr == 0 or answers[nr] != answers[nr - 1]]

    def tree(lo: int, hi: int) -> list[tuple]:
        if hi - lo == 1:
            answer = answers[runs[lo]]
            return _by_arguments(answer) if isinstance(answer, str) else [(_RET_K, 0, 0, answer)]
        mid = (lo + hi) // 2
        left, right = tree(lo, mid), tree(mid, hi)
        if len(left) > 255:
            raise RuntimeError("seccomp dispatch tree too deep for an 8-bit jump")
        return [(_JGE_K, len(left), 0, runs[mid]), *left, *right]

    return tree(0, len(runs))


def _prefix(highest: int) -> bytes:
    """BPF in front of libseccomp's program that decides every native call as that program
    would (the tests run both for every number and every argument rule), and leaves it only
    other architectures and x32, which it kills; numbers above `highest` get ENOSYS (see the
    module's doc). Jumps are relative and forward, so the program, appended after, runs
    unchanged, and stays instruction for instruction the one crun compiles for the init.
    Why not libseccomp's program alone: the kernel runs a new filter once for every syscall
    number when it is installed (to cache the calls allowed whatever their arguments), and
    walking its list of ~300 calls for each number made an install cost ~0.5 ms more per
    process; its ioctl rules (the ~180 masked prefixes) also cost every ioctl ~150 ns."""
    body: list[tuple] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, _ARCH[os.uname().machine]),
        ("leave",),  # not native
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JGE_K, 0, 1, _X32_BIT),
        ("leave",),  # x32
        (_JGT_K, 0, 1, highest),
        (_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS),
        *_dispatch_tree(_answers(highest)),
    ]
    end = len(body)
    return b"".join(_insn(_JA, 0, 0, end - i - 1) if insn[0] == "leave" else _insn(*insn)
                    for i, insn in enumerate(body))


@functools.cache
def known_syscalls() -> dict[int, str]:
    """Native syscall number -> name of every call libseccomp names (raises without it)."""
    import pyseccomp as sc

    found: dict[int, str] = {}
    for nr in range(1024):  # no architecture we run numbers its calls higher
        try:
            name = sc.resolve_syscall(sc.Arch.NATIVE, nr)
        except (OSError, ValueError):
            continue
        if name:
            found[nr] = name.decode() if isinstance(name, bytes) else name
    return found


def compile_oci(section: dict) -> bytes:
    """An OCI seccomp section compiled by libseccomp rule by rule, as crun compiles it."""
    import pyseccomp as sc

    def action(name: str, code: int | None):
        if name == "SCMP_ACT_ALLOW":
            return sc.ALLOW
        if name == "SCMP_ACT_ERRNO":
            return sc.ERRNO(errno.EPERM if code is None else code)  # the OCI default errno
        raise ValueError(f"seccomp action {name} is not one this policy uses")

    f = sc.SyscallFilter(action(section["defaultAction"], section.get("defaultErrnoRet")))
    for rule in section["syscalls"]:
        args = [sc.Arg(a["index"], sc.MASKED_EQ, a["value"], a["valueTwo"]) for a in rule.get("args", ())]
        for name in rule["names"]:
            f.add_rule(action(rule["action"], rule.get("errnoRet")), name, *args)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise RuntimeError(f"libseccomp exported a {len(program)}-byte filter")
    return program


@functools.cache
def filter_bytes() -> bytes:
    """The filter as raw `struct sock_filter` instructions (8 bytes each), ready for
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER). Raises if libseccomp is unavailable."""
    return _prefix(max(known_syscalls())) + compile_oci(oci_seccomp())


@functools.cache
def refused_syscalls() -> dict[int, str]:
    """Native syscall number -> name of every call the filter can answer with EPERM (what the
    node agent watches for at syscall exit): every call libseccomp names that is not on the
    allowlist, and those allowed only with some arguments. Not clone3 (ENOSYS) nor socket
    (EAFNOSUPPORT; its EPERMs are the kernel's, which the egress programs report)."""
    allowed = set(ALLOWED) | {"clone3", "socket"}
    return {nr: name for nr, name in known_syscalls().items() if name not in allowed}

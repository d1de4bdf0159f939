"""The allowlist filter (linuxnode/seccomp.py) against every syscall number the kernel has.

Two views that need each other. A sandbox has no capabilities, so many calls fail with EPERM
whatever the filter says; `decide()` runs the filter's own program (classic BPF, as the
kernel would) for each number, which shows the EPERM is the filter's. The walk runs one
static helper in a real sandbox that makes every call not on the list (each in a child of
its own, with invalid arguments, under an alarm) and reports each errno, which shows the
kernel does as the program says. The names come from the kernel headers (Debian's
linux-libc-dev, which `make install` brings with libc6-dev); the walk goes on past them to
1023, so calls this kernel has and the headers do not are covered too.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import struct
import subprocess

import pytest

from linuxnode import mount_api
from linuxnode import seccomp
from linuxnode.seccomp_allowlist import ALLOWED, ARGUMENT_CHECKED
from tests.kernel import require
from tests.security.test_syscall_violations import Violations
from tests.test_containers import BASE, base, seccomp_programs  # noqa: F401  (fixture)

X86_64 = os.uname().machine == "x86_64"
UNISTD_64 = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
AUDIT_ARCH_X86_64, AUDIT_ARCH_I386 = 0xC000003E, 0x40000003
RET_ALLOW, RET_ERRNO, RET_ACTION = 0x7FFF0000, 0x00050000, 0xFFFF0000
SIGSYS = 31
HIGHEST = 1023
# Recent kernels run these two without asking seccomp: the trampoline the kernel maps into a
# probed process calls them, and no filter may break probes. Made from anywhere else they only
# fail: uretprobe kills its caller (SIGILL), uprobe gives ENXIO. A kernel without them, or one
# that still filters them, refuses them like any number the filter does not allow.
SECCOMP_EXEMPT = {335: ("sig4", str(errno.EPERM)), 336: (str(errno.ENXIO), str(errno.EPERM))}

WALKER_C = r"""
/* argv: [-o FILE] then syscall numbers, or "x32" / "int80". One line per call: "<nr> <errno>",
   "<nr> ok" (it returned >= 0: the filter let it through) or "<nr> sig<N>" (killed). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/wait.h>

static long call(const char *what) {
    if (strcmp(what, "x32") == 0)
        return syscall(0x40000000L | SYS_getpid);
    if (strcmp(what, "int80") == 0) {  /* the i386 ABI from a 64-bit process: getpid is 20 there */
        long r;
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory");
        return r < 0 ? (errno = (int)-r, -1) : r;
    }
    long bad = -1L;  /* invalid as a pointer, a fd and a length */
    return syscall(strtol(what, 0, 0), bad, bad, bad, bad, bad, bad);
}

int main(int argc, char **argv) {
    int first = 1;
    if (argc > 2 && strcmp(argv[1], "-o") == 0) {
        if (!freopen(argv[2], "w", stdout)) return 4;
        first = 3;
    }
    for (int i = first; i < argc; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0) return 2;
        if (pid == 0) {
            alarm(2);  /* a call the filter wrongly let through must not hang the walk */
            long r = call(argv[i]);
            _exit(r < 0 ? (errno & 0x7f) : 0xff);
        }
        int st;
        if (waitpid(pid, &st, 0) != pid) return 3;
        if (WIFSIGNALED(st)) printf("%s sig%d\n", argv[i], WTERMSIG(st));
        else if (WEXITSTATUS(st) == 0xff) printf("%s ok\n", argv[i]);
        else printf("%s %d\n", argv[i], WEXITSTATUS(st));
    }
    fputs("done\n", stdout);
    return 0;
}
"""


# -- the program, run as the kernel runs it -----------------------------------------------------

def decide(program: bytes, nr: int, args=(0, 0, 0, 0, 0, 0), arch: int = AUDIT_ARCH_X86_64) -> int:
    """The 32-bit action the classic-BPF seccomp `program` returns for one call (the opcodes
    libseccomp and our prefix emit; anything else is an error, not a guess)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *[a & 0xFFFFFFFFFFFFFFFF for a in args])
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = struct.unpack_from("=HBBI", program, pc * 8)
        pc += 1
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:  # and #k
            acc &= k
        elif code in (0x15, 0x25, 0x35, 0x45):  # jeq, jgt, jge, jset #k
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        elif code == 0x05:  # ja
            pc += k
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"opcode {code:#x} at {pc - 1}")


def refusal(code: int) -> int:
    return RET_ERRNO | code


def header_table() -> dict[int, str]:
    """number -> name of every x86_64 syscall in the kernel headers."""
    with open(UNISTD_64) as f:
        return {int(nr): name for name, nr in re.findall(r"#define __NR_(\w+) (\d+)", f.read())}


def expected_native(nr: int) -> int | None:
    """What the filter must answer a call of `nr` with null arguments; None for the calls
    allowed only with some arguments (checked on their own below)."""
    name = seccomp.known_syscalls().get(nr)
    if name in ARGUMENT_CHECKED:
        return None
    if name in ALLOWED:
        return RET_ALLOW
    if name == "clone3" or nr > max(seccomp.known_syscalls()):
        return refusal(errno.ENOSYS)
    return refusal(errno.EPERM)


@pytest.fixture(scope="module")
def x86_64():
    require(X86_64, "the tables and the walker are x86_64's")
    require(os.path.exists(UNISTD_64), "linux-libc-dev's headers (`make install` brings them with libc6-dev)")


def test_libseccomp_names_every_call_of_the_kernel_headers(x86_64):
    """The filter's table is libseccomp's: a call it lacked would be refused with ENOSYS even
    if it were on the list."""
    known = seccomp.known_syscalls()
    assert {nr: known.get(nr) for nr in header_table()} == header_table()
    assert set(ALLOWED) | set(ARGUMENT_CHECKED) <= set(known.values())


def test_the_filter_refuses_every_number_not_on_the_list(x86_64):
    program = seccomp.filter_bytes()
    got = {nr: decide(program, nr) for nr in range(HIGHEST + 1)}
    want = {nr: expected_native(nr) for nr in range(HIGHEST + 1)}
    wrong = {nr: (seccomp.known_syscalls().get(nr), hex(got[nr]), hex(w)) for nr, w in want.items()
             if w is not None and got[nr] != w}
    assert not wrong
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace", "bpf", "unshare", "mount"):
        nr = {n: k for k, n in seccomp.known_syscalls().items()}[name]
        assert got[nr] == refusal(errno.EPERM) and nr in seccomp.refused_syscalls(), name
    # every refused number (but the ENOSYS ones) is one the node agent watches
    eperm = {nr for nr, r in got.items() if r == refusal(errno.EPERM) and nr in seccomp.known_syscalls()}
    assert eperm == set(seccomp.refused_syscalls()) - {n for n, name in seccomp.known_syscalls().items()
                                                       if name in ARGUMENT_CHECKED}


def test_other_abis_are_killed(x86_64):
    program = seccomp.filter_bytes()
    kill = {decide(program, 0x40000000 | 39), decide(program, 20, arch=AUDIT_ARCH_I386)}  # x32, i386 getpid
    assert all(action & RET_ACTION in (0x00000000, 0x80000000) for action in kill), kill  # KILL_THREAD / PROCESS


def _argument_cases() -> dict[str, tuple[int, tuple[int, ...], int]]:
    """name -> (nr, args, expected action) for the calls allowed only with some arguments."""
    cases = {}
    for name, cmd in seccomp.IOCTLS_REFUSED.items():
        cases[f"ioctl {name}"] = (16, (3, cmd), refusal(errno.EPERM))
        cases[f"ioctl {name} high bits"] = (16, (3, 0xFFFFFFFF_00000000 | cmd), refusal(errno.EPERM))
    for name, cmd in seccomp.IOCTLS_UNSUPPORTED.items():
        cases[f"ioctl {name}"] = (16, (3, cmd), refusal(errno.EOPNOTSUPP))
    for name, cmd in (("TCGETS", 0x5401), ("TIOCGWINSZ", 0x5413), ("FIONREAD", 0x541B), ("FIONBIO", 0x5421),
                      ("TIOCGPTN musl", 0xFFFFFFFF_80045430), ("FS_IOC_GETFLAGS", 0x80086601), ("zero", 0)):
        cases[f"ioctl {name}"] = (16, (3, cmd), RET_ALLOW)
    for name, family in seccomp.SOCKET_FAMILIES.items():
        cases[f"socket {name}"] = (41, (family, 1, 0), RET_ALLOW)
    for name, family in (("AF_VSOCK", 40), ("AF_ALG", 38), ("AF_TIPC", 30), ("AF_RDS", 21), ("AF_BLUETOOTH", 31),
                         ("AF_UNSPEC", 0), ("AF_MAX", 46), ("high", 0xFFFF)):
        cases[f"socket {name}"] = (41, (family, 1, 0), refusal(errno.EAFNOSUPPORT))
    cases["socket AF_INET high bits"] = (41, (0xFFFFFFFF_00000002, 1, 0), RET_ALLOW)  # the kernel reads 2
    cases["clone fork"] = (56, (17,), RET_ALLOW)
    cases["clone thread"] = (56, (0x3D0F00,), RET_ALLOW)  # glibc's pthread_create flags
    for name, bit in seccomp.CLONE_NS_FLAGS.items():
        cases[f"clone {name}"] = (56, (bit | 17,), refusal(errno.EPERM))
    for value in seccomp.PERSONALITY_ALLOWED:
        cases[f"personality {value:#x}"] = (135, (value,), RET_ALLOW)
    for value in (0x0040000, 0x0400000, 0x1_0004_0000):  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC
        cases[f"personality {value:#x}"] = (135, (value,), refusal(errno.EPERM))
    cases["clone3"] = (435, (0, 0), refusal(errno.ENOSYS))
    return cases


def test_the_argument_rules(x86_64):
    program = seccomp.filter_bytes()
    got = {name: decide(program, nr, args + (0,) * (6 - len(args))) for name, (nr, args, _) in _argument_cases().items()}
    want = {name: action for name, (_, _, action) in _argument_cases().items()}
    assert {k: hex(v) for k, v in got.items()} == {k: hex(v) for k, v in want.items()}


def test_the_oci_section_is_the_same_policy(x86_64):
    oci = seccomp.oci_seccomp()
    assert (oci["defaultAction"], oci["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", errno.EPERM)
    program = seccomp.compile_oci(oci)  # what crun compiles
    ours = seccomp.filter_bytes()
    assert ours.endswith(program)  # behind the prefix, which decides native calls the same way, faster
    for nr in range(max(seccomp.known_syscalls()) + 1):
        assert decide(ours, nr) == decide(program, nr), (nr, seccomp.known_syscalls().get(nr))
    for name, (nr, args, _) in _argument_cases().items():
        args = args + (0,) * (6 - len(args))
        assert decide(ours, nr, args) == decide(program, nr, args), name
    unconditional = {n for rule in oci["syscalls"] if "args" not in rule and rule["action"] == "SCMP_ACT_ALLOW"
                     for n in rule["names"]}
    assert unconditional == set(ALLOWED) and not unconditional & set(ARGUMENT_CHECKED)


# -- the walk, in real sandboxes ----------------------------------------------------------------

@pytest.fixture(scope="module")
def walker(tmp_path_factory, x86_64) -> bytes:
    require(shutil.which("gcc") is not None, "gcc and libc6-dev (in the Makefile's apt list)")
    d = tmp_path_factory.mktemp("walker")
    (d / "walk.c").write_text(WALKER_C)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "walk"), str(d / "walk.c")], check=True)
    return (d / "walk").read_bytes()


def walk_numbers() -> list[int]:
    return [nr for nr in range(HIGHEST + 1) if expected_native(nr) not in (None, RET_ALLOW)]


async def _walk(sb, walker: bytes) -> dict[str, str]:
    await sb.write_file("/workspace/walk", walker, mode=0o755)
    r = await sb.exec(["/workspace/walk", *map(str, walk_numbers()), "x32", "int80"], timeout_s=120)
    assert r.exit_code == 0, r
    return _parse(r.stdout.decode())


def _parse(out: str) -> dict[str, str]:
    lines = out.splitlines()
    assert lines and lines[-1] == "done", out[-300:]
    return dict(line.split(" ", 1) for line in lines[:-1])


def _check_walk(results: dict[str, str], unknown: int = errno.ENOSYS) -> None:
    """`unknown`: the errno of numbers libseccomp does not know (the process filter's prefix)."""
    highest = max(seccomp.known_syscalls())
    want = {str(nr): str(unknown if nr > highest else expected_native(nr) & 0xFFFF) for nr in walk_numbers()}
    want |= {"x32": f"sig{SIGSYS}", "int80": f"sig{SIGSYS}"}
    want |= {str(nr): results.get(str(nr)) for nr, outcomes in SECCOMP_EXEMPT.items()
             if results.get(str(nr)) in outcomes}
    wrong = {nr: (seccomp.known_syscalls().get(int(nr)) if nr.isdigit() else nr, results.get(nr), w)
             for nr, w in want.items() if results.get(nr) != w}
    assert not wrong, wrong
    assert sum(v == str(errno.EPERM) for v in results.values()) > 100 and results[str(HIGHEST)] == str(unknown)


async def test_the_walk_in_a_process_sandbox(fleet, walker):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        _check_walk(await _walk(sb, walker))
    finally:
        await sb.destroy()


async def test_the_walk_in_a_container_sandbox_and_its_init_runs_the_oci_section(fleet, base, walker):  # noqa: F811
    """A command runs under the process filter (the spawner gives it; tests/test_containers.py
    checks the programs); the init runs what crun compiled from `oci_seccomp()`, walked here
    number by number through the kernel's own program."""
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    try:
        _check_walk(await _walk(sb, walker))
        (program,) = seccomp_programs((await fleet.get(sb.id)).init_pid)
    finally:
        await sb.destroy()
    ours = seccomp.filter_bytes()
    for nr in range(HIGHEST + 1):
        want = decide(ours, nr)
        if nr > max(seccomp.known_syscalls()):
            want = refusal(errno.EPERM)  # crun has no ENOSYS prefix: the init never makes such a call
        assert decide(program, nr) == want, (nr, seccomp.known_syscalls().get(nr))
    for name, (nr, args, action) in _argument_cases().items():
        assert decide(program, nr, args + (0,) * (6 - len(args))) == action, name
    assert decide(program, 0x40000000 | 39) & RET_ACTION in (0, 0x80000000)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_the_walk_under_the_filter_crun_compiles_from_the_oci_section(tmp_path, walker):
    """The walk as a container's own process (crun gives it the bundle's `linux.seccomp`, which
    a platform command never runs under): a bundle of `container.bundle_config()` whose
    process is the walker, run by the container runtime the node uses."""
    import secrets

    from linuxnode.container import ContainerSpec, Crun, bundle_config

    require(os.geteuid() == 0 and shutil.which("crun") is not None, "crun, as root")
    crun = Crun.find(tmp_path / "state")
    root = tmp_path / "root"
    root.mkdir()
    (root / "walk").write_bytes(walker)
    (root / "walk").chmod(0o755)
    spec = ContainerSpec(sandbox_id=f"wtwalk-{secrets.token_hex(4)}", rootfs=str(root), cgroup_procs=[], netns="",
                         tmp_size_mb=1)
    config = bundle_config(spec)
    config["process"]["args"] = ["/walk", "-o", "/walk.out", *map(str, walk_numbers()), "x32", "int80"]
    config["linux"]["namespaces"][-1] = {"type": "network"}  # a new one, empty
    bundle = crun.bundles / spec.sandbox_id
    bundle.mkdir(parents=True)
    try:
        tree = mount_api.clone_tree(str(root), recursive=True)  # crun's root: a detached tree, as start() gives it
        try:
            await crun._run_bundle(spec.sandbox_id, bundle, config, tree, None, [])
        finally:
            os.close(tree)
        pid = int((bundle / "init.pid").read_text())
        for _ in range(1200):  # a bound on the wait, not a timing check: the walk takes well under a second
            if _exited(pid):
                break
            await asyncio.sleep(0.05)
        results = _parse((root / "walk.out").read_text())
    finally:
        await crun.remove(spec.sandbox_id, None)
        crun.close()
    _check_walk(results, unknown=errno.EPERM)  # crun's program has no ENOSYS prefix: its default answers


# -- io_uring: refused and reported -------------------------------------------------------------

IO_URING = r"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)  # struct io_uring_params
out = {}
for name, nr, args in (("io_uring_setup", 425, [8, ctypes.addressof(params)]), ("io_uring_enter", 426, [3, 1, 0, 0, 0, 0]),
                       ("io_uring_register", 427, [3, 0, 0, 0])):
    ctypes.set_errno(0)
    out[name] = [libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) for a in args]), ctypes.get_errno()]
print(json.dumps(out))
"""


async def test_io_uring_is_refused_and_reported(fleet, x86_64):
    sb = await fleet.create(memory_mb=128, labels={"task": "redteam-io-uring"}, host_view=True)
    seen = Violations(fleet, sb.id)
    try:
        await seen.started()
        r = await sb.exec(["python3", "-S", "-c", IO_URING], timeout_s=20)
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout) == {name: [-1, errno.EPERM] for name in seccomp.IO_URING}
        for name in seccomp.IO_URING:
            v = await seen.wait_for(f"syscall.{name}", 0)
            assert v.sandbox_id == sb.id and v.command == "python3" and name in v.attempted, v
    finally:
        seen.close()
        await sb.destroy()

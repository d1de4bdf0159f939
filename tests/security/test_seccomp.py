"""The seccomp filter of every sandbox process, on the real kernel through the real runtimes.

A sandbox already has no capabilities, so most of these calls would fail anyway; the tests
tell the filter apart by the errno (EPERM before the kernel looks at the arguments, where an
unfiltered call with null arguments gives EFAULT/EINVAL) and by calls that need no
capability (unshare -U, ptrace(TRACEME), keyctl, clone(CLONE_NEWUSER), personality).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from linuxnode import seccomp
from linuxnode.seccomp_allowlist import ALLOWED
from tests.kernel import require
from tests.test_containers import BASE, base  # noqa: F401  (fixture)
from tests.test_kernel_runtime import layout, sandbox, sandboxes  # noqa: F401  (fixtures)

X86_64 = os.uname().machine == "x86_64"

# x86_64 numbers: each call with null arguments, run inside the sandbox
PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
calls = %s
out = {}
for name, (nr, args) in calls.items():
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) for a in args])
    if r == 0 and name.startswith("clone"):
        os._exit(0)  # a child: the filter let it through
    if r > 0 and name.startswith("clone"):
        os.waitpid(r, 0)
    out[name] = (r, ctypes.get_errno())
print(json.dumps(out))
"""
NEWUSER_SIGCHLD = 0x10000000 | 17
CALLS = {
    "ptrace": (101, [0, 0, 0, 0]),  # PTRACE_TRACEME: needs no privilege
    "process_vm_readv": (310, [1, 0, 0, 0, 0, 0]),
    "process_vm_writev": (311, [1, 0, 0, 0, 0, 0]),
    "mount": (165, [0, 0, 0, 0, 0]),
    "umount2": (166, [0, 0]),
    "open_tree": (428, [0, 0, 0]),
    "move_mount": (429, [0, 0, 0, 0, 0]),
    "fsopen": (430, [0, 0]),
    "fsconfig": (431, [0, 0, 0, 0, 0]),
    "fsmount": (432, [0, 0, 0]),
    "fspick": (433, [0, 0, 0]),
    "pivot_root": (155, [0, 0]),
    "unshare": (272, [0x10000000]),  # CLONE_NEWUSER: needs no privilege
    "setns": (308, [0, 0]),
    "bpf": (321, [0, 0, 0]),
    "perf_event_open": (298, [0, 0, 0, 0, 0]),
    "keyctl": (250, [0, 0, 0, 0, 0]),  # KEYCTL_GET_KEYRING_ID: needs no privilege
    "add_key": (248, [0, 0, 0, 0, 0]),
    "request_key": (249, [0, 0, 0, 0]),
    "kexec_load": (246, [0, 0, 0, 0]),
    "kexec_file_load": (320, [0, 0, 0, 0, 0]),
    "init_module": (175, [0, 0, 0]),
    "finit_module": (313, [0, 0, 0]),
    "delete_module": (176, [0, 0]),
    "reboot": (169, [0, 0, 0, 0]),
    "swapon": (167, [0, 0]),
    "swapoff": (168, [0]),
    "acct": (163, [0]),
    "open_by_handle_at": (304, [0, 0, 0]),
    "name_to_handle_at": (303, [0, 0, 0, 0, 0]),
    "userfaultfd": (323, [0]),
    "iopl": (172, [0]),
    "ioperm": (173, [0, 0, 0]),
    "lookup_dcookie": (212, [0, 0, 0]),
    "quotactl": (179, [0, 0, 0, 0]),
    "clock_settime": (227, [0, 0]),
    "settimeofday": (164, [0, 0]),
    "adjtimex": (159, [0]),
    "syslog": (103, [3, 0, 0]),  # SYSLOG_ACTION_READ_ALL
    "personality": (135, [0x0040000]),  # ADDR_NO_RANDOMIZE
    "clone_newuser": (56, [NEWUSER_SIGCHLD, 0, 0, 0, 0]),
    "clone_newnet": (56, [0x40000000 | 17, 0, 0, 0, 0]),
    "clone3": (435, [0, 0]),
    "io_uring_setup": (425, [0, 0]),
    "io_uring_enter": (426, [0, 0, 0, 0, 0, 0]),
    "io_uring_register": (427, [0, 0, 0, 0]),
}
# What the denylist refused, and still refused: the allowlist has none of them.
REFUSED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "pivot_root",
    "mount_setattr", "unshare", "setns", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "iopl", "ioperm", "clock_settime", "settimeofday", "adjtimex", "clock_adjtime", "syslog", *seccomp.IO_URING,
)


def test_the_filter_is_classic_bpf_and_the_oci_section_has_the_same_rules():
    program = seccomp.filter_bytes()
    assert program and len(program) % 8 == 0 and len(program) // 8 < 4096
    assert seccomp.filter_bytes() is program  # built once
    code, _, _, k = struct.unpack("=HBBI", program[-8:])
    assert code == 0x06  # ends in a return
    oci = seccomp.oci_seccomp()
    assert (oci["defaultAction"], oci["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", 1)  # an allowlist
    names = {n for rule in oci["syscalls"] for n in rule["names"]}
    assert set(ALLOWED) | {"clone", "clone3", "ioctl", "personality", "socket"} == names
    assert not names & set(REFUSED)


def test_fs_ioctls_are_refused_by_their_32_bit_command_in_both_forms_of_the_policy():
    oci = seccomp.oci_seccomp()
    ioctl = [(rule["action"], rule.get("errnoRet"), rule["args"][0]) for rule in oci["syscalls"]
             if rule["names"] == ["ioctl"]]
    assert all(arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["index"] == 1 and not arg["value"] >> 32
               for _, _, arg in ioctl)  # only the 32 bits the kernel reads are compared
    unsupported = {arg["valueTwo"] for action, e, arg in ioctl if action == "SCMP_ACT_ERRNO"}
    assert unsupported == set(seccomp.IOCTLS_UNSUPPORTED.values())
    allows = [(arg["value"], arg["valueTwo"]) for action, _, arg in ioctl if action == "SCMP_ACT_ALLOW"]

    def allowed(cmd: int) -> bool:
        return any(cmd & mask == value for mask, value in allows)

    special = {*seccomp.IOCTLS_REFUSED.values(), *seccomp.IOCTLS_UNSUPPORTED.values()}
    assert not any(allowed(cmd) for cmd in special)
    neighbours = {cmd ^ (1 << bit) for cmd in special for bit in range(32)} - special
    assert all(allowed(cmd) for cmd in neighbours | {0, 0x5401, 0x5413, 0x541B, 0xFFFFFFFF})


def test_the_watched_syscall_numbers_name_every_refused_call():
    require(X86_64, "the expected numbers are x86_64's")
    numbers = seccomp.refused_syscalls()
    assert set(numbers.values()) >= set(REFUSED) | {"clone", "ioctl", "personality"}
    assert not set(numbers.values()) & (set(ALLOWED) | {"clone3", "socket"})
    assert {name: nr for nr, name in numbers.items() if name in CALLS} == {
        name: nr for name, (nr, _) in CALLS.items() if name in numbers.values()}


async def test_sandbox_processes_run_under_the_filter(sandbox):
    with open(f"/proc/{sandbox.init.pid}/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1"  # catatonit too
    r = await sandbox.sh("grep -E '^(Seccomp|Seccomp_filters):' /proc/self/status")
    assert r.exit_code == 0 and b"Seccomp:\t2" in r.stdout and b"Seccomp_filters:\t1" in r.stdout


async def test_refused_syscalls_fail_with_eperm_inside_a_sandbox(sandbox):
    require(X86_64, "the probe's syscall numbers are x86_64's")
    r = await sandbox.run("python3", "-S", "-c", PROBE % json.dumps(CALLS))
    assert r.exit_code == 0, r.stderr
    results = json.loads(r.stdout)
    expected = {name: 38 if name == "clone3" else 1 for name in CALLS}  # ENOSYS, EPERM
    got = {name: errno_ for name, (ret, errno_) in results.items()}
    assert got == expected, {n: results[n] for n in CALLS if got[n] != expected[n]}
    assert all(ret == -1 for ret, _ in results.values())


async def test_personality_query_and_default_values_still_work(sandbox):
    require(X86_64, "the probe's syscall numbers are x86_64's")
    calls = {"query": (135, [0xFFFFFFFF]), "linux": (135, [0]), "linux32_back": (135, [0]),
             "no_randomize_hi": (135, [0x1_0004_0000])}  # the kernel reads 32 bits: still refused
    r = await sandbox.run("python3", "-S", "-c", PROBE % json.dumps(calls))
    results = json.loads(r.stdout)
    assert results["query"][0] >= 0 and results["linux"][0] >= 0 and results["linux32_back"][0] >= 0
    assert results["no_randomize_hi"] == [-1, 1]


async def test_namespace_and_ptrace_tools_fail_inside_a_sandbox(sandbox):
    for flag in ("-U", "-n", "-m", "-p"):
        r = await sandbox.run("unshare", flag, "true")
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, (flag, r)
    # strace is a test dependency (Debian package strace, installed by `make install`): ptrace
    # through a real tracer, not only the bare call below.
    assert shutil.which("strace"), "strace is not installed: run `make install`"
    r = await sandbox.run("strace", "-o", "/dev/null", "true")
    assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, r
    r = await sandbox.run("python3", "-S", "-c", "import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                          "print(l.ptrace(0, 0, 0, 0), ctypes.get_errno())")
    assert r.stdout.split() == [b"-1", b"1"]


async def test_ordinary_work_still_works_under_the_filter(sandbox):
    r = await sandbox.run("python3", "-c", "print(1)")
    assert (r.exit_code, r.stdout) == (0, b"1\n"), r.stderr
    r = await sandbox.sh("echo a b c | tr ' ' '\\n' | sort -r | head -2 | wc -l; (sleep 0.01 &) ; wait; "
                         "for i in 1 2 3; do /bin/true || exit 9; done; echo $(echo nested)")
    assert (r.exit_code, r.stdout) == (0, b"2\nnested\n"), r.stderr
    script = ("import threading, subprocess, os, multiprocessing as mp\n"
              "out = []\n"
              "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
              "[t.start() for t in ts]; [t.join() for t in ts]\n"
              "p = subprocess.run(['sh', '-c', 'echo sub'], capture_output=True, check=True)\n"
              "pid = os.fork()\n"
              "if pid == 0: os._exit(7)\n"
              "st = os.waitpid(pid, 0)[1]\n"
              "with mp.get_context('fork').Pool(2) as pool: sq = pool.map(abs, [-1, -2])\n"
              "print(len(out), p.stdout.decode().strip(), os.waitstatus_to_exitcode(st), sq)\n")
    r = await sandbox.run("python3", "-c", script, cwd="/workspace")
    assert (r.exit_code, r.stdout) == (0, b"8 sub 7 [1, 2]\n"), r.stderr


WORKLOAD = r"""
import asyncio, json, multiprocessing as mp, os, socket, sqlite3, subprocess, sys, tarfile, tempfile, threading
out = {}
ts = [threading.Thread(target=lambda: sum(range(10000))) for _ in range(16)]
[t.start() for t in ts]; [t.join() for t in ts]
out["threads"] = len(ts)
with socket.socket() as srv:
    srv.bind(("127.0.0.1", 0)); srv.listen()
    with socket.create_connection(srv.getsockname()) as c:
        peer, _ = srv.accept(); c.sendall(b"ping"); out["tcp"] = peer.recv(4).decode(); peer.close()
a, b = socket.socketpair(); a.send(b"x"); out["unix"] = b.recv(1).decode()
async def echo():
    server = await asyncio.start_server(lambda r, w: (w.write(b"hi"), w.close()), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    data = await reader.read(); writer.close(); server.close(); return data.decode()
out["asyncio"] = asyncio.run(echo())
for method in ("fork", "spawn", "forkserver"):
    with mp.get_context(method).Pool(2) as pool:
        out[method] = pool.map(abs, [-1, -2])
out["subprocess"] = subprocess.run(["sh", "-c", "echo $((6*7)) | cat"], capture_output=True, check=True).stdout.decode().strip()
db = sqlite3.connect("/workspace/t.db"); db.execute("create table t(x)"); db.execute("insert into t values (1)")
db.commit(); out["sqlite"] = db.execute("select count(*) from t").fetchone()[0]
with tarfile.open("/workspace/t.tgz", "w:gz") as t: t.add("/workspace/t.db", "t.db")
out["tar"] = subprocess.run(["tar", "tzf", "/workspace/t.tgz"], capture_output=True, check=True).stdout.decode().strip()
out["tty"] = os.isatty(0)
print(json.dumps(out))
"""
C_PROGRAM = '#include <stdio.h>\n#include <pthread.h>\nvoid *f(void *a) { return a; }\nint main(void) { pthread_t t; ' \
            'pthread_create(&t, 0, f, 0); pthread_join(t, 0); printf("c ok\\n"); return 0; }\n'
CXX_PROGRAM = '#include <iostream>\n#include <thread>\nint main() { std::thread t([]{}); t.join(); std::cout << "c++ ok\\n"; }\n'


async def test_a_broad_userland_workload_runs_under_the_filter(fleet):
    """It works, and none of it makes a call the filter refuses: the first violation after it is
    the one refused call made on purpose at the end (records arrive in order)."""
    from tests.security.test_syscall_violations import CALL, Violations

    sb = await fleet.create(memory_mb=512, host_view=True, timeout_s=300)
    seen = Violations(fleet, sb.id)
    await seen.started()
    try:
        r = await sb.exec(["python3", "-c", WORKLOAD], cwd="/workspace", timeout_s=120)
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout) == {"threads": 16, "tcp": "ping", "unix": "x", "asyncio": "hi", "fork": [1, 2],
                                        "spawn": [1, 2], "forkserver": [1, 2], "subprocess": "42", "sqlite": 1,
                                        "tar": "t.db", "tty": False}
        script = "cd /workspace && git init -q r && cd r && echo a > a && git add a && " \
                 "git -c user.name=t -c user.email=t@t commit -qm a && git log --oneline | wc -l"
        # a venv is a pip install (of the wheels Python bundles: no network needed)
        r = await sb.exec(["sh", "-c", "python3 -m venv /workspace/v && /workspace/v/bin/python -m pip list"],
                          timeout_s=180)
        assert r.exit_code == 0 and b"pip" in r.stdout, r
        if shutil.which("git"):
            r = await sb.exec(["sh", "-c", script], timeout_s=60)
            assert (r.exit_code, r.stdout.strip()) == (0, b"1"), r
        if shutil.which("gcc"):
            await sb.write_file("/workspace/p.c", C_PROGRAM.encode())
            r = await sb.exec(["sh", "-c", "cd /workspace && gcc -O1 -pthread -o p p.c && ./p"], timeout_s=120)
            assert (r.exit_code, r.stdout) == (0, b"c ok\n"), r
        if shutil.which("g++"):
            await sb.write_file("/workspace/q.cc", CXX_PROGRAM.encode())
            r = await sb.exec(["sh", "-c", "cd /workspace && g++ -O1 -pthread -o q q.cc && ./q"], timeout_s=120)
            assert (r.exit_code, r.stdout) == (0, b"c++ ok\n"), r
        if shutil.which("node"):
            r = await sb.exec(["node", "-e", "require('fs').writeFileSync('/workspace/n', 'x'); "
                               "require('child_process').execSync('true'); console.log('node ok')"], timeout_s=60)
            assert (r.exit_code, r.stdout) == (0, b"node ok\n"), r
        if shutil.which("java"):
            r = await sb.exec(["java", "-Xmx64m", "-XX:+UseSerialGC", "-version"], timeout_s=120)
            assert r.exit_code == 0 and b"version" in r.stderr, r
        if X86_64:
            r = await sb.exec(["python3", "-S", "-c", CALL % (101, [0, 0, 0, 0])])  # ptrace(TRACEME)
            assert json.loads(r.stdout) == [-1, 1], r
            await seen.wait_for("syscall.ptrace", 0)
            assert [v.attempted for v in seen.seen][0].startswith("ptrace("), [v.attempted for v in seen.seen]
    finally:
        seen.close()
        await sb.destroy()


def test_install_seccomp_refuses_a_malformed_program():
    """A malformed program is an error, not a silently unfiltered sandbox."""
    from linuxnode import syscalls as linux
    with pytest.raises(OSError):
        linux.install_seccomp(b"")
    with pytest.raises(OSError):
        linux.install_seccomp(b"1234567")


async def test_container_processes_run_under_the_same_rules(fleet, base):  # noqa: F811
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    try:
        r = await sb.exec(["sh", "-c", "grep -E '^Seccomp:' /proc/1/status /proc/self/status"])
        assert r.stdout.count(b"Seccomp:\t2") == 2, r
        for flag in ("-U", "-n"):
            r = await sb.exec(["busybox", "unshare", flag, "true"])
            assert r.exit_code != 0 and b"Operation not permitted" in r.stderr, (flag, r)
        r = await sb.exec(["sh", "-c", "echo a | cat | wc -l"])
        assert (r.exit_code, r.stdout.strip()) == (0, b"1")
    finally:
        await sb.destroy()

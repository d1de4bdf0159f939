"""What the allowlist seccomp filter costs beside the denylist it replaced (issue 14 §3).

    .venv/bin/python -m loadtest.seccomp_cost [--n 200000] [--rounds 5] [--cycles 150]

Two measurements, the filters alternating round by round so both see the same machine noise:
- syscall loops in C (compiled here with gcc) in one child per side that installs the filter
  itself (no_new_privs, then the raw program, as the spawner does) and times loops of cheap
  calls; `none` is the same child with no filter:
    install     the prctl that installs it, once per sandbox process (ns, not per call)
    getpid      allowed whatever its arguments: the kernel's action cache skips the filter
    read_64     64-byte reads of /dev/zero: the same
    ioctl       FIONREAD on a pipe: allowed only for some commands, so the program runs
    socket      socket(AF_UNIX) + close: the program runs for socket (its families are checked)
- create → exec `true` → destroy cycles with the kernel library called directly (no bus: the
  part the filter touches), the spawner restarted with each side's filter.

`denylist` is the filter before the allowlist: default allow, its refused calls and argument
rules rebuilt here from the same libseccomp (without the personality prefix, a few
instructions).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest.create_rate import direct_round
from loadtest.report import percentiles, print_table, write_json
from linuxnode import process, seccomp

DENYLIST = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "pivot_root",
    "mount_setattr", "unshare", "setns", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "iopl", "ioperm", "clock_settime", "settimeofday", "adjtimex", "clock_adjtime", "syslog",
)


def denylist_filter() -> bytes:
    """The filter as it was: default allow, the denylist and the clone/ioctl argument rules."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    rules = [{"names": list(DENYLIST), **eperm}]
    rules += [{"names": ["clone"], **eperm, "args": [{"index": 0, "value": bit, "valueTwo": bit,
                                                      "op": "SCMP_CMP_MASKED_EQ"}]}
              for bit in seccomp.CLONE_NS_FLAGS.values()]
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    for code, cmds in ((errno.EPERM, seccomp.IOCTLS_REFUSED), (errno.EOPNOTSUPP, seccomp.IOCTLS_UNSUPPORTED)):
        rules += [{"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": code,
                   "args": [{"index": 1, "value": 0xFFFFFFFF, "valueTwo": cmd, "op": "SCMP_CMP_MASKED_EQ"}]}
                  for cmd in cmds.values()]
    return seccomp.compile_oci({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules})


FILTERS = {"denylist": denylist_filter, "allowlist": seccomp.filter_bytes}

LOOPS_C = r"""
/* argv: filter file (empty: none), n. Installs the filter as the spawner does (no_new_privs,
   then the raw program), then prints ns per call of each loop as JSON: its own CPU time, so
   other work on the machine does not count. */
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec * 1e9 + t.tv_nsec; }

int main(int argc, char **argv) {
    static char program[65536];
    long n = atol(argv[2]);
    double install_ns = 0;
    if (argv[1][0]) {
        int fd = open(argv[1], O_RDONLY);
        ssize_t len = read(fd, program, sizeof program);
        struct sock_fprog prog = {.len = (unsigned short)(len / 8), .filter = (struct sock_filter *)program};
        if (len <= 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
            return 1;
        double t = now();  /* the kernel checks, converts, JIT-compiles it and fills its action cache */
        if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
            return 1;
        install_ns = now() - t;
    }
    int zero = open("/dev/zero", O_RDONLY), p[2], avail;
    char buf[64];
    if (pipe(p)) return 2;
    double t = now();
    for (long i = 0; i < n; i++) syscall(SYS_getpid);
    double getpid_ns = (now() - t) / n;
    t = now();
    for (long i = 0; i < n; i++) if (read(zero, buf, sizeof buf) != sizeof buf) return 3;
    double read_ns = (now() - t) / n;
    t = now();
    for (long i = 0; i < n; i++) if (ioctl(p[0], FIONREAD, &avail)) return 4;
    double ioctl_ns = (now() - t) / n;
    t = now();
    for (long i = 0; i < n / 8; i++) { int s = socket(AF_UNIX, SOCK_STREAM, 0); if (s < 0) return 5; close(s); }
    double socket_ns = (now() - t) / (n / 8);
    printf("{\"install\": %.1f, \"getpid\": %.1f, \"read_64\": %.1f, \"ioctl\": %.1f, \"socket\": %.1f}\n",
           install_ns, getpid_ns, read_ns, ioctl_ns, socket_ns);
    return 0;
}
"""
LOOPS = ("install", "getpid", "read_64", "ioctl", "socket")  # install: ns once, the others ns per call


def build_loops(tmp: Path) -> Path:
    (tmp / "loops.c").write_text(LOOPS_C)
    subprocess.run(["gcc", "-O2", "-o", str(tmp / "loops"), str(tmp / "loops.c")], check=True)
    return tmp / "loops"


def syscall_round(loops: Path, program: Path | None, n: int) -> dict[str, float]:
    """ns per call of each loop in a fresh child under `program` (None: no filter)."""
    out = subprocess.run([str(loops), str(program or ""), str(n)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def create_round(side: str, cycles: int, concurrency: int, offset: int) -> tuple[float, dict[str, list[float]]]:
    program = FILTERS[side]()
    process.shutdown()  # the next spawn starts a spawner with this side's filter
    seccomp.filter_bytes = lambda: program  # what the spawner reads when it starts
    try:
        return asyncio.run(direct_round(cycles, concurrency, offset))
    finally:
        process.shutdown()
        seccomp.filter_bytes = FILTERS["allowlist"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="calls per loop per round (socket does n/8)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=150, help="create cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("results/seccomp_cost.json"))
    args = ap.parse_args()

    programs = {"none": b"", **{side: build() for side, build in FILTERS.items()}}
    loops: dict[str, list[dict[str, float]]] = {side: [] for side in programs}
    rates: dict[str, list[float]] = {side: [] for side in FILTERS}
    lat: dict[str, dict[str, list[float]]] = {s: {"create": [], "exec": [], "destroy": []} for s in FILTERS}
    with tempfile.TemporaryDirectory(prefix="seccomp-cost-") as tmp:
        binary = build_loops(Path(tmp))
        files = {side: None if not p else Path(tmp) / side for side, p in programs.items()}
        for side, path in files.items():
            if path is not None:
                path.write_bytes(programs[side])
        for r in range(args.rounds):
            order = list(programs) if r % 2 == 0 else list(reversed(programs))
            for side in order:
                loops[side].append(syscall_round(binary, files[side], args.n))
            for i, side in enumerate(order[-2:] if r % 2 == 0 else order[:2]):
                rate, got = create_round(side, args.cycles, args.concurrency, (2 * r + i) * args.cycles)
                rates[side].append(rate)
                for k, v in got.items():
                    lat[side][k].extend(v)
                print(f"round {r + 1}/{args.rounds} {side:<9} {rate:6.1f} cycles/s", flush=True)

    ns_per_call = {side: {loop: statistics.median(s[loop] for s in rows) for loop in LOOPS}
                   for side, rows in loops.items()}
    results = {
        "program_instructions": {side: len(p) // 8 for side, p in programs.items()},
        "ns_per_call": ns_per_call,
        "create": {side: {"cycles_per_s": round(statistics.median(rates[side]), 1),
                          "rounds_cycles_per_s": [round(x, 1) for x in rates[side]],
                          **{k: percentiles(v) for k, v in lat[side].items()}} for side in FILTERS},
    }
    results["create_ratio_allowlist_over_denylist"] = round(
        results["create"]["allowlist"]["cycles_per_s"] / results["create"]["denylist"]["cycles_per_s"], 3)
    # each round runs the two sides back to back: their ratio is less at the mercy of the machine's load
    results["create_ratio_median_of_rounds"] = round(statistics.median(
        a / d for a, d in zip(rates["allowlist"], rates["denylist"])), 3)
    ns = results["ns_per_call"]
    print_table(f"syscall loops (n={args.n}, {args.rounds} rounds, medians; ns per call)",
                ["loop", "no filter", "denylist", "allowlist", "allowlist - denylist"],
                [[loop, ns["none"][loop], ns["denylist"][loop], ns["allowlist"][loop],
                  ns["allowlist"][loop] - ns["denylist"][loop]] for loop in LOOPS])
    c = results["create"]
    print_table(f"create → exec true → destroy, direct, {args.cycles} x {args.rounds} rounds, "
                f"concurrency {args.concurrency}",
                ["filter", "instructions", "cycles/s", "create p50 ms", "exec p50 ms", "destroy p50 ms"],
                [[side, results["program_instructions"][side], c[side]["cycles_per_s"], c[side]["create"]["p50"],
                  c[side]["exec"]["p50"], c[side]["destroy"]["p50"]] for side in FILTERS])
    print(f"create ratio allowlist/denylist: {results['create_ratio_allowlist_over_denylist']} "
          f"(median of the rounds' ratios: {results['create_ratio_median_of_rounds']})")
    print(f"-> {write_json(args.out, 'seccomp_cost', vars(args) | {'out': str(args.out)}, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

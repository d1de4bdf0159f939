"""What the allowlist seccomp filter costs beside the denylist it replaced (issue 14 §3).

    .venv/bin/python -m loadtest.seccomp_cost [--n 200000] [--rounds 5] [--cycles 150]

Two measurements, the filters alternating round by round so both see the same machine noise:
- syscall loops in one child process per side that installs the filter itself (no_new_privs,
  then the raw program, as the spawner does) and times loops of cheap calls;
  `none` is the same child with no filter:
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

CHILD = r"""
import array, fcntl, json, os, socket, sys, termios, time
sys.path.insert(0, sys.argv[3])
program, n = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
if program:
    from linuxnode import syscalls
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    syscalls.install_seccomp(program)
zero = os.open("/dev/zero", os.O_RDONLY)
r, w = os.pipe()
buf = array.array("i", [0])

def rate(count, step):
    t = time.perf_counter()
    for _ in range(count):
        step()
    return count / (time.perf_counter() - t)

loops = {
    "getpid": (n, os.getpid),
    "read_64": (n, lambda: os.read(zero, 64)),
    "ioctl": (n, lambda: fcntl.ioctl(r, termios.FIONREAD, buf)),
    "socket": (n // 8, lambda: socket.socket(socket.AF_UNIX).close()),
}
for count, step in loops.values():
    rate(count // 20, step)
print(json.dumps({name: rate(count, step) for name, (count, step) in loops.items()}))
"""
LOOPS = ("getpid", "read_64", "ioctl", "socket")


def syscall_round(program: bytes, n: int) -> dict[str, float]:
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-S", "-c", CHILD, program.hex(), str(n), root],
                         capture_output=True, text=True, check=True)
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
    ap.add_argument("--n", type=int, default=200_000, help="calls per loop per round (socket does n/8)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=150, help="create cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("results/seccomp_cost.json"))
    args = ap.parse_args()

    programs = {"none": b"", **{side: build() for side, build in FILTERS.items()}}
    loops: dict[str, list[dict[str, float]]] = {side: [] for side in programs}
    rates: dict[str, list[float]] = {side: [] for side in FILTERS}
    lat: dict[str, dict[str, list[float]]] = {s: {"create": [], "exec": [], "destroy": []} for s in FILTERS}
    for r in range(args.rounds):
        order = list(programs) if r % 2 == 0 else list(reversed(programs))
        for side in order:
            loops[side].append(syscall_round(programs[side], args.n))
        for i, side in enumerate(order[-2:] if r % 2 == 0 else order[:2]):
            rate, got = create_round(side, args.cycles, args.concurrency, (2 * r + i) * args.cycles)
            rates[side].append(rate)
            for k, v in got.items():
                lat[side][k].extend(v)
            print(f"round {r + 1}/{args.rounds} {side:<9} {rate:6.1f} cycles/s", flush=True)

    per_s = {side: {loop: statistics.median(s[loop] for s in rows) for loop in LOOPS} for side, rows in loops.items()}
    results = {
        "program_instructions": {side: len(p) // 8 for side, p in programs.items()},
        "syscalls_per_s": per_s,
        "ns_per_call": {side: {loop: 1e9 / v for loop, v in row.items()} for side, row in per_s.items()},
        "create": {side: {"cycles_per_s": round(statistics.median(rates[side]), 1),
                          "rounds_cycles_per_s": [round(x, 1) for x in rates[side]],
                          **{k: percentiles(v) for k, v in lat[side].items()}} for side in FILTERS},
    }
    results["create_ratio_allowlist_over_denylist"] = round(
        results["create"]["allowlist"]["cycles_per_s"] / results["create"]["denylist"]["cycles_per_s"], 3)
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
    print(f"create ratio allowlist/denylist: {results['create_ratio_allowlist_over_denylist']}")
    print(f"-> {write_json(args.out, 'seccomp_cost', vars(args) | {'out': str(args.out)}, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

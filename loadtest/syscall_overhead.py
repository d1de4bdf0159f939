"""What the syscall tracepoint programs cost a sandbox: a syscall-heavy loop with and without them.

    .venv/bin/python -m loadtest.syscall_overhead [--n 200000] [--rounds 5]

One process runs loops of cheap syscalls on three sides: `watched` (the programs are
attached and its v2 cgroup is in their sandbox map: what a sandbox pays), `unwatched` (attached,
its cgroup not in the map: what every other process on the node pays) and `bare` (no program
loaded). It moves itself between two cgroups, so watched and unwatched rounds alternate on the
same process; bare rounds run before the programs are loaded and after they are closed (the
compile takes seconds, so it is not repeated per round). Rates are medians over rounds.

  getppid     a syscall that succeeds: raw sys_exit runs and returns at its first test
  open_close  openat + close of a file: the openat tracepoint reads the path and looks it up
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtest.report import print_table, write_json
from linuxnode import cgroups

CHILD = r"""
import json, os, sys, time
n = int(sys.argv[1])
dirs = json.loads(sys.argv[2])
fds = {side: os.open(d + "/cgroup.procs", os.O_WRONLY) for side, d in dirs.items()}
getppid, open_, close = os.getppid, os.open, os.close

def getppid_rate(count):
    t = time.perf_counter()
    for _ in range(count):
        getppid()
    return count / (time.perf_counter() - t)

def open_close_rate(count):
    t = time.perf_counter()
    for _ in range(count):
        close(open_("/etc/hostname", os.O_RDONLY))
    return count / (time.perf_counter() - t)

getppid_rate(1000), open_close_rate(1000)
print("ready", flush=True)
for line in sys.stdin:
    side = line.strip()
    os.pwrite(fds[side], b"0", 0)  # "0": the writing process itself
    print(json.dumps({"getppid": getppid_rate(n), "open_close": open_close_rate(n // 4)}), flush=True)
"""
LOOPS = ("getppid", "open_close")


def _round(child: subprocess.Popen, side: str) -> dict[str, float]:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(side + "\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def run(n: int, rounds: int) -> dict:
    from linuxnode.bpf.syscall_watch import SyscallWatch

    layout = cgroups.CgroupLayout.detect()
    parent = f"{layout.v2}/{cgroups.PARENT}/bench-syscalls{os.getpid()}"
    dirs = {"watched": f"{parent}/watched", "unwatched": f"{parent}/unwatched"}
    for d in (parent, *dirs.values()):
        os.makedirs(d, exist_ok=True)
    child = subprocess.Popen([sys.executable, "-S", "-c", CHILD, str(n), json.dumps(dirs)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    samples: dict[str, list[dict[str, float]]] = {"bare": [], "watched": [], "unwatched": []}
    watch = None
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for _ in range((rounds + 1) // 2):
            samples["bare"].append(_round(child, "unwatched"))
        t = time.monotonic()
        watch = SyscallWatch()
        load_s = time.monotonic() - t
        watch.watch(dirs["watched"])
        for i in range(rounds):
            for side in (("watched", "unwatched") if i % 2 == 0 else ("unwatched", "watched")):
                samples[side].append(_round(child, side))
        records = []
        watch.poll(records.append, 0)
        watch.close()
        watch = None
        for _ in range(rounds // 2):
            samples["bare"].append(_round(child, "unwatched"))
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(10)
        if watch is not None:
            watch.close()
        for d in (*dirs.values(), parent):
            os.rmdir(d)
    rates = {side: {loop: statistics.median(s[loop] for s in rows) for loop in LOOPS} for side, rows in samples.items()}
    return {
        "rates_per_s": rates,
        "ns_per_call": {side: {loop: 1e9 / r for loop, r in v.items()} for side, v in rates.items()},
        "slowdown_vs_bare": {side: {loop: 1 - rates[side][loop] / rates["bare"][loop] for loop in LOOPS}
                             for side in ("watched", "unwatched")},
        "program_load_s": load_s,
        "records_during_loops": len(records),  # nothing in the loops is refused or sensitive: 0
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000, help="getppid calls per round (open_close does n/4)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/syscall_overhead.json"))
    args = ap.parse_args()
    results = run(args.n, args.rounds)
    r, ns, slow = results["rates_per_s"], results["ns_per_call"], results["slowdown_vs_bare"]
    print_table(
        f"syscall tracepoint overhead (n={args.n}, rounds={args.rounds}, medians)",
        ["loop", "bare /s", "watched /s", "unwatched /s", "bare ns", "watched ns", "watched slowdown",
         "unwatched slowdown"],
        [[loop, r["bare"][loop], r["watched"][loop], r["unwatched"][loop], ns["bare"][loop], ns["watched"][loop],
          f"{slow['watched'][loop]:+.1%}", f"{slow['unwatched'][loop]:+.1%}"] for loop in LOOPS],
    )
    print(f"programs compiled and attached in {results['program_load_s']:.2f} s; "
          f"records during the loops: {results['records_during_loops']}")
    print(f"-> {write_json(args.out, 'syscall_overhead', vars(args) | {'out': str(args.out)}, results)}")


if __name__ == "__main__":
    main()

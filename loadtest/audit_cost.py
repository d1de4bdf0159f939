"""What kernel audit costs a process: a getppid loop in a fresh process with audit off, on
with no rule, and on under the node agent's `-a task,never` rules.

    .venv/bin/python -m loadtest.audit_cost [--n 2000000] [--rounds 5] [--toggle-off]

Whether a task pays is decided once, when it is created: with audit on (or ever on since
boot) and no task rule saying `never`, it gets a syscall audit context and every syscall
takes the slow path through the audit hooks. So every sample is a new process (a small C
loop of raw getppid syscalls, best tenth of the loop: preemption on a busy host only adds),
made after the state it measures is set; sides alternate within each round and the figures
are medians over rounds. The benchmark installs the agent's rules (its own key: never for
every task whose login uid is not a sandbox audit tag) for the run and removes them after.

  off             audit off (enabled=0), no rule applies: after audit was once on, a new task
                  still gets a context; its syscalls take the slow path and return early. Only
                  with --toggle-off where audit is on: turning it off is host-wide (Landlock
                  denials of everyone go unrecorded meanwhile).
  on              audit on, no rule at all: what every process paid before the agent had rules.
                  Skipped when someone's task rules are present (they decide for untagged tasks).
  sandbox_tagged  audit on, the agent's rules, a process made with a sandbox's audit tag: no
                  rule applies, so it has a context (what a sandbox process pays: the same as `on`).
  host_never      audit on, the agent's rules, an untagged process: `never`, no context, the
                  fast path (what the host's own processes pay, as if audit had never been on).

Needs root (CAP_AUDIT_CONTROL) and a C compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from loadtest.report import print_table, write_json
from linuxnode import audit, landlock

CHILD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    if (strcmp(argv[2], "-") != 0) {  /* a sandbox's audit tag, set before the measured process is made */
        int fd = open("/proc/self/loginuid", O_WRONLY);
        if (fd < 0 || write(fd, argv[2], strlen(argv[2])) < 0) return 2;
        close(fd);
    }
    pid_t pid = fork();  /* tagged or not, the measured process is a fork of this one */
    if (pid) { int st; waitpid(pid, &st, 0); return WIFEXITED(st) ? WEXITSTATUS(st) : 3; }
    double best = 1e18;
    for (int chunk = 0; chunk < 10; chunk++) {  /* the best tenth: preemption on a busy host only adds */
        double t = now();
        for (long i = 0; i < n / 10; i++) syscall(SYS_getppid);
        double per = (now() - t) / (n / 10);
        if (per < best) best = per;
    }
    printf("%.2f\n", best);
    return 0;
}
"""
TAG = landlock.audit_tag(["/bench/audit-cost"])  # any value in the sandbox tag range
KEY = f"sandfleet-bench-audit-cost pid={os.getpid()}"


def _build(directory: str) -> str:
    source, binary = os.path.join(directory, "getppid.c"), os.path.join(directory, "getppid")
    with open(source, "w") as f:
        f.write(CHILD_C)
    subprocess.run(["cc", "-O2", "-o", binary, source], check=True)
    return binary


def _sample(binary: str, n: int, tag: int | None = None) -> float:
    out = subprocess.run([binary, str(n), "-" if tag is None else str(tag)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip())


SCOPED = tuple(audit.Rule(audit.AUDIT_FILTER_TASK, audit.AUDIT_NEVER, ((audit.AUDIT_LOGINUID, op, bound),), key=KEY)
               for op, bound in ((audit.LESS_THAN, audit.TAG_MIN), (audit.GREATER_THAN, audit.TAG_MAX)))
SIDES = ("off", "on", "sandbox_tagged", "host_never")


def run(n: int, rounds: int, toggle_off: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(_build(tmp), n, rounds, toggle_off)


def _run(binary: str, n: int, rounds: int, toggle_off: bool) -> dict:
    before = audit.status()
    task_rules = [r for r in audit.rules() if r.filter == audit.AUDIT_FILTER_TASK]
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    for rule in SCOPED:
        audit.add_rule(rule)
    try:
        for _ in range(rounds):
            if before.enabled == 0 or toggle_off:
                audit.set_enabled(0)
                samples["off"].append(_sample(binary, n, TAG))  # a task made with audit off
            audit.set_enabled(1)
            if not task_rules:  # with someone's task rule in place, an untagged task is not "no rule"
                for rule in SCOPED:
                    audit.delete_rule(rule)
                try:
                    samples["on"].append(_sample(binary, n))
                finally:
                    for rule in SCOPED:
                        audit.add_rule(rule)
            samples["sandbox_tagged"].append(_sample(binary, n, TAG))
            samples["host_never"].append(_sample(binary, n))
    finally:
        for rule in SCOPED:
            audit.delete_rule(rule)
        if audit.status().enabled != before.enabled and before.enabled != 2:
            audit.set_enabled(before.enabled)
    ns = {side: statistics.median(v) for side, v in samples.items() if v}
    base = ns["host_never"]
    return {
        "ns_per_getppid": ns,
        "extra_ns_vs_no_context": {side: v - base for side, v in ns.items()},
        "skipped": [side for side in SIDES if not samples[side]],
        "audit_enabled_before": before.enabled,
        "task_rules_before": [r.key for r in task_rules],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2_000_000, help="getppid calls per sample")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--toggle-off", action="store_true", help="measure `off` by turning audit off host-wide briefly")
    ap.add_argument("--out", type=Path, default=Path("results/audit_cost.json"))
    args = ap.parse_args()
    results = run(args.n, args.rounds, args.toggle_off)
    path = write_json(args.out, "audit_cost", vars(args) | {"out": str(args.out)}, results)
    rows = [[side, ns, results["extra_ns_vs_no_context"][side]] for side, ns in results["ns_per_getppid"].items()]
    print_table("getppid in a fresh process (median over rounds of the best tenth, ns per call)",
                ["side", "ns/call", "extra vs no context"], rows)
    if results["skipped"]:
        print(f"skipped: {', '.join(results['skipped'])}")
    print(f"\n{json.dumps(results['ns_per_getppid'])}\nwritten to {path}")


if __name__ == "__main__":
    main()

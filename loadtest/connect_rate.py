"""connect() rate inside a sandbox with and without the egress programs, and violation latency.

    .venv/bin/python -m loadtest.connect_rate [--n 20000] [--tcp-n 4000] [--rounds 20] [--denials 2000]

A sandbox process (real cgroups + netns, a veth to a peer namespace that accepts TCP) runs
loops of connect() to an allowed address, on three sides: `with` (the allowlist programs
on its cgroup), `without` (programs on another cgroup only, so the kernel's hooks are
live) and `bare` (none of ours on the node). It holds both cgroups open and moves itself
between them, the sides rotating order each round, so all see the same process, caches
and machine noise; rates are medians over rounds, slowdowns medians of per-round ratios.
The allow rule is a port-less /24.

  udp_connect  connect() of a UDP socket: the bare syscall, where the hook's cost shows most
  tcp_connect  socket + connect (full handshake over the veth) + close: what a program does

Rates on a small shared VM swing by tens of percent between rounds, so the programs' own
cost is also read from the kernel's run-time counters (BPF_ENABLE_STATS, on for one extra
round only) and given as a share of a bare call.

Violation latency: the sandbox makes paced denied connects; each one's ring-buffer record
is decoded by a reader thread; latency = decode time - the kernel's timestamp at the hook.
Only namespaces made here carry traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from loadtest.report import percentiles, print_table, write_json
from linuxnode import cgroups, netns

NODE = f"bench-egress{os.getpid()}"
PEER, SANDBOX = "10.78.0.1", "10.78.0.2"
PORT = 8080
DENIED = "10.78.0.9"

CHILD = r"""
import json, os, socket, struct, sys, time
mode, n, peer, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
linger = struct.pack("ii", 1, 0)


def udp_rate(count):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    t = time.perf_counter()
    for _ in range(count):
        s.connect((peer, port))
    rate = count / (time.perf_counter() - t)
    s.close()
    return rate


def tcp_rate(count):
    t = time.perf_counter()
    for _ in range(count):
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)  # RST on close: no TIME_WAIT pile-up
        c.connect((peer, port))
        c.close()
    return count / (time.perf_counter() - t)


def move(fds):
    for fd in fds:
        os.pwrite(fd, b"0", 0)  # "0": the writing process itself


if mode == "rates":  # one round per line on stdin: the side to run it on
    cgroups = json.loads(sys.argv[5])
    udp_rate(1000), tcp_rate(100)
    for line in sys.stdin:
        side = line.strip()
        move(cgroups["without" if side == "bare" else side])
        out = {"udp_connect": udp_rate(n), "tcp_connect": tcp_rate(int(sys.argv[6]))}
        print(json.dumps(out), flush=True)
    sys.exit(0)
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    refused, spent = 0, []
    for _ in range(n):
        t = time.perf_counter()
        try:
            s.connect((peer, port))
        except PermissionError:
            refused += 1
        spent.append((time.perf_counter() - t) * 1e6)
        time.sleep(0.001)
    out = {"refused": refused, "denied_connect_us": sorted(spent)[len(spent) // 2]}
print(json.dumps(out))
"""

ACCEPTOR = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(4096)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.close()
"""


def _in(ns: str) -> list[str]:
    """argv prefix running a command in the network namespace named `ns` (netns.create's path, in
    the node's netns holder: `ip -n`/`ip netns exec` look on the host's /run/netns only)."""
    return ["nsenter", f"--net={netns.resolve(ns)}"]


def _ip(ns: str, *args: str) -> None:
    subprocess.run([*_in(ns), "ip", *args], check=True, capture_output=True)


class Bench:
    """One sandbox netns with a veth to an accepting peer, and two cgroups to run it in: "with"
    (programs attached) and "without". The measuring process moves itself between them."""

    def __init__(self) -> None:
        self.layout = cgroups.CgroupLayout.detect()
        self.groups = {side: cgroups.SandboxCgroups(self.layout, NODE, side) for side in ("with", "without")}
        self.acceptor: subprocess.Popen | None = None

    def up(self) -> None:
        for group in self.groups.values():
            group.create(cpu=1, memory_mb=512, pids=64)
        self.sbx, self.peer = netns.create(NODE, "sbx"), netns.create(NODE, "peer")
        _ip(self.peer, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", netns.resolve(self.sbx))  # a path: ip opens it
        _ip(self.peer, "addr", "add", f"{PEER}/24", "dev", "eth0")
        _ip(self.peer, "link", "set", "eth0", "up")
        _ip(self.sbx, "addr", "add", f"{SANDBOX}/24", "dev", "eth0")
        _ip(self.sbx, "link", "set", "eth0", "up")
        self.acceptor = subprocess.Popen(
            [*_in(self.peer), sys.executable, "-c", ACCEPTOR, PEER, str(PORT)],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.acceptor.stdout.readline().strip() == "ready"

    def child(self, mode: str, n: int, target: str, side: str = "with", tcp_n: int = 0) -> subprocess.Popen:
        """The measuring process, started in `side`'s cgroups and the sandbox netns; it holds
        every cgroup's cgroup.procs open so it can move itself between the sides."""
        fds = {s: [os.open(f, os.O_WRONLY) for f in g.procs_files] for s, g in self.groups.items()}
        try:
            start = " ".join(str(fd) for fd in fds[side])
            cmd = ["sh", "-c", f'for fd in {start}; do echo $$ > /proc/self/fd/$fd; done; exec "$@"', "sh",
                   *_in(self.sbx),
                   sys.executable, "-c", CHILD, mode, str(n), target, str(PORT), json.dumps(fds), str(tcp_n)]
            return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    pass_fds=[fd for group in fds.values() for fd in group])
        finally:
            for group in fds.values():
                for fd in group:
                    os.close(fd)

    def run(self, mode: str, n: int, target: str) -> dict:
        proc = self.child(mode, n, target)
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark child failed ({proc.returncode})")
        return json.loads(out)

    def down(self) -> None:
        if self.acceptor is not None:
            self.acceptor.kill()
            self.acceptor.wait()
        for group in self.groups.values():
            group.remove()
        netns.remove(NODE, "sbx")
        netns.remove(NODE, "peer")
        cgroups.remove_node_root(self.layout, NODE)


SIDES = ("with", "without", "bare")


def measure_rates(bench: Bench, policy, n: int, tcp_n: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Rounds on each side in rotating order: `with` = programs on the sandbox's cgroup,
    `without` = programs on another cgroup only (the hooks are live on the node), `bare` = no
    program of ours anywhere (the kernel skips the hooks unless something else uses them)."""
    rates: dict[str, dict[str, list[float]]] = {s: {"udp_connect": [], "tcp_connect": []} for s in SIDES}
    proc = bench.child("rates", n, PEER, side="without", tcp_n=tcp_n)
    try:
        for r in range(rounds):
            for side in SIDES[r % 3:] + SIDES[: r % 3]:
                if side == "bare":
                    policy.detach_all()
                elif not policy.attached():
                    policy.allow(policy.attach(bench.groups["with"].v2_dir), "10.78.0.0/24")
                proc.stdin.write(side + "\n")
                proc.stdin.flush()
                got = json.loads(proc.stdout.readline())
                for k, v in got.items():
                    rates[side][k].append(v)
            print(f"round {r + 1}/{rounds}: " + "  ".join(
                f"{s} udp {rates[s]['udp_connect'][-1]:7.0f}/s tcp {rates[s]['tcp_connect'][-1]:6.0f}/s" for s in SIDES
            ), flush=True)
    finally:
        proc.stdin.close()
        proc.wait(60)
        policy.detach_all()
    return rates


def measure_program_cost(bench: Bench, policy, n: int, tcp_n: int) -> dict[str, float]:
    """ns per run of each hook on one `with` round, counted by the kernel (BPF_ENABLE_STATS, on
    only for this round: counting has its own cost). Steadier than rates on a noisy machine."""
    from linuxnode.bpf import cgroup_progs

    policy.allow(policy.attach(bench.groups["with"].v2_dir), "10.78.0.0/24")
    proc = bench.child("rates", n, PEER, side="with", tcp_n=tcp_n)
    progs = {name: fd for name, fd in policy.programs().items() if name in ("sf_connect4", "sf_sock_create")}
    before = {name: cgroup_progs.run_stats(fd) for name, fd in progs.items()}
    stats_fd = cgroup_progs.enable_run_stats()
    try:
        proc.stdin.write("with\n")
        proc.stdin.flush()
        proc.stdout.readline()
    finally:
        os.close(stats_fd)
        proc.stdin.close()
        proc.wait(60)
        policy.detach_all()
    cost = {}
    for name, fd in progs.items():
        (t0, c0), (t1, c1) = before[name], cgroup_progs.run_stats(fd)
        cost[name.removeprefix("sf_") + "_ns"] = round((t1 - t0) / max(1, c1 - c0), 1)
    return cost


def measure_violations(bench: Bench, policy, n: int) -> tuple[list[float], dict]:
    """Latencies in µs from the hook's timestamp to the decoded record, and the child's own figures."""
    latencies_us: list[float] = []
    done = threading.Event()

    def sink(denial) -> None:
        latencies_us.append((time.monotonic_ns() - denial.monotonic_ns) / 1e3)

    def reader() -> None:
        while not done.is_set():
            policy.poll(sink, 50)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        child = bench.run("denials", n, DENIED)
        deadline = time.monotonic() + 5
        while len(latencies_us) < child["refused"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        thread.join(5)
    return latencies_us, child


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="UDP connects per round and side")
    ap.add_argument("--tcp-n", type=int, default=4000, help="TCP connects per round and side")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--denials", type=int, default=2000, help="denied connects for the latency figures")
    ap.add_argument("--out", type=Path, default=Path("results/connect_rate.json"))
    args = ap.parse_args()

    from linuxnode.bpf import EgressPolicy

    t = time.perf_counter()
    policy = EgressPolicy()
    compile_s = time.perf_counter() - t
    bench = Bench()
    try:
        bench.up()
        rates = measure_rates(bench, policy, args.n, args.tcp_n, args.rounds)
        cost = measure_program_cost(bench, policy, args.n, args.tcp_n)
        policy.attach(bench.groups["with"].v2_dir)  # no rules: everything is denied
        latencies, child = measure_violations(bench, policy, args.denials)
        lost = policy.lost()
    finally:
        policy.detach_all()
        policy.close()
        bench.down()

    results: dict = {"compile_s": round(compile_s, 2), "program_ns_per_call": cost}
    for kind in ("udp_connect", "tcp_connect"):
        med = {side: statistics.median(rates[side][kind]) for side in SIDES}

        def slower(base: str) -> float:  # paired by round, so slow drift of the machine cancels out
            pairs = zip(rates["with"][kind], rates[base][kind])
            return round(statistics.median((1 - w / b) * 100 for w, b in pairs), 2)

        results[kind] = {
            **{f"{side}_per_s": round(med[side]) for side in SIDES},
            "slower_than_bare_pct": slower("bare"),
            "slower_than_without_pct": slower("without"),
            "rounds": {side: [round(x) for x in rates[side][kind]] for side in SIDES},
        }
    results["violations"] = {
        "sent": args.denials, "refused": child["refused"], "records": len(latencies), "lost": lost,
        "latency_us": percentiles(latencies), "denied_connect_us_p50": round(child["denied_connect_us"], 2),
    }
    print_table(
        f"connect() inside a sandbox, median of {args.rounds} rotating rounds (udp n={args.n}, tcp n={args.tcp_n})",
        ["call", "with /s", "without /s", "bare /s", "slower than bare %", "slower than without %"],
        [[k, *(results[k][f"{side}_per_s"] for side in SIDES), results[k]["slower_than_bare_pct"],
          results[k]["slower_than_without_pct"]] for k in ("udp_connect", "tcp_connect")],
    )
    print("with: programs on the sandbox's cgroup; without: on another cgroup only; bare: none of ours on the node")
    # What the programs themselves add, from the kernel's own run-time counters: connect4 on
    # every connect, plus sock_create on every TCP socket.
    udp_call_ns = 1e9 / results["udp_connect"]["bare_per_s"]
    tcp_call_ns = 1e9 / results["tcp_connect"]["bare_per_s"]
    results["program_share_pct"] = {
        "udp_connect": round(cost["connect4_ns"] / udp_call_ns * 100, 2),
        "tcp_connect": round((cost["connect4_ns"] + cost["sock_create_ns"]) / tcp_call_ns * 100, 2),
    }
    print(f"kernel-counted program cost: connect4 {cost['connect4_ns']} ns, sock_create {cost['sock_create_ns']} ns "
          f"per call = {results['program_share_pct']['udp_connect']}% of a bare UDP connect(), "
          f"{results['program_share_pct']['tcp_connect']}% of a bare TCP connect cycle")
    v = results["violations"]
    print_table(
        f"violation latency: hook → record decoded, {args.denials} paced denials (µs)",
        ["records/sent", "lost", "p50", "p95", "p99", "denied connect p50 µs"],
        [[f"{v['records']}/{v['sent']}", v["lost"], v["latency_us"]["p50"], v["latency_us"]["p95"],
          v["latency_us"]["p99"], v["denied_connect_us_p50"]]],
    )
    out = write_json(args.out, "connect_rate", vars(args) | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

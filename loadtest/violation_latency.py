"""Violation latency end to end: from a denied connect() inside a sandbox to its event on the bus.

    .venv/bin/python -m loadtest.violation_latency [--n 300] [--gap-ms 5] [--sandboxes 2]

Starts a platform (`sandfleet up`), creates sandboxes (one with an allowlist, so it has a
veth and its own rules; one without, loopback only), and runs in each a loop of paced
connect() calls to addresses it may not reach, each to its own port, the wall clock taken
in the sandbox right before the call. A trainer-side subscriber (the SDK's
`fleet.violations()`) records when each event reaches it; latency = arrival - the
sandbox's timestamp, matched by port. Both ends read the same host clock. Reports p50/p95/
p99 per sandbox and pooled, and how many events were missing. No packet leaves the node:
every attempt is refused at the hook.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sandfleet
from loadtest.report import percentiles, print_table, write_json
from sandfleet.config import free_port

FIRST_PORT = 20000
CHILD = r"""
import json, socket, sys, time
host, first, n, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sent = []
for i in range(n):
    s = socket.socket()
    t = time.time()
    try:
        s.connect((host, first + i))
        ok = True
    except PermissionError:
        ok = False
    s.close()
    sent.append((first + i, t, ok))
    time.sleep(gap)
print(json.dumps(sent))
"""


async def measure(fleet, allow: list[str], target: str, n: int, gap_s: float) -> dict:
    sb = await fleet.create(allow=allow, memory_mb=128, labels={"task": "violation-latency"}, host_view=True)
    arrived: dict[int, float] = {}
    done = asyncio.Event()

    async def listen() -> None:
        async for v in fleet.violations(sb.id):
            arrived.setdefault(v.port, time.time())
            if len(arrived) >= n:
                done.set()

    listener = asyncio.create_task(listen())
    try:
        await asyncio.sleep(0.5)  # the subscription is live before the first attempt
        await sb.write_file("/workspace/deny.py", CHILD.encode())
        r = await sb.exec(["python3", "/workspace/deny.py", target, str(FIRST_PORT), str(n), str(gap_s)],
                          timeout_s=600)
        if r.exit_code != 0:
            raise RuntimeError(r.stderr.decode()[-2000:])
        sent = json.loads(r.stdout)
        try:
            await asyncio.wait_for(done.wait(), 10)
        except asyncio.TimeoutError:
            pass
    finally:
        listener.cancel()
        await sb.destroy()
    latencies = [(arrived[port] - t) * 1000 for port, t, ok in sent if not ok and port in arrived]
    return {
        "allow": allow,
        "sent": len(sent),
        "refused": sum(1 for _, _, ok in sent if not ok),
        "events": len(latencies),
        "latencies_ms": latencies,
    }


async def run(url: str, n: int, gap_s: float) -> dict[str, dict]:
    async with sandfleet.connect(url) as fleet:
        await measure(fleet, [], "10.79.0.1", 10, gap_s)  # warm-up, not counted
        return {
            "no_egress": await measure(fleet, [], "10.79.0.1", n, gap_s),
            "with_allowlist": await measure(fleet, ["10.79.1.0/24:443"], "10.79.2.1", n, gap_s),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=300, help="denied connects per sandbox")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="pause between attempts")
    ap.add_argument("--out", type=Path, default=Path("results/violation_latency.json"))
    args = ap.parse_args()

    cli = [sys.executable, "-m", "sandfleet.cli"]
    env = {**os.environ, "SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_NODE_ID": f"bench-viol{os.getpid()}"}
    with tempfile.TemporaryDirectory(prefix="sandfleet-bench-") as tmp:
        up = subprocess.run([*cli, "up", "--detach", "--port", str(free_port()), "--data-dir", tmp,
                             "--node-id", env["SANDFLEET_NODE_ID"]], capture_output=True, text=True, env=env)
        if up.returncode != 0:
            print(up.stderr, file=sys.stderr)
            return 1
        try:
            sides = asyncio.run(run(up.stdout.strip(), args.n, args.gap_ms / 1000))
        finally:
            subprocess.run([*cli, "down", "--data-dir", tmp], capture_output=True, env=env)

    pooled = [x for side in sides.values() for x in side["latencies_ms"]]
    results = {
        name: {k: v for k, v in side.items() if k != "latencies_ms"} | percentiles(side["latencies_ms"])
        for name, side in sides.items()
    }
    results["pooled"] = {"events": len(pooled)} | percentiles(pooled)
    rows = [[name, r.get("sent", ""), r.get("refused", ""), r["events"], r["p50"], r["p95"], r["p99"]]
            for name, r in results.items()]
    print_table(f"violation latency: connect() in the sandbox → event at the subscriber, n={args.n} per sandbox (ms)",
                ["sandbox", "sent", "refused", "events", "p50", "p95", "p99"], rows)
    out = write_json(args.out, "violation_latency", vars(args) | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

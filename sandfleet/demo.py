"""`make demo`: the platform on this machine with a short, real RL-style workload, then a clean stop.

It starts `sandfleet up` in a fresh data dir, creates a batch of process sandboxes in one
request, gives each a small task (write a file, run a script that reads it, grade the
output), shows what a cheating attempt sees and the violation event it causes, lets one sandbox expire, prints a summary and
the lifecycle events, and stops the platform, leaving nothing behind.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sandfleet
from sandfleet.config import free_port

TASK = b"""
import sys
nums = [int(x) for x in open('/workspace/input.txt').read().split()]
print(sum(n * n for n in nums))
"""


async def workload(url: str) -> None:
    async with sandfleet.connect(url) as fleet:
        t0 = time.perf_counter()
        boxes = await fleet.create_many(16, isolation="process", cpu=0.5, memory_mb=128, timeout_s=120,
                                        labels={"task": "demo"}, host_view=True)
        created = time.perf_counter() - t0
        print(f"created {len(boxes)} sandboxes in one request in {created * 1000:.0f} ms")

        async def episode(i: int, sb: sandfleet.Sandbox) -> tuple[bool, float]:
            nums = list(range(i, i + 10))
            start = time.perf_counter()
            await sb.write_file("/workspace/input.txt", " ".join(map(str, nums)).encode())
            await sb.write_file("/workspace/task.py", TASK)
            r = await sb.exec(["python3", "task.py"], timeout_s=30)
            ok = r.exit_code == 0 and int(r.stdout) == sum(n * n for n in nums)
            return ok, (time.perf_counter() - start) * 1000

        results = await asyncio.gather(*(episode(i, sb) for i, sb in enumerate(boxes)))
        passed = sum(ok for ok, _ in results)
        print(f"episodes graded correct: {passed}/{len(boxes)}; "
              f"median episode {statistics.median(ms for _, ms in results):.1f} ms")

        probe = await boxes[0].exec(["sh", "-c", "ls / ; ls /proc | grep -c '^[0-9]'; cat /root/.bash_history"])
        print("what an agent sees at / :", " ".join(probe.stdout.decode().split()[:-1]))
        print("processes it can see   :", probe.stdout.decode().split()[-1])
        print("reading the host's /root:", probe.stderr.decode().strip() or "(nothing)")

        violations = fleet.violations(task="demo")
        first = asyncio.ensure_future(violations.__anext__())
        await asyncio.sleep(0.3)  # the consumer is attached
        cheat = await boxes[1].exec(["python3", "-c", "import socket; socket.create_connection(('10.1.2.3', 80))"])
        print("an agent reaching 10.1.2.3:80:", cheat.stderr.decode().strip().splitlines()[-1])
        v = await asyncio.wait_for(first, 5)
        print(f"violation on the bus     : {v.kind} {v.attempted!r} by {v.command} (pid {v.pid}) task={v.labels.get('task')}")
        await violations.aclose()

        short = await fleet.create(memory_mb=64, timeout_s=1, host_view=True)
        await asyncio.sleep(2.5)
        await asyncio.gather(*(sb.destroy() for sb in boxes))
        history = await fleet.history()
        expired = [e for e in history if e.sandbox_id == short.id and e.name == "stopped"]
        print(f"lifecycle events recorded: {len(history)}; "
              f"short-lived sandbox ended with reason: {expired[0].reason.value if expired else 'not yet'}")
        if passed != len(boxes):
            raise SystemExit("demo failed: some episodes were graded wrong")


def main() -> int:
    cli = [sys.executable, "-m", "sandfleet.cli"]
    with tempfile.TemporaryDirectory(prefix="sandfleet-demo-") as tmp:
        data_dir = Path(tmp)
        up = subprocess.run([*cli, "up", "--detach", "--port", str(free_port()), "--data-dir", tmp],
                            capture_output=True, text=True)
        if up.returncode != 0:
            print(up.stderr, file=sys.stderr)
            return 1
        url = up.stdout.strip()
        print(f"sandfleet is up at {url} (data dir {data_dir})")
        try:
            subprocess.run([*cli, "status", "--nats", url], check=False)
            asyncio.run(workload(url))
        finally:
            subprocess.run([*cli, "down", "--data-dir", tmp], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

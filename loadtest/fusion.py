"""Judged problems per second through the SandboxFusion endpoint, against the same judging done
with the SDK directly (the baseline, in the same run).

    .venv/bin/python -m loadtest.fusion [--problems 164] [--concurrency 16] [--rounds 3]

The workload: `--problems` small Python programs (generated: a function and the asserts that judge
it, HumanEval-sized; one in eight is wrong on purpose, so a verdict can be either). A platform is
started with the endpoint (`SANDFLEET_FUSION_PORT`, as `sandfleet up` starts it) and the
`lang-python` layer is built (`sandfleet fusion layers --only python`; its build time is reported).
Each round judges every problem twice, `--concurrency` at a time: through the endpoint with the
`sandbox-fusion` client's own async `run_code`, and through the SDK as a user of it would judge one
(create a sandbox with the layer, write the program, run it, destroy it). Both must give the same
verdicts; the difference is the endpoint: its HTTP server, request decoding and the client's
session per call. Medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import sandbox_fusion
from sandbox_fusion import RunCodeRequest, RunStatus

import sandfleet
from loadtest.platform import running_platform
from loadtest.report import print_table, write_json
from sandfleet.layers_client import Layers
from sandfleet.config import free_port

LAYER = "lang-python"
ENV = {"SANDFLEET_LOG_LEVEL": "WARNING", "SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0",
       "SANDFLEET_PLACEMENT_MIN_SHARE": "1"}
RUN_TIMEOUT_S = 10.0

# Each: (function source, [(call, expected)]). Variant `i` shifts the constants so no two
# problems are the same program.
_TEMPLATES = [
    ("def add(a, b):\n    return a + b", lambda i: [(f"add({i}, {i + 1})", 2 * i + 1), ("add(-1, 1)", 0)]),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     lambda i: [(f"fib({i % 30})", _fib(i % 30)), ("fib(10)", 55)]),
    ("def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
     lambda i: [(f"is_prime({i + 2})", _prime(i + 2)), ("is_prime(97)", True)]),
    ("def reverse_words(s):\n    return ' '.join(reversed(s.split()))",
     lambda i: [(f"reverse_words('a{i} b c')", f"c b a{i}")]),
    ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
     lambda i: [(f"gcd({12 * (i + 1)}, {18 * (i + 1)})", 6 * (i + 1))]),
    ("def running_max(xs):\n    out, m = [], None\n    for x in xs:\n        m = x if m is None else max(m, x)\n"
     "        out.append(m)\n    return out",
     lambda i: [(f"running_max([{i}, 1, {i + 5}, 2])", [i, max(i, 1), i + 5, i + 5])]),
    ("def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
     lambda i: [(f"count_vowels('{'a' * (i % 7)}xyz')", i % 7)]),
    ("def sorted_unique(xs):\n    return sorted(set(xs))",
     lambda i: [(f"sorted_unique([{i}, {i}, 3, 1])", sorted({i, 3, 1}))]),
]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def problems(count: int) -> list[tuple[str, bool]]:
    """(program, should it pass) for `count` problems; every eighth asserts the wrong answer."""
    out = []
    for i in range(count):
        source, cases = _TEMPLATES[i % len(_TEMPLATES)]
        wrong = i % 8 == 7
        checks = [f"assert {call} {'!=' if wrong and k == 0 else '=='} {expected!r}"
                  for k, (call, expected) in enumerate(cases(i))]
        out.append((f"{source}\n\n\n" + "\n".join(checks) + "\n", not wrong))
    return out


async def through_endpoint(url: str, program: str) -> bool:
    reply = await sandbox_fusion.run_code_async(RunCodeRequest(code=program, language="python",
                                                               run_timeout=RUN_TIMEOUT_S), endpoint=url,
                                                max_attempts=1)
    return reply.status == RunStatus.Success


async def through_sdk(fleet: sandfleet.Fleet, program: str) -> bool:
    sb = await fleet.create(memory_mb=1024, layers=[LAYER], timeout_s=120)
    try:
        await sb.write_file("/workspace/main.py", program.encode())
        r = await sb.exec(["python3", "main.py"], timeout_s=RUN_TIMEOUT_S)
        return r.exit_code == 0 and not r.timed_out
    finally:
        await sb.destroy()


async def judged_per_s(judge, workload: list[tuple[str, bool]], concurrency: int) -> tuple[float, list[bool]]:
    slots = asyncio.Semaphore(concurrency)

    async def one(program: str) -> bool:
        async with slots:
            return await judge(program)

    started = time.perf_counter()
    verdicts = await asyncio.gather(*(one(p) for p, _ in workload))
    return len(workload) / (time.perf_counter() - started), list(verdicts)


async def run(url: str, endpoint: str, args: argparse.Namespace) -> dict:
    workload = problems(args.problems)
    expected = [ok for _, ok in workload]
    rates: dict[str, list[float]] = {"endpoint": [], "sdk": []}
    async with sandfleet.connect(url, name="bench") as fleet:
        started = time.perf_counter()
        built = await Layers(fleet.bus).build_debian(LAYER, ["python3"])
        build_s = time.perf_counter() - started
        print(f"layer {LAYER}: {built.layer.size / 2**20:.1f} MiB in {build_s:.1f} s", file=sys.stderr)
        await through_sdk(fleet, workload[0][0])  # the layer's first mount is not part of either rate
        for i in range(args.rounds):
            for way, judge in (("endpoint", lambda p: through_endpoint(endpoint, p)),
                               ("sdk", lambda p: through_sdk(fleet, p))):
                rate, verdicts = await judged_per_s(judge, workload, args.concurrency)
                if verdicts != expected:
                    wrong = [n for n, (a, b) in enumerate(zip(verdicts, expected)) if a != b]
                    raise RuntimeError(f"{way}: {len(wrong)} verdicts differ from the expected, e.g. problem {wrong[0]}")
                rates[way].append(rate)
            print(f"round {i + 1}/{args.rounds}: endpoint {rates['endpoint'][-1]:.1f}/s, sdk {rates['sdk'][-1]:.1f}/s",
                  file=sys.stderr)
    return {"layer": {"name": LAYER, "mib": round(built.layer.size / 2**20, 1), "build_s": round(build_s, 1)},
            "passing": sum(expected), "failing": len(expected) - sum(expected),
            **{way: {"median_per_s": round(statistics.median(v), 2), "rounds": [round(x, 2) for x in v]}
               for way, v in rates.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=164)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/fusion.json"))
    args = ap.parse_args()
    port = free_port()
    env = ENV | {"SANDFLEET_FUSION_PORT": str(port), "SANDFLEET_FUSION_CONCURRENCY": str(args.concurrency)}
    with running_platform(args.node_id, env) as (url, _):
        results = asyncio.run(run(url, f"http://127.0.0.1:{port}", args))
    results["ratio"] = round(results["endpoint"]["median_per_s"] / results["sdk"]["median_per_s"], 3)
    print_table(f"judged problems/s, {args.problems} Python programs with asserts, concurrency {args.concurrency} "
                f"(medians over {args.rounds} rounds)",
                ["through", "problems/s", "rounds"],
                [["the endpoint (sandbox-fusion client)", results["endpoint"]["median_per_s"],
                  results["endpoint"]["rounds"]],
                 ["the SDK directly", results["sdk"]["median_per_s"], results["sdk"]["rounds"]],
                 ["ratio", results["ratio"], ""]])
    params = {"problems": args.problems, "concurrency": args.concurrency, "rounds": args.rounds}
    out = write_json(args.out, "fusion", params | {"out": str(args.out)}, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

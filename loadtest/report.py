"""Shared by every benchmark: percentiles, a printed table, a JSON file of the results, and two
sides measured in alternating rounds."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")  # clock ticks a second, as /proc/<pid>/stat counts CPU


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    if not samples_ms:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(samples_ms)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": round(statistics.median(ordered), 2), "p95": at(0.95), "p99": at(0.99)}


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    cells = [[str(c) for c in columns]] + [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: Path, name: str, params: dict, results: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "params": params,
        "results": results,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


# -- two sides measured in alternating rounds ----------------------------------------------------

RoundResult = tuple[float, dict[str, list[float]]]  # cycles/s, and the round's latencies (ms) by phase


@dataclass
class Rounds:
    """What `alternating_rounds` measured, by side: each round's rate, every latency sample by
    phase, and (where a CPU sampler was given) each round's CPU ms per cycle, by process too."""

    sides: tuple[str, ...]
    rates: dict[str, list[float]] = field(default_factory=dict)
    latencies: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    by_process: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def results(self) -> dict:
        """Per side: the median rate, each round's rate, the latency percentiles and (if measured)
        the median CPU per cycle; and the first side over the second, both as the ratio of the
        medians and as the median of each round's ratio (whose two sides shared the moment's load)."""
        first, second = self.sides[:2]
        found: dict = {}
        for side in self.sides:
            found[side] = {"cycles_per_s": round(statistics.median(self.rates[side]), 1),
                           "rounds_cycles_per_s": [round(x, 1) for x in self.rates[side]]}
            if self.cpu_ms[side]:
                found[side]["cpu_ms_per_cycle"] = round(statistics.median(self.cpu_ms[side]), 2)
                found[side]["rounds_cpu_ms_per_cycle"] = [round(x, 2) for x in self.cpu_ms[side]]
            found[side].update({k: percentiles(v) for k, v in self.latencies[side].items()})
        found[f"ratio_{first}_over_{second}"] = round(found[first]["cycles_per_s"] / found[second]["cycles_per_s"], 3)
        found[f"ratio_{first}_over_{second}_paired_median"] = round(
            statistics.median(a / b for a, b in zip(self.rates[first], self.rates[second])), 3)
        if self.cpu_ms[first] and self.cpu_ms[second]:
            found[f"ratio_cpu_{second}_over_{first}"] = round(
                found[second]["cpu_ms_per_cycle"] / found[first]["cpu_ms_per_cycle"], 3)
        return found


def alternating_rounds(sides: tuple[str, ...], rounds: int, n: int, run_round: Callable[[str, int], RoundResult], *,
                       label: str, cpu_ticks: Callable[[str], dict[str, int]] | None = None,
                       note: str = "") -> Rounds:
    """Each side warmed up (min(20, n) cycles, not counted), then `rounds` rounds of `n` cycles a
    side, the sides back to back in an order that turns round every round, so on a shared
    machine both sides see the same load. `run_round(side, n)` runs one; `cpu_ticks(side)`, if
    given, reads the clock ticks of each of that side's processes, before and after each round.
    One line is printed a round."""
    measured = Rounds(sides, {s: [] for s in sides}, {s: {} for s in sides}, {s: [] for s in sides},
                      {s: [] for s in sides})
    for side in sides:
        run_round(side, min(20, n))
    for r in range(rounds):
        for side in sides if r % 2 == 0 else tuple(reversed(sides)):
            before = cpu_ticks(side) if cpu_ticks else {}
            rate, got = run_round(side, n)
            line = f"round {r + 1}/{rounds} {label} {side:<3} {rate:7.1f} cycles/s"
            if cpu_ticks:
                after = cpu_ticks(side)
                used = {k: (after[k] - before.get(k, 0)) * 1000 / TICK / n for k in after}
                measured.by_process[side].append(used)
                measured.cpu_ms[side].append(sum(used.values()))
                line += f" {sum(used.values()):6.1f} ms CPU/cycle"
            measured.rates[side].append(rate)
            for k, v in got.items():
                measured.latencies[side].setdefault(k, []).extend(v)
            print(line + note, flush=True)
    return measured


def print_rounds(results: dict, sides: tuple[str, ...], label: str, title: str, target: float) -> None:
    """The table of `Rounds.results()` (a row a side: its rate, CPU per cycle where measured, the
    p50 and p99 of each phase) and the line comparing the first side with the second."""
    first, second = sides[:2]
    cpu = all("cpu_ms_per_cycle" in results[side] for side in sides)
    phases = [k for k, v in results[first].items() if isinstance(v, dict) and "p50" in v]
    columns = ["side", "cycles/s", *(["CPU ms/cycle"] if cpu else []),
               *(f"{k} {p}" for k in phases for p in ("p50", "p99"))]
    rows = [[f"{label} {side}", results[side]["cycles_per_s"], *([results[side]["cpu_ms_per_cycle"]] if cpu else []),
             *(results[side][k][p] for k in phases for p in ("p50", "p99"))] for side in sides]
    print_table(title, columns, rows)
    line = (f"ratio {first}/{second}: {results[f'ratio_{first}_over_{second}']} (target >= {target}); median of the "
            f"rounds' ratios: {results[f'ratio_{first}_over_{second}_paired_median']}")
    if cpu:
        line += f"; CPU per cycle {second}/{first}: {results[f'ratio_cpu_{second}_over_{first}']}"
    print(line)

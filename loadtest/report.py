"""Shared by every benchmark: percentiles, a printed table, and a JSON file of the results."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path


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
        "machine": {"cpus": __import__("os").cpu_count(), "kernel": platform.release()},
        "params": params,
        "results": results,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path

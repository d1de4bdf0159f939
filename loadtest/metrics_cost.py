"""What metrics cost: create → exec `true` → destroy cycles on a platform with metrics on (every
service exporting, its own Prometheus scraping them) beside one with SANDFLEET_METRICS=off.

    .venv/bin/python -m loadtest.metrics_cost [--n 200] [--concurrency 8] [--rounds 3] [--scrape-s 5]

Both platforms run at once on this machine (each its own node id, data dir and share of the
egress subnet), so both see the same load; rounds alternate between them and cycles/s is the
median over rounds. CPU per cycle (every process of the platform, sandboxes included, and
the client) is reported beside the rate: on a busy shared machine it holds up far better than
the rate, which other people's work moves by tens of percent. With metrics on, each bus hop is also recorded as a span (not exported:
no collector) for the bus latency histogram, so the `on` side pays for that too. The run ends
by asking the `on` side's Prometheus how many creations it counted, so a run whose metrics
were silently off does not pass for a cheap one.

On a shared 2-core machine other people's work moves both figures by more than the few per cent
metrics cost, so two more are reported: the median of each round's on/off ratio (the two sides
run back to back, so they share the moment's load), and an estimate that no load moves: the
instruments' own cost (a bus hop timed and recorded, measured here in a loop) times how many
records one cycle makes (from the `on` side's Prometheus), against the `off` side's CPU per cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from loadtest.container_rate import platform_ticks
from loadtest.create_rate import platform_round
from loadtest.platform import running_platform
from loadtest.report import alternating_rounds, print_rounds, print_table, write_json
from sandfleet import metrics, prometheus

SIDES = ("on", "off")


def _counted_creations(prometheus_url: str, expected: int, deadline_s: float = 30.0) -> float:
    """Creations the `on` side's Prometheus has, once it has `expected` (or at the deadline)."""
    query = urllib.parse.urlencode({"query": 'sum(sandfleet_create_seconds_count{outcome="ok"})'})
    deadline = time.monotonic() + deadline_s
    counted = 0.0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            with urllib.request.urlopen(f"{prometheus_url}/api/v1/query?{query}", timeout=5) as resp:
                counted = float(json.loads(resp.read())["data"]["result"][0]["value"][1])
        if counted >= expected:
            break
        time.sleep(1)
    return counted


def _records_per_cycle(prometheus_url: str, creations: float) -> float:
    """Histogram observations and counter increments the `on` side made per creation."""
    query = urllib.parse.urlencode({"query": 'sum(sandfleet_bus_request_seconds_count) + '
                                             'sum(sandfleet_create_seconds_count) + sum(sandfleet_launch_seconds_count)'})
    with urllib.request.urlopen(f"{prometheus_url}/api/v1/query?{query}", timeout=5) as resp:
        records = float(json.loads(resp.read())["data"]["result"][0]["value"][1])
    return records / max(1.0, creations)


def _us_per_record(n: int = 20_000) -> float:
    """One bus hop as a service without a collector records it: a BusHopTracer span around
    nothing, its histogram observation included (the most a record costs; a counter is less)."""
    import prometheus_client
    from opentelemetry.trace import SpanKind

    from sandfleet import telemetry

    registry = prometheus_client.CollectorRegistry()
    metrics.BUS_REQUESTS.bind(registry)
    try:
        tracer = metrics.BusHopTracer()
        attributes = {telemetry.SUBJECT: "node.v1.bench.exec"}
        started = time.process_time()
        for _ in range(n):
            with tracer.start_as_current_span("node.v1.bench.exec", kind=SpanKind.SERVER, attributes=attributes):
                pass
        return (time.process_time() - started) / n * 1e6
    finally:
        metrics.BUS_REQUESTS.unbind()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=200, help="cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrape-s", type=float, default=prometheus.DEFAULT_SCRAPE_S,
                    help="the `on` side's Prometheus scrape interval")
    ap.add_argument("--node-id", default="bench-metrics")
    ap.add_argument("--calibrate", action="store_true",
                    help="metrics off on both sides (the `on` side keeps only its Prometheus): what the two "
                         "platforms differ by with nothing to tell them apart")
    ap.add_argument("--out", type=Path, default=Path("results/metrics_cost.json"))
    args = ap.parse_args()

    # Pressure admission off: on a loaded machine it would refuse creates, and this measures the create path.
    common = {"SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0"}
    envs = {
        "on": {**common, metrics.SWITCH_ENV: "off" if args.calibrate else "on", prometheus.ENV: "0", prometheus.SCRAPE_ENV: str(args.scrape_s),
               "SANDFLEET_EGRESS_SUBNET": "10.218.0.0/17"},
        "off": {**common, metrics.SWITCH_ENV: "off", "SANDFLEET_EGRESS_SUBNET": "10.218.128.0/17"},
    }
    with running_platform(f"{args.node_id}-on", envs["on"]) as (url_on, data_on), \
            running_platform(f"{args.node_id}-off", envs["off"]) as (url_off, data_off):
        urls, data = {"on": url_on, "off": url_off}, {"on": data_on, "off": data_off}
        measured = alternating_rounds(
            SIDES, args.rounds, args.n, lambda side, n: asyncio.run(platform_round(urls[side], n, args.concurrency)),
            label="metrics", cpu_ticks=lambda side: platform_ticks(data[side]))
        state = json.loads((data_on / "supervisor.json").read_text())
        expected = args.rounds * args.n + min(20, args.n)  # and the warm-up
        counted = _counted_creations(state["prometheus"], expected, deadline_s=3 * args.scrape_s + 5)
        records = 0.0 if args.calibrate else _records_per_cycle(state["prometheus"], counted)

    results = measured.results()
    for side in SIDES:
        names = sorted({k for r in measured.by_process[side] for k in r})
        results[side]["cpu_ms_per_cycle_by_process"] = {
            k: round(statistics.median(r.get(k, 0.0) for r in measured.by_process[side]), 2) for k in names}
    us = _us_per_record()
    estimate_ms = records * us / 1000
    results["instruments"] = {"records_per_cycle": round(records, 1), "us_per_record": round(us, 2),
                              "cpu_ms_per_cycle": round(estimate_ms, 3),
                              "ratio_estimate": round(results["off"]["cpu_ms_per_cycle"] /
                                                      (results["off"]["cpu_ms_per_cycle"] + estimate_ms), 4)}
    results["creations_counted_by_prometheus"] = counted
    print_rounds(results, SIDES, "metrics", f"create → exec true → destroy, n={args.n} x {args.rounds} rounds, "
                 f"concurrency {args.concurrency} (ms)", target=0.97)
    inst = results["instruments"]
    print(f"instruments: {inst['records_per_cycle']} records per cycle x {inst['us_per_record']} us = "
          f"{inst['cpu_ms_per_cycle']} ms CPU per cycle: ratio {inst['ratio_estimate']}; "
          f"Prometheus counted {counted:.0f} creations on the `on` side")
    on, off = (results[side]["cpu_ms_per_cycle_by_process"] for side in SIDES)
    print_table("CPU ms per cycle by process (median over rounds)", ["process", "metrics on", "metrics off"],
                [[k, on.get(k, 0.0), off.get(k, 0.0)] for k in sorted(set(on) | set(off))])
    out = write_json(args.out, "metrics_cost", vars(args) | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0 if counted >= expected or args.calibrate else 1


if __name__ == "__main__":
    sys.exit(main())

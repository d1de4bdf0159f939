"""The container benchmarks run end to end at a tiny size, write the JSON they promise, and
leave nothing behind: each starts its own platform (on a node id of its own), so this proves
the whole path a full-size run takes, not its speed.

The runs are independent processes on separate platforms, and most of each one's time is
waiting (services starting, heartbeats, `down`), so they run side by side: the module starts
the selected ones together, at most `AT_ONCE` at a time, and each test waits for its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtest.simnode import stop_processes
from tests.conftest import NODE_ID, ROOT
from tests.kernel import require
from tests.leaks import node_left

# One run takes ~12 s of CPU over all its processes and ~40 s (CI) of wall time: four fit on two cores.
AT_ONCE = 4
TIMEOUT_S = 600

# Each benchmark run: its module, node id and arguments.
RUNS = {
    "rate": ("loadtest.container_rate", f"{NODE_ID}-rate", ("--n", "4", "--rounds", "1", "--concurrency", "2")),
    "density": ("loadtest.density", f"{NODE_ID}-dense", ("--max", "8", "--batch", "4")),
    "pause-1": ("loadtest.pause_latency", f"{NODE_ID}-pause", ("--rounds", "1", "--workspace-mb", "4", "--nodes", "1")),
    "pause-2": ("loadtest.pause_latency", f"{NODE_ID}-pmove", ("--rounds", "1", "--workspace-mb", "4", "--nodes", "2")),
    "warm": ("loadtest.warm_pool", f"{NODE_ID}-warm", ("--rounds", "1", "--per-round", "2")),
}


def _run_of(item: pytest.Item) -> str | None:
    """Which run a collected test of this module waits for."""
    name = getattr(item, "originalname", item.name)
    if name == "test_pause_latency_times_every_step_and_restores_the_workspace_intact":
        return f"pause-{item.callspec.params['nodes']}"
    return {"test_container_rate_runs_both_sides_and_writes_its_json": "rate",
            "test_density_steps_up_to_max_and_destroys_everything": "density",
            "test_warm_pool_times_both_sides_at_both_levels": "warm"}.get(name)


@dataclass
class Runs:
    """The benchmark processes of this module: started in order, `AT_ONCE` at a time."""

    work: Path
    queued: list[str]
    running: dict[str, subprocess.Popen] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)

    def _start(self, key: str) -> None:
        module, node_id, args = RUNS[key]
        out = self.work / key
        with open(f"{out}.log", "wb") as log:
            self.running[key] = subprocess.Popen(
                [sys.executable, "-m", module, "--node-id", node_id, "--out", f"{out}.json", *args],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT)

    def pump(self) -> None:
        for key, proc in list(self.running.items()):
            if proc.poll() is not None:
                self.done[key] = proc.returncode
                del self.running[key]
        while self.queued and len(self.running) < AT_ONCE:
            self._start(self.queued.pop(0))

    def result(self, key: str) -> dict:
        if key in self.queued:  # not started yet: go first
            self.queued.remove(key)
            self.queued.insert(0, key)
        deadline, late = time.monotonic() + TIMEOUT_S, ""
        while key not in self.done:
            self.pump()
            if key in self.running and time.monotonic() > deadline:
                late = f" (stopped after {TIMEOUT_S} s)"
                self._interrupt([self.running[key]])
            time.sleep(0.1)
        output = (self.work / f"{key}.log").read_text(errors="replace")
        assert self.done[key] == 0 and not late, f"{RUNS[key][0]} ({key}) failed{late}:\n{output[-6000:]}"
        return json.loads((self.work / f"{key}.json").read_text())

    @staticmethod
    def _interrupt(procs: list[subprocess.Popen]) -> None:
        """Stop as Ctrl-C would, so each brings its platform down; killed if that hangs."""
        stop_processes(procs, signal.SIGINT, timeout_s=180)

    def stop(self) -> None:
        """Whatever is still running (a test failed, or the session was interrupted) is stopped."""
        self.queued.clear()
        self._interrupt(list(self.running.values()))


@pytest.fixture(scope="module")
def kernel():
    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")


@pytest.fixture(scope="module")
def runs(kernel, leak_check, request, tmp_path_factory):
    wanted = [key for key in RUNS if any(_run_of(item) == key for item in request.session.items)]
    runs = Runs(tmp_path_factory.mktemp("loadtests"), wanted)
    runs.pump()
    try:
        yield runs
    finally:
        runs.stop()



def test_container_rate_runs_both_sides_and_writes_its_json(runs):
    node = RUNS["rate"][1]
    doc = runs.result("rate")
    assert doc["benchmark"] == "container_rate" and doc["params"]["n"] == 4
    results = doc["results"]
    for side in ("platform", "plain_crun"):
        assert results[side]["cycles_per_s"] > 0 and len(results[side]["rounds_cycles_per_s"]) == 1
        assert set(results[side]) >= {"create", "exec", "destroy"}
        assert 0 < results[side]["create"]["p50"] <= results[side]["create"]["p99"]
    assert results["ratio_platform_over_plain_crun"] == pytest.approx(
        results["platform"]["cycles_per_s"] / results["plain_crun"]["cycles_per_s"], abs=0.01)
    assert node_left(node, results["data_dir"]) == [] and node_left(f"{node}-plain", results["data_dir"]) == []


def test_warm_pool_times_both_sides_at_both_levels(runs):
    node = RUNS["warm"][1]
    doc = runs.result("warm")
    assert doc["benchmark"] == "warm_pool" and doc["params"]["per_round"] == 2
    results = doc["results"]
    for isolation in ("process", "container"):
        r = results[isolation]
        assert r["n"] == 2 and r["claimed"] == 2  # every warm create took a spare
        assert 0 < r["warm"]["p50"] <= r["warm"]["p99"] and 0 < r["cold"]["p50"] <= r["cold"]["p99"]
    assert node_left(node, results["data_dir"]) == []


def test_density_steps_up_to_max_and_destroys_everything(runs):
    node = RUNS["density"][1]
    results = runs.result("density")["results"]
    assert results["sandboxes_held"] == 8 and results["limited_by"] == "reached --max 8"
    assert [s["sandboxes"] for s in results["steps"]] == [4, 8]
    assert results["platform_pss_mib_total"] > 0 and set(results["platform_pss_mib"]) >= {"nats", "launcher"}
    per = results["per_sandbox_kib"]
    assert per["processes"] >= 2  # the init and its sleep
    assert per["processes_pss_kib"] > 0 and per["cgroup_charged_kib"] > 0
    kernel = results["kernel_per_sandbox"]  # host-wide growth, which others move: its shape only
    assert {"SUnreclaim", "Percpu", "PageTables"} <= set(kernel["meminfo_kib"]) and kernel["slab_kib"]
    assert {"memory", "cpu", "pids"} <= set(kernel["cgroups"])
    assert results["left_after_destroy"] == {} and results["live_after_destroy"] == 0
    assert node_left(node, results["data_dir"]) == []


@pytest.mark.parametrize("nodes", [1, 2], ids=["same-node", "migrated"])
def test_pause_latency_times_every_step_and_restores_the_workspace_intact(runs, nodes):
    """With two nodes (`up --nodes 2`) the checkpoint taken on one is restored on the other: the
    benchmark itself fails unless the restored workspace has the original's sha256."""
    node = RUNS[f"pause-{nodes}"][1]
    doc = runs.result(f"pause-{nodes}")
    assert doc["benchmark"] == "pause_latency" and doc["params"]["workspace_mb"] == 4
    results = doc["results"]
    for op in ("pause", "resume", "checkpoint", "restore", "read_restored"):
        assert results[op]["n"] == 1 and 0 < results[op]["p50"] <= results[op]["p99"] <= results[op]["max"]
    (move,) = results["moves"]
    if nodes == 1:
        assert move["from"] == move["to"] == node and results["restore_on"] == "the same node"
    else:
        assert results["nodes"] == [f"{node}-1", f"{node}-2"] and results["restore_on"] == "another node"
        assert move["from"] != move["to"] and {move["from"], move["to"]} == set(results["nodes"])
    for n in results["nodes"]:
        assert node_left(n, results["data_dir"]) == []

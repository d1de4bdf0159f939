"""The container benchmarks run end to end at a tiny size, write the JSON they promise, and
leave nothing behind: each starts its own platform (on a node id of its own), so this proves
the whole path a full-size run takes, not its speed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import NODE_ID, ROOT
from tests.kernel import require


def _run(module: str, node_id: str, out, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", module, "--node-id", node_id, "--out", str(out), *args],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def _left(node_id: str, data_dir: str) -> list[str]:
    """What of this benchmark's node is still on the machine (other sessions share it, so only
    the node's own names count): mounts under its data dir, its cgroups (a process of a sandbox
    keeps its cgroup), its network namespaces."""
    with open("/proc/self/mountinfo") as f:
        left = [line.split()[4] for line in f if line.split()[4].startswith(data_dir)]
    left += [f"cgroup {h}/{node_id}" for h in os.listdir("/sys/fs/cgroup")
             if os.path.exists(f"/sys/fs/cgroup/{h}/sandfleet/{node_id}")]
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return left + [n for n in netns if n.startswith(f"sf-{node_id}.")]


@pytest.fixture
def kernel():
    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")


def test_container_rate_runs_both_sides_and_writes_its_json(kernel, leak_check, tmp_path):
    node = f"{NODE_ID}-rate"
    doc = _run("loadtest.container_rate", node, tmp_path / "rate.json", "--n", "4", "--rounds", "1",
               "--concurrency", "2")
    assert doc["benchmark"] == "container_rate" and doc["params"]["n"] == 4
    results = doc["results"]
    for side in ("platform", "plain_crun"):
        assert results[side]["cycles_per_s"] > 0 and len(results[side]["rounds_cycles_per_s"]) == 1
        assert set(results[side]) >= {"create", "exec", "destroy"}
        assert 0 < results[side]["create"]["p50"] <= results[side]["create"]["p99"]
    assert results["ratio_platform_over_plain_crun"] == pytest.approx(
        results["platform"]["cycles_per_s"] / results["plain_crun"]["cycles_per_s"], abs=0.01)
    assert _left(node, results["data_dir"]) == [] and _left(f"{node}-plain", results["data_dir"]) == []


def test_density_steps_up_to_max_and_destroys_everything(kernel, leak_check, tmp_path):
    node = f"{NODE_ID}-dense"
    doc = _run("loadtest.density", node, tmp_path / "density.json", "--max", "8", "--batch", "4")
    results = doc["results"]
    assert results["sandboxes_held"] == 8 and results["limited_by"] == "reached --max 8"
    assert [s["sandboxes"] for s in results["steps"]] == [4, 8]
    assert results["platform_pss_mib_total"] > 0 and set(results["platform_pss_mib"]) >= {"nats", "launcher"}
    per = results["per_sandbox_kib"]
    assert per["processes"] >= 2  # the init and its sleep
    assert per["processes_pss_kib"] > 0 and per["cgroup_charged_kib"] > 0
    assert results["left_after_destroy"] == {} and results["live_after_destroy"] == 0
    assert _left(node, results["data_dir"]) == []


@pytest.mark.parametrize("nodes", [1, 2], ids=["same-node", "migrated"])
def test_pause_latency_times_every_step_and_restores_the_workspace_intact(kernel, leak_check, tmp_path, nodes):
    """With two nodes (`up --nodes 2`) the checkpoint taken on one is restored on the other: the
    benchmark itself fails unless the restored workspace has the original's sha256."""
    node = f"{NODE_ID}-pause"
    doc = _run("loadtest.pause_latency", node, tmp_path / "pause.json", "--rounds", "1", "--workspace-mb", "4",
               "--nodes", str(nodes))
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
        assert _left(n, results["data_dir"]) == []

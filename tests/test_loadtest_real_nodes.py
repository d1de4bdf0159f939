"""The real-nodes benchmark runs end to end at a tiny size (`--nodes 2 --n 20`, beside one node):
every sandbox of the batch starts, the batch spreads over both nodes, it writes the JSON it
promises, and after destroy and `down` nothing of its nodes is left on the machine. This
proves the whole path a full-size run takes, not its speed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import NODE_ID, ROOT
from tests.kernel import require
from tests.leaks import node_left



@pytest.fixture
def kernel():
    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")


def test_real_nodes_batch_starts_every_sandbox_on_both_nodes_and_leaves_nothing(kernel, leak_check, tmp_path):
    node = f"{NODE_ID}-rn"
    out = tmp_path / "real_nodes.json"
    done = subprocess.run([sys.executable, "-m", "loadtest.real_nodes", "--node-id", node, "--out", str(out),
                           "--nodes", "2", "--n", "20"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"real_nodes failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "real_nodes" and doc["params"]["n"] == 20 and doc["params"]["nodes"] == 2
    results = doc["results"]
    two, one = results["runs"]
    assert two["node_ids"] == [f"{node}-1", f"{node}-2"] and one["node_ids"] == [f"{node}-base"]
    for run in (two, one):
        assert (run["requested"], run["started"], run["failed"], run["no_outcome"]) == (20, 20, 0, 0)
        assert run["failure_reasons"] == {} and run["batch_error"] == ""
        assert sorted(run["spread"]) == run["node_ids"] and sum(run["spread"].values()) == 20
        assert run["placed_spread"] == run["spread"]
        assert run["layer_on_every_node"] and run["warmed_nodes"] == run["node_ids"]
        assert 0 < run["placement_answered_s"] <= run["all_running_s"] <= run["sdk_returned_s"]
        lat = run["request_to_started_ms"]
        assert 0 < lat["p50"] <= lat["p99"] <= run["all_running_s"] * 1000 + 1
        assert run["cpu_s"]["launcher"]["own_s"] + run["cpu_s"]["launcher"]["children_s"] > 0
        assert run["destroyed"] == 20 and run["destroy_errors"] == [] and run["teardown_s"] > 0
        assert run["left_after_destroy"] == {} and run["left_after_down"] == {} and run["live_after_destroy"] == 0
        for n in run["node_ids"]:
            assert node_left(n, run["data_dir"]) == []
    assert all(k > 0 for k in two["spread"].values())  # both nodes took a share of the one batch
    assert results["ratio_nodes_over_baseline"]["comparable"] is True
    assert results["ratio_nodes_over_baseline"]["all_running_s"] == pytest.approx(
        two["all_running_s"] / one["all_running_s"], abs=0.01)

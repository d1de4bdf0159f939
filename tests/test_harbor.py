"""Harbor drives sandfleet: the `harbor` CLI from PyPI (pinned in the `harbor` extra), in the
Python 3.13 tree Harbor needs (tests/trixie_python.py: this node's Debian 12 has 3.11), runs a
job of three tasks it reads from a directory this test writes, with `--env
sandfleet.integrations.harbor:SandfleetEnvironment` against the session's platform and Harbor's
`oracle` agent (it runs the task's solution; no model). One task's Dockerfile FROMs a layer of
ours, the other's an image reference the job maps to that layer (`--ek images=...`); each adds a
WORKDIR, a COPY and a RUN, built by sandfleet's Dockerfile builder; its verifier checks what the solution made and writes the
reward. The right solution must earn 1 and the wrong one 0, read from Harbor's own result files,
so a broken exec, upload (the solution and tests directories) or download (the verifier's
directory, the oracle's log) fails the test. A third task FROMs a registry image nobody imported:
its trial fails as Harbor's non-retryable build error, saying what to import. Afterwards no
sandbox, mount or process of the run is left.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import nats.errors
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas import events
from schemas.events import AnySandboxEvent
from tests.kernel import require
from tests.layer_trees import busybox_layer
from tests.leaks import Snapshot
from tests.trixie_python import JOB, TreeBuildError, tree

BASE = "harbor-busybox"
# What Harbor's own commands (mkdir, chmod, rm, cp of a merged upload) and the task's scripts use
APPLETS = ("sh", "cat", "cp", "mv", "mkdir", "chmod", "rm", "ls", "echo", "printf", "test", "[", "true", "false",
           "find", "tar", "gzip", "env", "expr", "touch", "dirname", "basename", "head", "tail", "id", "pwd",
           "grep", "sed", "sleep", "tee")
ENVIRONMENT = "sandfleet.integrations.harbor:SandfleetEnvironment"

TASK_TOML = """schema_version = "1.4"

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 300.0
memory_mb = 256
network_mode = "no-network"

[environment.env]
TASK_GREETING = "hello from task.toml"
"""
IMAGE = "busybox:1.36"  # an image reference the job maps to our layer (--ek images=...)
UNKNOWN = "registry.example/none:1"  # an image nobody imported: sandfleet pulls from no registry
DOCKERFILE = """FROM {base}
WORKDIR /app
COPY numbers.txt /app/numbers.txt
RUN echo "built by RUN" > /app/built.txt
"""
SOLVE = """#!/bin/sh
set -e
read a b < numbers.txt
echo $(( a {op} b )) > /app/answer.txt
mkdir -p /app/work/deep
cat built.txt > /app/work/deep/seen.txt
echo "solved in $(pwd) with {op}: $TASK_GREETING"
"""
TEST = """#!/bin/sh
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt)" = 42 ] && [ "$(cat /app/work/deep/seen.txt)" = "built by RUN" ] \\
   && [ "$(cat /tests/expected/note.txt)" = "the tests dir came whole" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
echo "answer: $(cat /app/answer.txt)" > /logs/verifier/detail.txt
"""


def write_task(root: Path, op: str, base: str) -> Path:
    (root / "environment").mkdir(parents=True)
    (root / "solution").mkdir()
    (root / "tests" / "expected").mkdir(parents=True)
    (root / "task.toml").write_text(TASK_TOML)
    (root / "instruction.md").write_text("Multiply the two numbers in /app/numbers.txt; write the product to "
                                         "/app/answer.txt.\n")
    (root / "environment" / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    (root / "environment" / "numbers.txt").write_text("6 7\n")
    (root / "solution" / "solve.sh").write_text(SOLVE.format(op=op))
    (root / "tests" / "test.sh").write_text(TEST)
    (root / "tests" / "expected" / "note.txt").write_text("the tests dir came whole\n")
    for script in (root / "solution" / "solve.sh", root / "tests" / "test.sh"):
        script.chmod(0o755)
    return root


@pytest.fixture(scope="module")
def client_tree():
    require(os.geteuid() == 0, "debootstrap and chroot need root")
    for tool in ("debootstrap", "chroot", "unshare"):
        require(shutil.which(tool) is not None, f"{tool} is installed")
    started = time.monotonic()
    try:
        found = tree(log=lambda line: print(line, file=sys.stderr))
    except TreeBuildError as exc:
        pytest.fail(f"the Python 3.13 tree for Harbor did not build:\n{exc}", pytrace=False)
    print(f"trixie tree ready in {time.monotonic() - started:.1f} s: {found.root}", file=sys.stderr)
    return found


async def sandboxes_since(fleet, since: float) -> set[str]:
    """The sandboxes with a lifecycle event stored since `since` (a time.time())."""
    start = datetime.fromtimestamp(since, timezone.utc).isoformat().replace("+00:00", "Z")
    sub = await fleet.bus.js.subscribe(events.ALL_SANDBOX, ordered_consumer=True, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start))
    found = set()
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=5)
            except nats.errors.TimeoutError:
                break
            found.add(msgspec.json.decode(msg.data, type=AnySandboxEvent).sandbox_id)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return found


def _ours(left: dict[str, list[str]], marks: list[str]) -> dict[str, list[str]]:
    found = {kind: [r for r in items if any(m in r for m in marks)] for kind, items in left.items()}
    return {k: v for k, v in found.items() if v}


@pytest.mark.timeout(900)
async def test_harbor_runs_tasks_on_sandfleet_and_its_verifier_grades_them(platform, fleet, client_tree,
                                                                              tmp_path, tmp_path_factory):
    await busybox_layer(fleet, tmp_path_factory, BASE, hostname="harbor", applets=APPLETS)
    job = tmp_path / "job"
    write_task(job / "tasks" / "multiply", "*", BASE)  # FROM a layer of ours
    write_task(job / "tasks" / "add-instead", "+", IMAGE)  # 13, a wrong answer; FROM an image we map
    write_task(job / "tasks" / "from-a-registry", "*", UNKNOWN)  # no layer stands for it: not built
    known = {s.id for s in await fleet.list()}
    before = Snapshot.take()
    started = time.time()

    out = client_tree.client(
        ["harbor", "run", "-p", f"{JOB}/tasks", "--agent", "oracle", "--env", ENVIRONMENT, "--ek", f"url={platform.url}",
         "--ek", f"images={json.dumps({IMAGE: BASE})}", "-o", f"{JOB}/jobs", "--job-name", "run", "-n", "3", "--yes"],
        workdir=job, url=platform.url)  # the bus credentials: the ones this host's SDK finds for the url
    trials = {}
    for result in (job / "jobs" / "run").glob("*/result.json"):
        r = json.loads(result.read_text())
        trials[r["task_name"]] = (result.parent, r)
    assert set(trials) == {"multiply", "add-instead", "from-a-registry"}, \
        f"harbor exited {out.returncode}:\n{out.stderr[-6000:]}\n{out.stdout[-3000:]}"
    refused = trials.pop("from-a-registry")[1]
    assert refused["exception_info"]["exception_type"] == "SandboxBuildFailedError", refused["exception_info"]
    assert "sandfleet layer import" in refused["exception_info"]["exception_message"]
    for name, (trial_dir, r) in trials.items():
        assert r["exception_info"] is None, f"{name}: {r['exception_info']}"
        oracle_log = (trial_dir / "agent" / "oracle.txt").read_text()  # a file download
        assert oracle_log.startswith("solved in /app with") and oracle_log.endswith(": hello from task.toml\n")
        assert (trial_dir / "verifier" / "detail.txt").exists()  # a directory download
    assert trials["multiply"][1]["verifier_result"]["rewards"] == {"reward": 1.0}
    assert trials["add-instead"][1]["verifier_result"]["rewards"] == {"reward": 0.0}
    assert (trials["add-instead"][0] / "verifier" / "detail.txt").read_text() == "answer: 13\n"
    assert out.returncode == 0, out.stderr[-6000:]

    # The run's sandboxes (the trials', the Dockerfile's build sandbox) are gone, and so is all
    # they took on the machine (mounts, cgroups, netns, processes), and the client's binds (in
    # a mount namespace of its own). Layers stay mounted once per node, by design.
    assert {s.id for s in await fleet.list()} == known
    ran = await sandboxes_since(fleet, started)
    assert len(ran) >= 2, ran  # the two trials' (and the build's, the first time)
    marks = [*ran, str(client_tree.root)]
    deadline = time.monotonic() + 15
    while (left := _ours(Snapshot.take().added_since(before), marks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the harbor run left resources behind: {left}"
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if str(client_tree.root) in line]


def test_on_python_3_11_the_import_says_what_it_needs():
    if sys.version_info >= (3, 12):
        pytest.skip("this interpreter is new enough for Harbor")  # the 3.11 host is what CI runs
    with pytest.raises(ImportError, match="needs Python >= 3.12"):
        importlib.import_module("sandfleet.integrations.harbor")

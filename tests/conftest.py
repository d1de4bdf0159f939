"""Shared fixtures: one real platform (`sandfleet up --detach`) for the session, and a leak check.

The platform runs the real nats-server and every service as its own process on this
machine's kernel; its spans go to an OTLP receiver in this process. After the session, the
machine must hold no mount, cgroup, network namespace or process the tests made.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import sandfleet
from linuxnode import netns, roots_ns
from sandfleet.config import DEFAULT_EGRESS_SUBNET, free_port
from tests.leaks import Snapshot
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "sandfleet.cli"]
# Several sessions may share a machine (parallel development); each gets its own node id so
# they never reclaim each other's sandboxes.
NODE_ID = os.environ.get("SANDFLEET_TEST_NODE_ID", "testnode")


def _worker_identity() -> None:
    """Under pytest-xdist each worker is a session of its own beside the others (`make test` runs
    two): it gets a node id of its own (`<id>w<n>`) and a slice of the egress subnet, so platforms,
    leak checks and addresses never cross, as two engineers' sessions on one machine do not.
    Idempotent: this module is imported twice (as pytest's `conftest` and as `tests.conftest`), and
    the worker's platforms and the tests it imports must agree."""
    global NODE_ID
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return
    n = int(worker[2:])
    NODE_ID = f"{NODE_ID}w{n}"
    whole = os.environ.setdefault("SANDFLEET_TEST_WHOLE_SUBNET",
                                  os.environ.get("SANDFLEET_EGRESS_SUBNET") or DEFAULT_EGRESS_SUBNET)
    slices = list(ipaddress.IPv4Network(whole).subnets(prefixlen_diff=max(1, (count - 1).bit_length())))
    os.environ["SANDFLEET_EGRESS_SUBNET"] = str(slices[n])  # what every platform the worker starts takes


_worker_identity()
# How long a test waits for an event to reach the bus: a deadline a loaded CI machine meets, not
# a latency figure (loadtest/violation_latency measures how soon violations arrive).
EVENT_DEADLINE_S = 30.0


_ROOTS_VIEWS: dict[str, roots_ns.RootsView] = {}


@dataclass(frozen=True)
class Platform:
    url: str
    data_dir: Path
    node_id: str
    env: dict

    def state(self) -> dict:
        return json.loads((self.data_dir / "supervisor.json").read_text())

    def roots_path(self, path: str | Path) -> Path:
        """A path of the node's roots namespace (where its layer-cache mounts layers and roots:
        linuxnode.roots_ns) as this process reaches it."""
        view = _ROOTS_VIEWS.get(self.node_id)
        if view is None:
            view = _ROOTS_VIEWS[self.node_id] = roots_ns.RootsView(self.node_id)
        return Path(view.path(str(path)))

    def service_pid(self, name: str) -> int:
        return self.state()["services"][name]

    async def restarted(self, fleet, service: str, old_pid: int, timeout: float = 30.0) -> int:
        """Wait until the supervisor has restarted `service` and the new process answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.service_pid(service)
            if pid and pid != old_pid and await fleet.ping(service):
                return pid
            await asyncio.sleep(0.1)
        raise AssertionError(f"{service} was not restarted within {timeout}s")

    def mechanisms(self, status: str | None = None) -> dict[str, str]:
        """What `sandfleet status` (or its output `status`) says of each security mechanism on
        this platform's node."""
        found: dict[str, str] = {}
        mine = False
        for line in (status if status is not None else self.cli("status").stdout.decode()).splitlines():
            if not line.startswith(" "):
                mine = line.split()[:2] == ["node", self.node_id]
            elif mine:
                name, state = line.split(None, 1)
                found[name] = state
        assert found, f"sandfleet status shows no node {self.node_id}"
        return found

    def cli(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*CLI, *args], env={**self.env, "SANDFLEET_NATS_URL": self.url}, capture_output=True,
            timeout=timeout, cwd=ROOT,
        )
        # With what it said: a CalledProcessError would show the exit status alone.
        assert not check or done.returncode == 0, f"sandfleet {' '.join(args)} exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}"
        return done


def platform_env(otlp: OtlpReceiver | None, node_id: str) -> dict:
    env = {**os.environ, "SANDFLEET_NODE_ID": node_id, "PYTHONPATH": str(ROOT)}
    if otlp is not None:
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    return env


def start_platform(data_dir: Path, node_id: str, otlp: OtlpReceiver | None = None, extra: tuple[str, ...] = (),
                   env: dict[str, str] | None = None) -> Platform:
    env = platform_env(otlp, node_id) | (env or {})
    port = free_port()
    out = subprocess.run(
        [*CLI, "up", "--detach", "--port", str(port), "--data-dir", str(data_dir), "--node-id", node_id, *extra],
        env=env, capture_output=True, text=True, timeout=90, cwd=ROOT,
    )
    if out.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((data_dir / "logs").glob("*.log")))
        raise RuntimeError(f"sandfleet up failed: {out.stderr}\n{logs}")
    return Platform(url=out.stdout.strip(), data_dir=data_dir, node_id=node_id, env=env)


@contextlib.contextmanager
def own_platform(data_dir: Path, node_id: str, **start) -> Iterator[Platform]:
    """A platform of the caller's own around the block, brought down after it and proven to leave
    nothing of its node behind."""
    before = Snapshot.take()
    p = start_platform(data_dir, node_id, **start)
    try:
        yield p
    finally:
        stop_platform(p)
    assert_nothing_left(before, data_dir, [node_id])


def stop_platform(p: Platform) -> None:
    """`down`; a platform a test already brought down (its state file gone) is only checked."""
    if not (p.data_dir / "supervisor.json").exists():
        return
    supervisor = p.state()["pid"]
    subprocess.run([*CLI, "down", "--data-dir", str(p.data_dir)], env=p.env, timeout=150, check=True, cwd=ROOT)
    # `up --detach` leaves the supervisor an orphan; as subreaper we are its parent now, and
    # this VM's PID 1 would not reap it.
    try:
        os.waitpid(supervisor, 0)
    except ChildProcessError:
        pass


def _processes_of(data_dir: Path) -> list[str]:
    """Processes started for this platform (the supervisor hands its data dir to every one)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if str(data_dir).encode() in environ or str(data_dir).encode() in argv:
            found.append(f"{pid}:{argv[:80].decode(errors='replace')}")
    return found


def _marks(dirs: list[str], node_ids: list[str], prefix: bool = False) -> list[str]:
    """What names a resource as made under one of `dirs` or for one of `node_ids` (or, with
    `prefix`, a node whose id starts with one: a platform's nodes are named after it): paths,
    cgroups (`sandfleet/<node>`: a bare `/<node>` prefix would take any path with a directory
    of that name, e.g. every layer-cache's `mnt/` for node `mnt`), the roots namespace's pin
    (and so what it holds), the netns holder's pin, namespaces, links, nft tables, the DNS stub's addresses, a
    process's cgroup, argv, node id or data dir (tests/leaks.py `_owner`)."""
    end = "" if prefix else "."
    sep = "" if prefix else ":"
    return [*dirs, *(f"sandfleet/{n}" for n in node_ids), *(f"{roots_ns.RUN_DIR}/{n}" for n in node_ids),
            *(f"{netns.HOLDER_DIR}/{n}" for n in node_ids),
            *(f"sf-{n}{end}" for n in node_ids),
            *(f"sandfleet-{n}" for n in node_ids), *(f"sandfleet:{n}{sep}" for n in node_ids),
            *(f"sandfleet-dns:{n}" for n in node_ids), *(f"node={n}{'' if prefix else ' '}" for n in node_ids)]


def _marked(before: Snapshot, marks: list[str]) -> dict[str, list[str]]:
    """What was added since `before` and carries one of `marks`: others may be working on this
    machine at the same time, and only what is ours counts."""
    left = {kind: [r for r in found if any(m in r for m in marks)]
            for kind, found in Snapshot.take().added_since(before).items()}
    return {k: v for k, v in left.items() if v}


def left_behind(before: Snapshot, data_dir: Path, node_ids: list[str]) -> dict[str, list[str]]:
    """What this platform left: kernel resources naming one of its nodes or its data dir, and
    its processes."""
    left = _marked(before, _marks([str(data_dir)], node_ids))
    if processes := left.pop("processes", []) + _processes_of(data_dir):
        left["processes"] = processes
    return left


def assert_nothing_left(before: Snapshot, data_dir: Path, node_ids: list[str]) -> None:
    """Nothing of the platform in `data_dir` (nodes `node_ids`) is left, waiting up to 15 s; only
    its own resources count, so other sessions' work on this machine does not fail it."""
    deadline = time.monotonic() + 15
    while (left := left_behind(before, data_dir, node_ids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the platform left resources behind: {left}"


def _reap_adopted_orphans() -> None:
    """Reap exited processes that were re-parented to us, as an init would. Services' helpers
    that outlive their parent on purpose (the lazy-layer FUSE daemon, a detached supervisor)
    end up here after `down`; a zombie with any other parent still counts as a leak."""
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state == "Z" and ppid == me:
            try:
                os.waitpid(int(pid), os.WNOHANG)
            except ChildProcessError:
                pass


def _become_subreaper() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


_become_subreaper()


# The node ids this session's tests give what they make: every platform's starts with NODE_ID
# (NODE_ID, NODE_ID + "m-1", ...); the kernel tests' carry this process's pid
# (tests/test_kernel_runtime.py NODE, tests/security/netlab.py NODE).
SESSION_NODES = [NODE_ID, f"krt{os.getpid()}", f"sectest{os.getpid()}"]


@pytest.fixture(scope="session")
def leak_check(tmp_path_factory):
    before = Snapshot.take()
    yield before
    # Every data dir of the session is under its base temp dir (with the slash: pytest-5 is not pytest-50).
    marks = [*_marks([f"{tmp_path_factory.getbasetemp()}/"], SESSION_NODES, prefix=True),
             f"parent={os.getpid()}:"]  # a zombie child of this process
    deadline = time.monotonic() + 15
    while True:
        _reap_adopted_orphans()
        left = _marked(before, marks)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"the test session left resources behind: {left}"


@pytest.fixture(scope="session")
def otlp():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def platform(leak_check, otlp, tmp_path_factory):
    p = start_platform(tmp_path_factory.mktemp("platform"), NODE_ID, otlp)
    yield p
    stop_platform(p)
    assert_nothing_left(leak_check, p.data_dir, [NODE_ID])  # not one of its services or sandboxes remains


@pytest.fixture(scope="session")
async def fleet(platform):
    async with sandfleet.connect(platform.url) as f:
        yield f


# Modules whose fixtures take minutes (Debian roots built by debootstrap, VM guests under TCG; the
# `--durations` table of a run), collected first: xdist hands out whole files as workers free up,
# so a long file left for last would keep one worker busy while the other idles.
SLOW_FILES = ("test_fusion.py", "test_desktop.py", "test_vm_level.py", "test_dockerfile_build.py",
              "test_vm_checkpoint.py", "test_layers.py", "test_loadtests.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order

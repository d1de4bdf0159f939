"""The platform a benchmark runs against: `sandfleet up --detach` in a temporary data dir, `down` after."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from linuxnode import netns, procfs, roots_ns
from sandfleet.config import free_port

CLI = [sys.executable, "-m", "sandfleet.cli"]


@contextlib.contextmanager
def running_platform(node_id: str, env: dict[str, str] | None = None, nodes: int = 1) -> Iterator[tuple[str, Path]]:
    """Yields (url, data dir). On a failure the services' log tails are printed before the data
    dir goes, so a benchmark that broke says why."""
    # `up --detach` orphans the supervisor: as a subreaper we adopt it and reap it after `down`.
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    with tempfile.TemporaryDirectory(prefix="sandfleet-bench-") as tmp:
        full_env = {**os.environ, "SANDFLEET_LOG_LEVEL": "WARNING", **(env or {})}
        up = subprocess.run([*CLI, "up", "--detach", "--port", str(free_port()), "--data-dir", tmp,
                             "--node-id", node_id, "--nodes", str(nodes)], capture_output=True, text=True, env=full_env)
        if up.returncode != 0:  # what did start (a supervisor that never became healthy) must not outlive us
            subprocess.run([*CLI, "down", "--data-dir", tmp], capture_output=True, env=full_env)
            raise RuntimeError(f"sandfleet up failed: {up.stderr}")
        supervisor = json.loads((Path(tmp) / "supervisor.json").read_text())["pid"]
        try:
            yield up.stdout.strip(), Path(tmp)
        except BaseException:
            for log in sorted(Path(tmp).rglob("logs/*.log")):
                print(f"--- {log}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            raise
        finally:
            subprocess.run([*CLI, "down", "--data-dir", tmp], capture_output=True, env=full_env)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(supervisor, 0)


# -- what a benchmark's nodes leave behind ---------------------------------------------------------

def sandbox_processes(nodes: list[str]) -> list[str]:
    """Processes in a sandbox cgroup of these nodes (`.../sandfleet/<node>/<sandbox>`)."""
    marks = tuple(f"/sandfleet/{n}/" for n in nodes)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                held = next((line.split(":", 2)[2].strip() for line in f if any(m in line for m in marks)), "")
            if held:
                stat = procfs.read_stat(int(pid))
                if stat is not None:
                    found.append(f"{pid}:{stat.comm}:{stat.state}:{held}")
        except OSError:
            continue
    return found


def leftovers(nodes: list[str], data_dir: Path, whole_node: bool = False) -> dict[str, list[str]]:
    """What of the nodes' sandboxes the machine still holds (`whole_node`: of the nodes at all,
    after `down`: every mount under the data dir and the nodes' own cgroup roots)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for n in nodes:  # and where the node composes roots (linuxnode.roots_ns), while it is pinned
        points += [line.split()[4] for line in (roots_ns.read_mountinfo(n) or "").splitlines()]
    mounts = [p for p in points if p.startswith(str(data_dir)) and (whole_node or "/sandboxes/" in p)]
    if whole_node:
        mounts += [f"roots namespace pinned: {roots_ns.pin_path(n)}" for n in nodes if n in roots_ns.pinned_nodes()]
        mounts += [f"netns holder pinned: {netns.holder_pin(n)}" for n in nodes if n in netns.holders()]
    cgroups = []
    for hierarchy in os.listdir("/sys/fs/cgroup"):
        for n in nodes:
            node_dir = f"/sys/fs/cgroup/{hierarchy}/sandfleet/{n}"
            if whole_node and os.path.isdir(node_dir):
                cgroups.append(node_dir)
            elif os.path.isdir(node_dir):
                # ".<sandbox>.<time>": a memory cgroup the node set aside until its dirty pages are
                # written back (linuxnode.memcg_release); the node removes it by itself.
                cgroups += [f"{node_dir}/{d}" for d in os.listdir(node_dir)
                            if os.path.isdir(f"{node_dir}/{d}") and not d.startswith(".")]
    names = [f"sf-{n}.{sandbox}" for n in nodes for sandbox in netns.list_sandboxes(n)]  # in its holder or the host's
    left = {"mounts": mounts, "cgroups": cgroups, "netns": names,
            "processes": sandbox_processes(nodes)}
    return {k: v for k, v in left.items() if v}

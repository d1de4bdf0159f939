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

from sandfleet.supervisor import free_port

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
        if up.returncode != 0:
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

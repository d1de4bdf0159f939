"""Process configuration from the environment, read once by each composition root."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_PORT = 4222


def default_data_dir() -> Path:
    return Path(os.environ.get("SANDFLEET_DATA_DIR") or Path.home() / ".local/share/sandfleet")


def nats_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("SANDFLEET_NATS_URL") or DEFAULT_URL


def default_node_id() -> str:
    name = socket.gethostname().split(".")[0]
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name) or "node"


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str
    node_id: str
    data_dir: Path
    capacity: int

    @classmethod
    def from_env(cls) -> ServiceConfig:
        return cls(
            nats_url=nats_url(),
            node_id=os.environ.get("SANDFLEET_NODE_ID") or default_node_id(),
            data_dir=default_data_dir(),
            capacity=int(os.environ.get("SANDFLEET_CAPACITY", "2000")),
        )

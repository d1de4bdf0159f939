"""Process configuration from the environment, read once by each composition root."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_PORT = 4222
# The node agent's default egress subnet (SANDFLEET_EGRESS_SUBNET); `up --nodes N` splits it.
DEFAULT_EGRESS_SUBNET = "10.200.0.0/16"


def default_data_dir() -> Path:
    return Path(os.environ.get("SANDFLEET_DATA_DIR") or Path.home() / ".local/share/sandfleet")


def node_id(explicit: str | None = None) -> str:
    """The node a process works for: --node-id, else SANDFLEET_NODE_ID, else the host name."""
    return explicit or os.environ.get("SANDFLEET_NODE_ID") or default_node_id()


def nats_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("SANDFLEET_NATS_URL") or DEFAULT_URL


def nats_servers(url: str) -> list[str]:
    """A NATS URL, or several comma-separated (the servers of one cluster), as a list."""
    return [u.strip() for u in url.split(",") if u.strip()]


def auth_enabled() -> bool:
    """SANDFLEET_AUTH=off (`sandfleet up --no-auth`): a bus anyone who reaches it may use, as for
    a benchmark of what authentication costs. On by default."""
    return (os.environ.get("SANDFLEET_AUTH") or "on").lower() not in ("off", "0", "no", "false")


def tls_enabled() -> bool:
    """SANDFLEET_TLS=on (`sandfleet up --tls`): the platform's servers speak TLS only, to clients
    and between themselves (sandfleet.tls). Off by default (a loopback bus)."""
    return (os.environ.get("SANDFLEET_TLS") or "off").lower() in ("on", "1", "yes", "true")


def local_credentials_dir() -> Path:
    """Where a platform notes, for clients on its machine, which credentials its bus takes
    (SANDFLEET_LOCAL_CREDS_DIR; default /run/sandfleet/bus for root, else under ~/.local/state)."""
    explicit = os.environ.get("SANDFLEET_LOCAL_CREDS_DIR")
    if explicit:
        return Path(explicit)
    return Path("/run/sandfleet/bus") if os.geteuid() == 0 else Path.home() / ".local/state/sandfleet/bus"


def js_replicas() -> int:
    """SANDFLEET_JS_REPLICAS: how many servers keep each stream, bucket and object store the
    platform creates (3 on a clustered bus, so it survives losing a server; 1 on one server)."""
    return int(os.environ.get("SANDFLEET_JS_REPLICAS") or 1)


def default_node_id() -> str:
    name = socket.gethostname().split(".")[0]
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name) or "node"


@dataclass(frozen=True)
class ServiceConfig:
    nats_url: str
    node_id: str
    data_dir: Path
    capacity: int
    layer_fetch: str = "lazy"  # SANDFLEET_LAYER_FETCH: "lazy" (chunks when read) or "full" (whole images first)
    # SANDFLEET_DEFAULT_LAYERS ("a,b", bottom first): the root of a sandbox that names no layers
    # and does not ask for the host view
    default_layers: tuple[str, ...] = ()
    # SANDFLEET_USERNS: the host ids sandbox roots map to ("" or "on": the default range, a base
    # number, "off": none), read here once so a node's launcher and layer-cache cannot disagree
    # (the layer-cache idmaps the layer mounts for the range the launcher's sandboxes run in).
    # Parsed by the node side (linuxnode.userns.node_range): this package stays pure Python.
    userns: str = ""

    @classmethod
    def from_env(cls) -> ServiceConfig:
        return cls(
            nats_url=nats_url(),
            node_id=node_id(),
            data_dir=default_data_dir(),
            capacity=int(os.environ.get("SANDFLEET_CAPACITY", "2000")),
            layer_fetch=os.environ.get("SANDFLEET_LAYER_FETCH") or "lazy",
            default_layers=tuple(n for n in os.environ.get("SANDFLEET_DEFAULT_LAYERS", "").split(",") if n.strip()),
            userns=os.environ.get("SANDFLEET_USERNS", ""),
        )


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

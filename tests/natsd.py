"""A bare nats-server with JetStream, on a free loopback port, for tests of the bus adapter and
the store that need no platform."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from sandfleet.config import free_port

from sandfleet.supervisor import nats_server_binary


@contextlib.contextmanager
def bare_nats_server(store_dir: Path) -> Iterator[str]:
    """Yields its URL once it listens (nats-py's first connect does not retry)."""
    port = free_port()
    server = subprocess.Popen(
        [nats_server_binary(), "-js", "-sd", str(store_dir), "-p", str(port), "-a", "127.0.0.1"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)

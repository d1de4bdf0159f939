"""A nats-server on a free loopback port, for tests of the bus adapter, the store and the bus's
permissions that need no platform: bare (JetStream, no users), or with a platform's accounts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats

from sandfleet.bus_accounts import AuthDir, write_accounts
from sandfleet.credentials import read_seed
from sandfleet.config import free_port
from sandfleet.supervisor import nats_server_binary, write_nats_config


@contextlib.contextmanager
def _listening(argv: list[str], port: int) -> Iterator[str]:
    """Runs the server `argv` and yields its URL once it listens on `port` (nats-py's first
    connect does not retry); stops it after."""
    server = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


@contextlib.contextmanager
def bare_nats_server(store_dir: Path) -> Iterator[str]:
    port = free_port()
    with _listening([nats_server_binary(), "-js", "-sd", str(store_dir), "-p", str(port), "-a", "127.0.0.1"],
                    port) as url:
        yield url


@contextlib.contextmanager
def authed_nats_server(data: Path, nodes: list[str]) -> Iterator[tuple[str, AuthDir]]:
    """A nats-server with the accounts and users `up` makes for a platform of `nodes` (real
    credentials in `data`), and the AuthDir to sign in with."""
    auth = AuthDir.of(data)
    auth.platform(nodes)
    write_accounts(data, auth)
    port = free_port()
    with _listening([nats_server_binary(), "-c", str(write_nats_config(data, port, auth=auth))], port) as url:
        yield url, auth


async def refused_publishes(url: str, creds: Path, requests: list[tuple[str, bytes]]) -> set[str]:
    """Publish each (subject, payload) with `creds`, as a role would by hand; the subjects the
    server refused to carry (lower-cased, as its -ERR says them)."""
    refusals: list[str] = []

    async def error_cb(exc: Exception) -> None:
        refusals.append(str(exc))

    conn = await nats.connect(url, allow_reconnect=False, error_cb=error_cb, nkeys_seed_str=read_seed(creds))
    try:
        for subject, payload in requests:
            await conn.publish(subject, payload, reply=conn.new_inbox())
        await conn.flush()
        for _ in range(100):  # the server's -ERRs come before its answer to the flush; their callbacks, soon after
            if len(refusals) >= len(requests):
                break
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    return {r.split('"')[1] for r in refusals if "permissions violation for publish" in r.lower()}

"""E2B API keys that are tenants of the bus: `sandfleet tenant add NAME --e2b-key` gives a tenant
a key, and the gateway answers it with that tenant's own bus credentials, judged by the pinned
`e2b` SDK on the real platform. A sandbox made with one tenant's key is invisible to the other's
(list, connect, info, kill, commands), its record names the tenant the bus server vouched for
(not a label the gateway set), a key added while the gateway runs works at once, and an unknown
key gets E2B's 401.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import time

import pytest
from e2b import AsyncSandbox, AuthenticationException, SandboxException, SandboxNotFoundException

from sandfleet.config import free_port
from tests.conftest import CLI, ROOT

pytestmark = pytest.mark.timeout(300)
HOST_TEMPLATE = {"isolation": "process", "host_view": True, "memory_mb": 256, "disk_mb": 256}


def _key(platform, name: str) -> str:
    done = platform.cli("tenant", "add", name, "--e2b-key", "--data-dir", str(platform.data_dir))
    assert "BEGIN USER NKEY SEED" in done.stdout.decode()  # stdout stays the credentials file alone
    found = re.search(rb"E2B API key of tenant [a-z0-9_-]+: (e2b_[0-9a-f]+)", done.stderr)
    assert found, done.stderr
    return found.group(1).decode()


@pytest.fixture(scope="module")
def gateway(platform, tmp_path_factory):
    keys = {"frank": _key(platform, "frank")}
    port = free_port()
    log = open(tmp_path_factory.mktemp("gateway") / "gateway.log", "wb")
    proc = subprocess.Popen(
        [*CLI, "gateway", "--nats", platform.url, "--listen", f"127.0.0.1:{port}",
         "--templates", json.dumps({"host": HOST_TEMPLATE})],
        env={**platform.env, "SANDFLEET_DATA_DIR": str(platform.data_dir)}, cwd=ROOT, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the gateway exited at start"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            break
        assert time.monotonic() < deadline, "the gateway did not listen within 60s"
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    yield {"keys": keys, "opts": lambda key: {"api_key": key, "api_url": url, "sandbox_url": url}}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    assert proc.returncode == 0, "the gateway did not stop cleanly on SIGTERM"


async def test_a_tenants_key_sees_its_own_sandboxes_only(platform, gateway, fleet):
    frank = gateway["opts"](gateway["keys"]["frank"])
    grace = gateway["opts"](_key(platform, "grace"))  # added while the gateway runs
    sbx = await AsyncSandbox.create(template="host", metadata={"suite": "e2b-keys"}, **frank)
    try:
        assert (await sbx.commands.run("echo mine")).stdout == "mine\n"
        record = await fleet.get(sbx.sandbox_id)
        assert record.tenant == "frank"  # the bus account the gateway made it through
        assert sbx.sandbox_id in [s.sandbox_id for s in await AsyncSandbox.list(**frank).next_items()]
        theirs = await AsyncSandbox.create(template="host", **grace)
        try:
            assert (await fleet.get(theirs.sandbox_id)).tenant == "grace"
            assert [s.sandbox_id for s in await AsyncSandbox.list(**grace).next_items()] == [theirs.sandbox_id]
            with pytest.raises(SandboxNotFoundException):
                await AsyncSandbox.get_info(sbx.sandbox_id, **grace)
            with pytest.raises(SandboxException):
                await AsyncSandbox.connect(sbx.sandbox_id, **grace)
            assert await AsyncSandbox.kill(sbx.sandbox_id, **grace) is False
            assert sbx.sandbox_id not in [s.sandbox_id for s in await AsyncSandbox.list(**grace).next_items()]
        finally:
            await theirs.kill()
        assert (await sbx.commands.run("echo still")).stdout == "still\n"  # untouched by the other key
    finally:
        await sbx.kill()


async def test_an_unknown_key_gets_e2bs_401(gateway):
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(template="host", **gateway["opts"]("e2b_" + "0" * 40))

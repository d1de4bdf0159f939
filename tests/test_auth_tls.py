"""`sandfleet up --tls`: a platform whose bus speaks TLS only, its certificates made by `up`, and
clients that verify them: the SDK (finding the CA as it finds the credentials) creates and execs;
a client that does not trust the platform's CA is refused at the handshake, and the server asks
every client for TLS before anything else. The cluster configs (loopback and `infra/`) with TLS
on their routes are valid server configs.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from urllib.parse import urlsplit

import nats
import pytest

import sandfleet
from sandfleet.bus_accounts import AuthDir, write_accounts
from sandfleet.credentials import connect_options, find_ca
from sandfleet.supervisor import nats_server_binary, plan_nats, write_nats_config
from sandfleet.tls import TlsDir
from tests.conftest import NODE_ID, ROOT, own_platform

pytestmark = pytest.mark.timeout(300)
SUBNET = "10.203.0.0/16"  # its own: a session platform on this host may hold the default one's DNS stub


async def test_a_tls_platform_creates_and_execs_and_refuses_clients_that_do_not_verify(tmp_path):
    with own_platform(tmp_path / "data", f"{NODE_ID}-tls", extra=("--tls", "--egress-subnet", SUBNET)) as p:
        assert p.url.startswith("tls://")
        tls = TlsDir.of(p.data_dir)
        assert find_ca(p.url) == tls.ca and tls.key.stat().st_mode & 0o077 == 0
        async with sandfleet.connect(p.url) as fleet:
            sb = await fleet.create(memory_mb=64, host_view=True)
            try:
                ran = await sb.exec(["sh", "-c", "echo over tls"])
                assert (ran.exit_code, ran.stdout) == (0, b"over tls\n")
            finally:
                await sb.destroy()
        # The server asks for TLS first: its INFO says so, and nothing goes in the clear.
        address = urlsplit(p.url)
        with socket.create_connection((address.hostname, address.port), timeout=10) as raw:
            info = json.loads(raw.recv(65536).split(b" ", 1)[1])
        assert info["tls_required"] is True
        # A client with the right credentials but not the platform's CA (the system store): refused.
        options = {k: v for k, v in connect_options(p.url).items() if k != "tls"}
        with pytest.raises((nats.errors.Error, OSError)) as refused:
            await nats.connect(p.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, **options)
        assert "certificate verify failed" in str(refused.value).lower() or "ssl" in repr(refused.value).lower()


def test_cluster_configs_with_tls_on_clients_and_routes_are_valid(tmp_path):
    tls = TlsDir.of(tmp_path).ensure(("10.0.0.1", "nats-1.example"))
    servers = plan_nats(0, 3)
    for s in servers:
        text = write_nats_config(tmp_path, s.port, s, servers, tls=tls).read_text()
        assert text.count("tls {") == 2  # clients and routes
        out = subprocess.run([nats_server_binary(), "-c", str(tmp_path / f"{s.name}.conf"), "-t"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    san = subprocess.run(["openssl", "x509", "-in", str(tls.cert), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    assert "IP Address:10.0.0.1" in san and "DNS:nats-1.example" in san and "IP Address:127.0.0.1" in san


@pytest.mark.parametrize("name", ["nats-1.conf", "nats-2.conf", "nats-3.conf"])
def test_the_infra_cluster_configs_take_credentials_and_tls(tmp_path, name):
    # As an operator deploys them: beside each, the accounts file and the certificates
    # (`sandfleet tenant init-cluster`, infra/nats-cluster/README.md).
    conf = ROOT / "infra" / "nats-cluster" / name
    text = conf.read_text()
    assert 'include "accounts.conf"' in text and text.count("tls {") == 2 and "verify: true" in text
    shutil.copy(conf, tmp_path / name)
    auth = AuthDir.of(tmp_path)
    auth.platform(["node-a"])
    write_accounts(tmp_path, auth)
    tls = TlsDir(tmp_path / "tls").ensure(("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    assert tls.cert.exists()
    out = subprocess.run([nats_server_binary(), "-c", str(tmp_path / name), "-t"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr

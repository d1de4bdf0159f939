"""TLS for the bus: the certificates `sandfleet up --tls` makes, and the context clients verify with.

`up --tls` makes, once per data dir and kept, a private CA and a server certificate it signs
(`<data dir>/tls/`, root-only, made with the `openssl` command every Linux machine has: no new
Python dependency), for the names clients dial (127.0.0.1, localhost, this host's name, and any
given); every nats-server of the platform presents it to clients and to its cluster routes,
which verify each other by the same CA. Clients verify the server against the CA only (never
the system store, never unverified): `SANDFLEET_TLS_CA` names the CA file, or, on the machine
that runs the platform, the note `up` registers for its address (sandfleet.credentials) does.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

TLS_CA_ENV = "SANDFLEET_TLS_CA"
DAYS = 3650


class TlsError(RuntimeError):
    """The certificates could not be made (openssl missing or failing): the message says why."""


@dataclass(frozen=True)
class TlsDir:
    root: Path

    @classmethod
    def of(cls, data_dir: Path) -> TlsDir:
        return cls(data_dir / "tls")

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def key(self) -> Path:
        return self.root / "server.key"

    def ensure(self, names: tuple[str, ...] = ()) -> TlsDir:
        """The CA and the server certificate, made on first need (for 127.0.0.1, ::1, localhost,
        this host's name and `names`) and kept after."""
        if self.ca.exists() and self.cert.exists() and self.key.exists():
            return self
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        hosts = ["localhost", socket.gethostname(), *(n for n in names if not _is_ip(n))]
        ips = ["127.0.0.1", "::1", *(n for n in names if _is_ip(n))]
        san = ",".join([*(f"DNS:{h}" for h in dict.fromkeys(hosts) if h), *(f"IP:{i}" for i in dict.fromkeys(ips))])
        ca_key = self.root / "ca.key"
        old = os.umask(0o077)  # every key file is the owner's alone from its first byte
        try:
            _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(self.ca),
                     "-days", str(DAYS), "-subj", "/CN=sandfleet bus CA",
                     "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
            with tempfile.TemporaryDirectory(dir=self.root) as tmp:
                csr, ext = Path(tmp) / "server.csr", Path(tmp) / "ext.cnf"
                ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
                               "basicConstraints=CA:FALSE\n")
                _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key), "-out", str(csr),
                         "-subj", "/CN=sandfleet bus")
                _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(ca_key),
                         "-CAcreateserial", "-out", str(self.cert), "-days", str(DAYS), "-extfile", str(ext))
        finally:
            os.umask(old)
        return self


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _openssl(*args: str) -> None:
    try:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TlsError(f"openssl {args[0]}: {exc}") from None
    if done.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def client_context(ca: Path) -> ssl.SSLContext:
    """Verifies the server's certificate and name against `ca` alone."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_block(tls: TlsDir, *, routes: bool = False) -> str:
    """A nats-server `tls {}` block for clients, or (`routes`) for cluster routes, which also
    verify the peer server's certificate."""
    verify = " verify: true," if routes else ""
    return (f'tls {{ cert_file: "{tls.cert}", key_file: "{tls.key}", ca_file: "{tls.ca}",{verify} timeout: 5 }}')

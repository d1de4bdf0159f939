"""The bus's credentials as a client holds them: an nkey user's seed in a file, found by itself.

The server only ever sees the public key and a signature over its nonce; the seed stays in a
root-only file. A client finds its credentials, first found wins: `creds=` given to the connect
call, `SANDFLEET_CREDS` (a file), then the local platform's admin file that `sandfleet up`
registered under the address it listens on (so on the machine that runs the platform, the SDK
and CLI need nothing). Nothing found: connect without (a bus with auth off).

Also here, because services and the SDK both read it: who the server says sent a request. A
tenant's request crosses from its own account into the platform's through a service import
with `share: true`, and the server (not the sender) writes `Nats-Request-Info` on it; a request
from inside the platform's account carries none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sandfleet.config import local_credentials_dir, nats_servers
from sandfleet.tls import TLS_CA_ENV, client_context

CREDS_ENV = "SANDFLEET_CREDS"
REQUEST_INFO = "Nats-Request-Info"  # written by the server on requests through a shared service import
USER_INFO = "$SYS.REQ.USER.INFO"  # nats-server answers any user with its own user, account and permissions
TENANT_ACCOUNT_PREFIX = "tenant-"  # a tenant's account is `tenant-<name>`
SEED_RE = re.compile(r"^\s*(SU[A-Z2-7]{56})\s*$", re.MULTILINE)  # an nkey user seed: 58 base32 characters
TENANT_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")


class CredentialsError(ValueError):
    """A credentials file that holds no user seed, or a tenant name the bus cannot carry."""


def creds_text(seed: str, what: str) -> str:
    """A credentials file: the seed between NATS's own markers (the seed half of a `.creds` file)."""
    return (f"# sandfleet bus credentials: {what}. Keep this file private (mode 0600).\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{seed}\n"
            "------END USER NKEY SEED------\n")


def read_seed(path: Path) -> str:
    found = SEED_RE.search(path.read_text())
    if found is None:
        raise CredentialsError(f"{path}: no nkey user seed in it")
    return found.group(1)


def write_private(path: Path, text: str) -> None:
    """Created 0600 (in a 0700 dir) before a byte is written, so no other user ever reads it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def _address(url: str) -> str:
    """`host_port` of a bus URL's first server: the key of the local registry."""
    first = urlsplit(nats_servers(url)[0] if "://" in url else f"nats://{url}")
    return f"{first.hostname or '127.0.0.1'}_{first.port or 4222}"


def register_local(url: str, creds: Path | None, pid: int, ca: Path | None = None) -> list[Path]:
    """Note, for clients on this machine, that the bus at each of `url`'s servers takes `creds`
    and (with `--tls`) presents a certificate of the CA `ca` (while supervisor `pid` lives).
    Returns the notes written, for `unregister_local`."""
    notes = []
    for server in nats_servers(url):
        note = local_credentials_dir() / f"{_address(server)}.json"
        entry = {"creds": str(creds) if creds else "", "pid": pid, **({"ca": str(ca)} if ca else {})}
        write_private(note, json.dumps(entry))
        notes.append(note)
    return notes


def unregister_local(notes: list[Path]) -> None:
    for note in notes:
        note.unlink(missing_ok=True)


def _local_note(url: str, field: str) -> Path | None:
    """A file a platform on this machine registered for `url` (`creds`, `ca`), if its supervisor
    still runs (a note left by one that crashed names a bus that is no more)."""
    note = local_credentials_dir() / f"{_address(url)}.json"
    try:
        entry = json.loads(note.read_text())
        os.kill(int(entry["pid"]), 0)
        named = entry.get(field) or ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    path = Path(named) if isinstance(named, str) and named else None
    return path if path is not None and path.exists() else None


def local_creds(url: str) -> Path | None:
    """The admin credentials a platform on this machine registered for `url`."""
    return _local_note(url, "creds")


def find_ca(url: str) -> Path | None:
    """The CA the bus's certificate must be signed by: $SANDFLEET_TLS_CA, else the one a
    platform on this machine registered for `url` (`up --tls`). None: the bus has no TLS."""
    if os.environ.get(TLS_CA_ENV):
        return Path(os.environ[TLS_CA_ENV])
    return _local_note(url, "ca")


def find_creds(url: str, explicit: str | Path | None = None) -> Path | None:
    if explicit:
        return Path(explicit)
    if os.environ.get(CREDS_ENV):
        return Path(os.environ[CREDS_ENV])
    return local_creds(url)


def inbox_prefix(public_key: str) -> str:
    """The inboxes of one user: its replies come to `_INBOX.<part of its key>.…`, and in the
    platform's account a service or node may subscribe to its own inboxes only, so none reads
    the replies meant for another (a tenant's inboxes are its account's own anyway)."""
    return f"_INBOX.{public_key[1:17]}"


def connect_options(url: str, creds: str | Path | None = None) -> dict[str, Any]:
    """What to hand `nats.connect` so it signs in with the credentials found for `url`, and
    verifies the server's certificate against the CA found for it (for a caller that opens its
    own nats-py connection)."""
    return _options(find_creds(url, creds), find_ca(url))


def remote_file(data_dir: Path, url: str, kind: str) -> Path:
    """Where `sandfleet remote add` files what another platform's bus at `url` takes: `creds` or
    `ca`, under the data dir of the machine whose layer-cache connects to it."""
    return data_dir / "remotes" / f"{_address(url)}.{kind}"


def remote_options(url: str, data_dir: Path) -> dict[str, Any]:
    """What to hand `nats.connect` for another platform's bus (a layer push or pull): what the
    operator filed for its address (`sandfleet remote add`), else what a platform on this machine
    registered for it. Never this process's own credentials: SANDFLEET_CREDS is who it is on its
    own bus, and no other bus should see that seed's signature."""
    def filed(kind: str) -> Path | None:
        path = remote_file(data_dir, url, kind)
        return path if path.exists() else None

    return _options(filed("creds") or local_creds(url), filed("ca") or _local_note(url, "ca"))


def _options(path: Path | None, ca: Path | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if ca is not None:
        options["tls"] = client_context(ca)
    if path is None:
        return options
    import nkeys  # only a client that signs in needs it

    seed = read_seed(path)
    public = nkeys.from_seed(bytearray(seed.encode())).public_key.decode()
    return {**options, "nkeys_seed_str": seed, "inbox_prefix": inbox_prefix(public)}


def tenant_of(headers: dict[str, str] | None) -> str | None:
    """The tenant the server says sent a request, or None for a request from inside the platform's
    account (a service, a node, the operator). A request-info header naming any other account is
    refused rather than taken for the platform."""
    info = (headers or {}).get(REQUEST_INFO)
    if info is None:
        return None
    try:
        account = json.loads(info).get("acc", "")
    except (ValueError, AttributeError):
        account = ""
    tenant = tenant_of_account(account) if isinstance(account, str) else None
    return "?" if tenant is None else tenant  # unknown account: a name no sandbox record carries, so it reaches nothing


def tenant_of_account(account: str) -> str | None:
    """`alice` for the account `tenant-alice`; None for any other account (never "": the platform's)."""
    return account[len(TENANT_ACCOUNT_PREFIX):] or None if account.startswith(TENANT_ACCOUNT_PREFIX) else None


def new_api_key() -> str:
    """An E2B API key for a tenant (E2B's own keys start `e2b_` too)."""
    return f"e2b_{secrets.token_hex(20)}"


def api_key_digest(key: str) -> str:
    """What the E2B key table keeps of a key: a key is 160 random bits, so a plain hash suffices."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME_RE.fullmatch(name):
        raise CredentialsError(f"{name!r}: a tenant name is lowercase letters, digits, '-' and '_' (at most 48)")
    return name

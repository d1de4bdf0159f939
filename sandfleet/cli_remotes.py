"""`sandfleet remote add URL --creds FILE [--ca FILE]`, `remote list`, `remote remove URL`: the
other platforms' buses this machine's layer-cache may push layers to and pull them from, with
the credentials each takes (from its operator: `sandfleet tenant node-creds ID` there gives a
node's, which may read and write its layer store) and the CA its certificate is signed by.

Run on the machine whose layer-cache does the copy (they are filed under its data dir, 0600, as
`remotes/<host>_<port>.creds|ca`); `layer push`/`layer pull` then sign in with them by the URL's
address. A file that holds no seed, or a CA that is no certificate, is refused before it is filed.
"""

from __future__ import annotations

import argparse
import ssl
import sys
from pathlib import Path

from sandfleet.config import default_data_dir
from sandfleet.credentials import CredentialsError, creds_text, read_seed, remote_file, write_private

KINDS = ("creds", "ca")


def register(sub: argparse._SubParsersAction) -> None:
    remote = sub.add_parser("remote", help="other platforms' buses for `layer push`/`layer pull`, with their credentials")
    verbs = remote.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="file the credentials (and CA) another platform's bus takes")
    add.add_argument("url", help="its bus, e.g. tls://store.example:4222")
    add.add_argument("--creds", type=Path, required=True, help="a credentials file its operator gave you")
    add.add_argument("--ca", type=Path, default=None, help="the CA its certificate is signed by (its `up --tls`)")
    add.set_defaults(func=_add)
    listed = verbs.add_parser("list", help="the buses filed, by address")
    listed.set_defaults(func=_list)
    remove = verbs.add_parser("remove", help="forget what was filed for a bus")
    remove.add_argument("url")
    remove.set_defaults(func=_remove)
    for parser in (add, listed, remove):
        parser.add_argument("--data-dir", type=Path, default=None, help="this machine's (default: the usual one)")


def _data_dir(args: argparse.Namespace) -> Path:
    return (args.data_dir or default_data_dir()).resolve()


def _add(args: argparse.Namespace) -> int:
    try:
        seed = read_seed(args.creds)
        ca = args.ca.read_text() if args.ca else None
        if ca is not None:
            ssl.create_default_context(cadata=ca)  # a certificate, or SSLError
    except (OSError, CredentialsError, ssl.SSLError, ValueError) as exc:
        print(f"sandfleet remote add: {exc}", file=sys.stderr)
        return 2
    data_dir = _data_dir(args)
    write_private(remote_file(data_dir, args.url, "creds"), creds_text(seed, f"for the bus at {args.url}"))
    ca_file = remote_file(data_dir, args.url, "ca")
    if ca is not None:
        write_private(ca_file, ca)
    else:
        ca_file.unlink(missing_ok=True)  # filed again without one: that bus has no TLS now
    print(f"{args.url}: credentials{' and CA' if ca is not None else ''} filed under {ca_file.parent}")
    return 0


def _list(args: argparse.Namespace) -> int:
    folder = _data_dir(args) / "remotes"
    filed: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        address, _, kind = path.name.rpartition(".")
        host, _, port = address.rpartition("_")  # filed as host_port
        if kind in KINDS:
            filed.setdefault(f"{host}:{port}", []).append(kind)
    for address, kinds in filed.items():
        print(f"{address}\t{' '.join(kinds)}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args)
    gone = [kind for kind in KINDS if _unlink(remote_file(data_dir, args.url, kind))]
    if not gone:
        print(f"sandfleet remote remove: nothing filed for {args.url}", file=sys.stderr)
        return 1
    print(f"{args.url}: {' and '.join(gone)} removed")
    return 0


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True

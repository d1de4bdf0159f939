"""`sandfleet tenant add NAME` and `sandfleet tenant node-creds ID`: credentials for a team (or
a trainer) and for a node joining from another machine, printed as a credentials file.
`tenant add NAME --e2b-key [KEY]` also gives the tenant an E2B API key (made, or the one given)
that the E2B gateway answers with the tenant's own credentials; the key goes to stderr, so the
credentials file alone goes to stdout.

Run on the machine that runs the bus (they live in its data dir): the user is added to the
accounts every server includes, each server rereads its config, and the command returns once
the bus takes the new credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from sandfleet import errors
from sandfleet.bus import Bus
from sandfleet.bus_accounts import ACCOUNTS_CONF, AuthDir, reload_servers, write_accounts
from sandfleet.config import default_data_dir
from sandfleet.credentials import CredentialsError, new_api_key, write_private
from sandfleet.supervisor import read_state
from sandfleet.tls import TlsDir, TlsError
from schemas import sandbox

RELOAD_WAIT_S = 30.0  # a loaded machine: placement's list of every record can take seconds


def register(sub: argparse._SubParsersAction) -> None:
    tenant = sub.add_parser("tenant", help="bus credentials for a tenant (or a node): printed as a credentials file")
    verbs = tenant.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="a tenant: its own sandboxes only")
    add.add_argument("name")
    add.add_argument("--e2b-key", nargs="?", const="", default=None, metavar="KEY",
                     help="also an E2B API key for the gateway (made when no KEY is given), printed on stderr")
    add.set_defaults(func=_add_tenant)
    node = verbs.add_parser("node-creds", help="a node's, for `sandfleet node --creds FILE` on another machine")
    node.add_argument("node_id")
    node.set_defaults(func=_node_creds)
    for parser in (add, node):
        parser.add_argument("--data-dir", type=Path, default=None, help="the platform's (default: the usual one)")
        parser.add_argument("--out", type=Path, default=None, help="also write the file here (mode 0600)")
    cluster = verbs.add_parser("init-cluster", help="accounts.conf and TLS certificates for infra/nats-cluster/ "
                                                    "(a bus `up` does not run); then node-creds/add with --data-dir")
    cluster.add_argument("--data-dir", type=Path, required=True, help="where to make them (then copied to each server)")
    cluster.add_argument("--address", action="append", default=[], metavar="IP_OR_NAME",
                         help="a name or address clients dial a server by (repeat for each)")
    cluster.set_defaults(func=_init_cluster)


def _add_tenant(args: argparse.Namespace) -> int:
    def make(auth: AuthDir) -> Path:
        path = auth.tenant(args.name)
        if args.e2b_key is not None:
            key = args.e2b_key or new_api_key()
            auth.add_e2b_key(args.name, key)
            print(f"E2B API key of tenant {args.name}: {key}", file=sys.stderr)
        return path

    return _issue(args, make, tenant=True)


def _node_creds(args: argparse.Namespace) -> int:
    return _issue(args, lambda auth: auth.node(args.node_id), tenant=False)


def _init_cluster(args: argparse.Namespace) -> int:
    """The operator, the cluster services and the server certificate for a cluster of servers
    started from infra/nats-cluster/ (kept, as `up` keeps its own: running it again adds nothing)."""
    data_dir = args.data_dir.resolve()
    auth = AuthDir.of(data_dir)
    auth.platform([])
    conf = write_accounts(data_dir, auth)
    try:
        tls = TlsDir.of(data_dir).ensure(tuple(args.address))
    except TlsError as exc:
        print(f"sandfleet tenant init-cluster: {exc}", file=sys.stderr)
        return 1
    print(f"{conf}\n{tls.ca}\n{tls.cert}\n{tls.key}\n(credentials: {auth.root}; "
          "add nodes and tenants with `tenant node-creds` / `tenant add` and this --data-dir)")
    return 0


def _issue(args: argparse.Namespace, make, tenant: bool) -> int:  # type: ignore[no-untyped-def]
    data_dir = (args.data_dir or default_data_dir()).resolve()
    if not (data_dir / ACCOUNTS_CONF).exists():
        print(f"sandfleet tenant: no bus with credentials under {data_dir} (is it up, and without --no-auth?)",
              file=sys.stderr)
        return 2
    auth = AuthDir.of(data_dir)
    try:
        path = make(auth)
    except CredentialsError as exc:
        print(f"sandfleet tenant: {exc}", file=sys.stderr)
        return 2
    write_accounts(data_dir, auth)
    state = read_state(data_dir)
    if state and reload_servers(state) and not asyncio.run(_taken(state, path, tenant)):
        print(f"sandfleet tenant: the bus did not take {path} within {RELOAD_WAIT_S:g}s", file=sys.stderr)
        return 1
    text = path.read_text()
    if args.out:
        write_private(args.out, text)
    sys.stdout.write(text)
    return 0


async def _taken(state: dict, creds: Path, tenant: bool) -> bool:
    """A reload is asynchronous: sign in with the new credentials until the bus lets them in, and
    (a tenant) until its requests reach the platform. nats-server 2.15 wires a new account's
    service imports only on the reload after the one that added it, so it is asked again."""
    deadline = asyncio.get_running_loop().time() + RELOAD_WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        try:
            bus = await Bus.connect(state["url"], "sandfleet-tenant-check", deadline_s=2.0, creds=creds,
                                    max_reconnect_attempts=0, allow_reconnect=False)
        except errors.SandfleetError:
            await asyncio.sleep(0.1)
            continue
        try:
            if tenant:
                await bus.request(sandbox.LIST, sandbox.ListRequest(), sandbox.SandboxList, timeout=5)
            return True
        except errors.NoResponders:
            reload_servers(state)
            await asyncio.sleep(0.2)
        except errors.Timeout:  # it reached placement, which was slow to list (a loaded machine): ask again
            continue
        finally:
            await bus.close()
    return False

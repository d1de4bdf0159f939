"""`sandfleet pool set|list|clear`: warm pools for an operator, as `fleet.set_pool`, `fleet.pools`
and `fleet.clear_pool(s)` are for a trainer. A pool is a sandbox shape (isolation, resources,
layers); each node that runs its isolation keeps SIZE spares of it ready for creates of that shape."""

from __future__ import annotations

import argparse
import json

import msgspec

from sandfleet import client
from sandfleet.cli_rollout import _sync  # one fleet connection around a command, as rollout's verbs
from schemas.pools import PoolState


def register(sub: argparse._SubParsersAction) -> None:
    bus = argparse.ArgumentParser(add_help=False)
    bus.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--isolation", default="process", help="process (default) or container")
    shape.add_argument("--cpu", type=float, default=1.0)
    shape.add_argument("--memory-mb", type=int, default=512)
    shape.add_argument("--pids", type=int, default=512)
    shape.add_argument("--disk-mb", type=int, default=1024)
    shape.add_argument("--layers", default="", help="comma-separated layer names or digests, bottom first")
    shape.add_argument("--host-view", action="store_true", help="the host's system directories (process only)")

    pool = sub.add_parser("pool", help="warm pools: spares nodes keep ready for creates of one shape")
    verbs = pool.add_subparsers(dest="pool_command", required=True)
    st = verbs.add_parser("set", parents=[bus, shape], help="keep SIZE spares of this shape on each node (0 removes)")
    st.add_argument("--size", type=int, required=True)
    st.set_defaults(func=_sync(_set))
    ls = verbs.add_parser("list", parents=[bus], help="the pools and the spares each node has ready")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_sync(_list))
    cl = verbs.add_parser("clear", parents=[bus, shape], help="remove the pool of this shape, or --all")
    cl.add_argument("--all", action="store_true", help="every pool")
    cl.set_defaults(func=_sync(_clear))


def _shape(args: argparse.Namespace) -> dict:
    return dict(isolation=args.isolation, cpu=args.cpu, memory_mb=args.memory_mb, pids=args.pids,
                disk_mb=args.disk_mb, layers=[x for x in args.layers.split(",") if x], host_view=args.host_view)


def describe(state: PoolState) -> str:
    s = state.pool.spec
    where = ", ".join(f"{n}: {k}" for n, k in state.warm.items()) or "none ready yet"
    layers = ",".join(s.layers) or ("host view" if s.host_view else "default layers")
    return (f"{state.key}  size {state.pool.size}  {s.isolation} cpu {s.cpu:g} memory {s.memory_mb} MiB "
            f"pids {s.pids} disk {s.disk_mb} MiB  {layers}  warm: {where}")


async def _set(fleet: client.Fleet, args: argparse.Namespace) -> int:
    print(describe(await fleet.set_pool(size=args.size, **_shape(args))))
    return 0


async def _list(fleet: client.Fleet, args: argparse.Namespace) -> int:
    found = await fleet.pools()
    if args.json:
        print(json.dumps(msgspec.to_builtins(found), indent=2))
    for state in [] if args.json else found:
        print(describe(state))
    return 0


async def _clear(fleet: client.Fleet, args: argparse.Namespace) -> int:
    cleared = await (fleet.clear_pools() if args.all else fleet.clear_pool(**_shape(args)))
    print(f"cleared {len(cleared)} pool(s){': ' + ', '.join(cleared) if cleared else ''}")
    return 0

"""`sandfleet layer ...`: build, list, remove, push and pull layers, and show what a node caches and has mounted.

`register(sub)` adds the `layer` command to the main parser; `python -m sandfleet.cli_layers
layer ...` runs it on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from sandfleet import errors
from sandfleet.config import node_id
from sandfleet.layers_client import Layers, connect
from schemas.layers import BuildReply


def register(sub: argparse._SubParsersAction) -> None:
    layer = sub.add_parser("layer", help="build, list and remove layers; show a node's layer cache")
    verbs = layer.add_subparsers(dest="layer_command", required=True)
    bus = argparse.ArgumentParser(add_help=False)
    bus.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")

    build = verbs.add_parser("build", parents=[bus], help="build a layer (an EROFS image) and store it in the cluster")
    build.add_argument("name")
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--dir", type=Path, help="a directory, taken as it is")
    source.add_argument("--tar", type=Path, help="a `docker save` / OCI archive (flattened, whiteouts honoured) or a root tar")
    source.add_argument("--debian", nargs="*", metavar="PKG", help="a minimal Debian root with these packages")
    source.add_argument("--pip", nargs="+", metavar="REQS",
                        help="a Python environment over --on: requirements files and/or package specs")
    source.add_argument("--dockerfile", type=Path, help="a Dockerfile whose FROM is a layer, an image or an image "
                        "archive; each RUN runs in a sandbox, its writes the next layer")
    build.add_argument("--context", type=Path, default=None, help="the build context of --dockerfile (default: its dir)")
    build.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", help="an ARG's value")
    build.add_argument("--isolation", choices=["process", "container"], default="container",
                       help="the level RUN steps of --dockerfile run at")
    build.add_argument("--allow", action="append", default=[], metavar="RULE",
                       help="network the RUN steps of --dockerfile may reach (an allow rule; none by default)")
    build.add_argument("--suite", default="", help="Debian suite (default: the building node's release)")
    build.add_argument("--on", default=None, metavar="LAYER", help="the layer this one goes over")
    build.add_argument("--tag", action="append", default=[], help="also tag this build (repeatable)")
    build.add_argument("--compression", choices=["lz4", "lz4hc"], default="lz4")
    build.add_argument("--timeout-s", type=float, default=None)
    build.add_argument("--json", action="store_true")
    build.set_defaults(func=_sync(_build))

    imp = verbs.add_parser("import", parents=[bus], help="import an OCI image as a stack of layers (one per OCI layer)")
    imp.add_argument("name")
    imp.add_argument("source", help="an OCI archive, a `docker save` archive or an OCI layout directory")
    imp.add_argument("--tag", action="append", default=[], help="also tag this import (repeatable)")
    imp.add_argument("--compression", choices=["lz4", "lz4hc"], default="lz4")
    imp.add_argument("--max-unpacked-bytes", type=int, default=0,
                     help="refuse an image whose layers unpack to more (default: the node's limit)")
    imp.add_argument("--timeout-s", type=float, default=None)
    imp.add_argument("--json", action="store_true")
    imp.set_defaults(func=_sync(_import))

    ls = verbs.add_parser("ls", parents=[bus], help="list layers")
    ls.add_argument("name", nargs="?", default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_sync(_ls))

    rm = verbs.add_parser("rm", parents=[bus], help="remove a layer (NAME: with all its tags; NAME:TAG: one tag)")
    rm.add_argument("name")
    rm.set_defaults(func=_sync(_rm))

    push = verbs.add_parser("push", parents=[bus], help="copy a layer (and the images under it) to another store")
    push.add_argument("name")
    push.add_argument("--to", required=True, metavar="URL", help="the other store's NATS URL")
    push.add_argument("--json", action="store_true")
    push.set_defaults(func=_sync(_transfer))

    pull = verbs.add_parser("pull", parents=[bus], help="copy a layer (and the images under it) from another store")
    pull.add_argument("name")
    pull.add_argument("--from", dest="source", required=True, metavar="URL", help="the other store's NATS URL")
    pull.add_argument("--json", action="store_true")
    pull.set_defaults(func=_sync(_transfer))

    cache = verbs.add_parser("cache", parents=[bus], help="what a node caches and has mounted")
    cache.add_argument("--node", default=None, help="node id (default $SANDFLEET_NODE_ID or this host)")
    cache.add_argument("--drop", action="store_true", help="forget every cached image no sandbox uses")
    cache.add_argument("--json", action="store_true")
    cache.set_defaults(func=_sync(_cache))


def _sync(command: Callable[[Layers, argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> int:
            layers = await connect(args.nats, name="sandfleet-cli")
            try:
                return await command(layers, args)
            finally:
                await layers.bus.close()

        return asyncio.run(go())

    return run


def _json(value: Any) -> None:
    print(json.dumps(msgspec.to_builtins(value), indent=2))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


async def _build(layers: Layers, args: argparse.Namespace) -> int:
    common: dict[str, Any] = {"tags": args.tag, "compression": args.compression}
    if args.timeout_s:
        common["timeout"] = args.timeout_s
    if args.dockerfile is not None:
        if args.on:
            raise errors.InvalidRequest("--dockerfile builds over its FROM; it takes no --on")
        reply = await _dockerfile(layers, args)
        print(describe_import(reply))
        return 0
    if args.dir is not None:
        reply = await layers.build_dir(args.name, args.dir, on=args.on, **common)
    elif args.tar is not None:
        reply = await layers.build_tar(args.name, args.tar, on=args.on, **common)
    elif args.pip is not None:
        if not args.on:
            raise errors.InvalidRequest("--pip builds over a layer with a Python: pass --on LAYER")
        requirements, packages = pip_arguments(args.pip)
        reply = await layers.build_pip(args.name, args.on, packages, requirements=requirements, **common)
    else:
        if args.on:
            raise errors.InvalidRequest("--debian builds a base layer; it takes no --on")
        reply = await layers.build_debian(args.name, args.debian, suite=args.suite, **common)
    if args.json:
        _json(reply)
        return 0
    layer = reply.layer
    stored = "stored" if reply.stored else "already in the store"
    print(f"{layer.name}  {layer.digest}  {_size(layer.size)}  {layer.files} files  "
          f"{reply.seconds:.2f}s on {reply.node}  ({stored})")
    return 0


async def _dockerfile(layers: Layers, args: argparse.Namespace) -> BuildReply:
    from sandfleet import dockerfile_build
    from sandfleet.client import Fleet

    build_args = dict(a.partition("=")[::2] for a in args.build_arg)
    context = args.context or args.dockerfile.parent
    if not context.is_dir():
        raise errors.InvalidRequest(f"{context} is not a directory")
    return await dockerfile_build.build(Fleet(layers.bus), layers, args.name, args.dockerfile, context,
                                  build_args=build_args, isolation=args.isolation, tags=args.tag,
                                  allow=args.allow, log=lambda line: print(line, file=sys.stderr))


async def _import(layers: Layers, args: argparse.Namespace) -> int:
    extra: dict[str, Any] = {"timeout": args.timeout_s} if args.timeout_s else {}
    reply = await layers.import_image(args.name, args.source, tags=args.tag, compression=args.compression,
                                      max_unpacked_bytes=args.max_unpacked_bytes, **extra)
    if args.json:
        _json(reply)
        return 0
    print(describe_import(reply))
    return 0


def describe_import(reply: BuildReply) -> str:
    """What an import made, for people: its layers (new or shared), its config, and what of the
    config sandfleet does not apply."""
    layer = reply.layer
    reused = set(reply.reused)
    lines = [f"{layer.name}  {len(layer.stack)} layer(s), {len(layer.stack) - len(reused)} new  "
             f"{reply.seconds:.2f}s on {reply.node}"]
    for part in layer.stack:
        how = "shared" if part.digest in reused else "new"
        lines.append(f"  {_short(part.digest)}  {_size(part.size):>9}  {how:6}  diff {_short(part.diff_id) or '-'}  "
                     f"{part.created_by[:60]}".rstrip())
    config = layer.config
    if config is not None:
        command = [*config.entrypoint, *config.cmd]
        lines.append(f"  env {len(config.env)} var(s); workdir {config.working_dir or '-'}; user {config.user or '-'}; "
                     f"command {json.dumps(command) if command else '-'}; {len(config.labels)} label(s)")
        for item in config.not_applied:
            lines.append(f"  not applied: {item}")
    return "\n".join(lines)


def pip_arguments(reqs: list[str]) -> tuple[str, list[str]]:
    """(requirements text, package specs): an argument naming a file is a requirements file."""
    files = [Path(r) for r in reqs if Path(r).is_file()]
    text = "".join(f.read_text() + "\n" for f in files)
    return text, [r for r in reqs if not Path(r).is_file()]


async def _transfer(layers: Layers, args: argparse.Namespace) -> int:
    pushing = args.layer_command == "push"
    url = args.to if pushing else args.source
    reply = await (layers.push if pushing else layers.pull)(args.name, url)
    if args.json:
        _json(reply)
        return 0
    print(f"{'pushed' if pushing else 'pulled'} {reply.layer.name}  {reply.layer.digest}  "
          f"{len(reply.copied)} image(s) copied ({_size(reply.bytes)}), {len(reply.present)} already there  "
          f"{reply.seconds:.2f}s")
    return 0


async def _ls(layers: Layers, args: argparse.Namespace) -> int:
    found = await layers.list(args.name)
    if args.json:
        _json(found)
        return 0
    if not found:
        print("no layers", file=sys.stderr)
        return 0
    rows = [["NAME", "TAGS", "DIGEST", "SIZE", "BUILT", "ON", "FROM"]]
    for layer in found:
        tags = ",".join((["latest"] if layer.current else []) + layer.tags) or "-"
        built = time.strftime("%Y-%m-%d %H:%M", time.localtime(layer.created_at))
        rows.append([layer.name, tags, _short(layer.digest), _size(layer.size), built, layer.parent or "-",
                     layer.built_from])
    _table(rows)
    return 0


async def _rm(layers: Layers, args: argparse.Namespace) -> int:
    reply = await layers.remove(args.name)
    print(f"removed {', '.join(reply.removed)}"
          + (f"; deleted image(s) {', '.join(map(_short, reply.deleted_images))}" if reply.deleted_images else ""))
    return 0


async def _cache(layers: Layers, args: argparse.Namespace) -> int:
    node = args.node or node_id()
    if args.drop:
        dropped = await layers.cache_drop(node)
        if args.json:
            _json(dropped)
            return 0
        print(f"dropped {len(dropped.dropped)} image(s), {_size(dropped.freed_bytes)} freed; "
              f"{len(dropped.kept)} in use kept")
        return 0
    listing = await layers.cache(node)
    if args.json:
        _json(listing)
        return 0
    print(f"node {listing.node} (fetch {listing.fetch}): {_size(listing.used_bytes)} of "
          f"{_size(listing.budget_bytes)} used, {len(listing.images)} image(s), {len(listing.rootfs)} rootfs")
    if listing.images:
        rows = [["DIGEST", "NAMES", "SIZE", "FETCH", "FETCHED", "WRITTEN", "ON DISK", "MOUNTED", "USERS", "LAST USED"]]
        for i in listing.images:
            fetched = f"{_size(i.fetched_bytes)} ({100 * i.fetched_bytes / i.size:.0f}%)" if i.size else "-"
            rows.append([_short(i.digest), ",".join(i.names) or "-", _size(i.size), "lazy" if i.lazy else "full",
                         fetched, _size(i.written_bytes), _size(i.disk_bytes), "yes" if i.mounted else "no",
                         str(i.users), time.strftime("%H:%M:%S", time.localtime(i.last_used))])
        _table(rows)
    for r in listing.rootfs:
        broken = f"  BROKEN: {r.broken}" if r.broken else ""
        print(f"rootfs {r.sandbox_id}: {r.path} over {' < '.join(_short(d) for d in reversed(r.layers))}{broken}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandfleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except errors.SandfleetError as exc:
        print(f"sandfleet: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`sandfleet pause/resume/hint/checkpoint/restore`: the RL co-design commands of the CLI.

A checkpoint handle is printed (or written with --out) as JSON; `restore` reads it back,
from a file or `-` for stdin, so `sandfleet checkpoint ID | sandfleet restore -` migrates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from sandfleet import client, errors
from schemas.node import Checkpoint


def register(sub: argparse._SubParsersAction) -> None:
    bus = argparse.ArgumentParser(add_help=False)
    bus.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")

    for verb, help in (("pause", "freeze sandboxes (cgroup.freeze), or every sandbox of a task"),
                       ("resume", "thaw paused sandboxes, or every paused sandbox of a task")):
        p = sub.add_parser(verb, parents=[bus], help=help)
        p.add_argument("ids", nargs="*")
        p.add_argument("--task", default=None, help="every live sandbox labelled task=TASK, on every node")
        p.set_defaults(func=_sync(_pause if verb == "pause" else _resume))

    hint = sub.add_parser("hint", parents=[bus], help="lower (idle) or restore (active) a sandbox's CPU weight")
    hint.add_argument("id")
    hint.add_argument("hint", choices=["idle", "active"])
    hint.set_defaults(func=_sync(_hint))

    ck = sub.add_parser("checkpoint", parents=[bus], help="pack a sandbox's files into a new layer; print the handle")
    ck.add_argument("id")
    ck.add_argument("--name", default=None, help="the layer's name (default ckpt-<id>-<random>)")
    ck.add_argument("--keep-paused", action="store_true", help="leave the sandbox frozen afterwards")
    ck.add_argument("--memory", action="store_true", help="a VM's whole running machine: its processes go on "
                                                          "when restored")
    ck.add_argument("--out", type=Path, default=None, help="write the handle here instead of stdout")
    ck.set_defaults(func=_sync(_checkpoint))

    rs = sub.add_parser("restore", parents=[bus], help="start a new sandbox from a checkpoint handle (file or -)")
    rs.add_argument("handle")
    rs.set_defaults(func=_sync(_restore))


def _sync(command: Callable[[client.Fleet, argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go() -> int:
            async with client.connect(args.nats, name="sandfleet-cli") as fleet:
                return await command(fleet, args)

        return asyncio.run(go())

    return run


async def _each(fleet: client.Fleet, args: argparse.Namespace, verb: str) -> int:
    if bool(args.ids) == bool(args.task):
        raise errors.InvalidRequest("give sandbox ids or --task, not both or neither")
    if args.task:
        change = await (fleet.pause if verb == "pause" else fleet.resume)(task=args.task)
        print(f"task {args.task}: matched {change.matched}, {verb}d {change.changed}, unchanged {change.unchanged},"
              f" failed {change.failed}")
        for line in change.errors:
            print(f"  {line}", file=sys.stderr)
        return 1 if change.failed or change.errors else 0
    status = 0
    for sandbox_id in args.ids:
        sb = await fleet.sandbox(sandbox_id)
        try:
            record = await (sb.pause() if verb == "pause" else sb.resume())
            print(f"{sandbox_id}\t{record.state.value}")
        except errors.ServiceFailure as exc:
            print(f"{sandbox_id}\t{type(exc).__name__}: {exc.message}", file=sys.stderr)
            status = 1
    return status


async def _pause(fleet: client.Fleet, args: argparse.Namespace) -> int:
    return await _each(fleet, args, "pause")


async def _resume(fleet: client.Fleet, args: argparse.Namespace) -> int:
    return await _each(fleet, args, "resume")


async def _hint(fleet: client.Fleet, args: argparse.Namespace) -> int:
    reply = await (await fleet.sandbox(args.id)).hint(args.hint)
    print(f"{args.id}\t{reply.hint}\t{reply.file}={reply.value}")
    return 0


async def _checkpoint(fleet: client.Fleet, args: argparse.Namespace) -> int:
    handle = await (await fleet.sandbox(args.id)).checkpoint(args.name, keep_paused=args.keep_paused,
                                                               memory=args.memory)
    text = json.dumps(msgspec.to_builtins(handle), indent=2)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"{args.id}\t{handle.name}\t{handle.digest}\t-> {args.out}")
    else:
        print(text)
    return 0


async def _restore(fleet: client.Fleet, args: argparse.Namespace) -> int:
    raw = sys.stdin.read() if args.handle == "-" else Path(args.handle).read_text()
    try:
        handle = msgspec.json.decode(raw, type=Checkpoint)
    except msgspec.DecodeError as exc:
        raise errors.InvalidRequest(f"not a checkpoint handle: {exc}") from None
    sb = await fleet.restore(handle)
    print(f"{sb.id}\t{sb.node}")
    return 0

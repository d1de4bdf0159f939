"""`sandfleet cp SRC DST`: copy a file or directory into or out of a sandbox, `ID:path` naming the
sandbox's side (a relative path is under /workspace). As `cp` and `docker cp` do, a destination
that is an existing directory receives the source under its own name. A long transfer shows
its progress on stderr when that is a terminal (or with --progress); the summary goes to stdout,
and a closed pipe there (`| head`) ends quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path, PurePosixPath

from sandfleet import client, errors

_REMOTE = re.compile(r"^([a-z0-9][a-z0-9\-]{0,63}):(.*)$")


def register(sub: argparse._SubParsersAction) -> None:
    cp = sub.add_parser("cp", help="copy a file or directory into (DST=ID:path) or out of (SRC=ID:path) a sandbox")
    cp.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="show progress on stderr (default: when it is a terminal)")
    cp.set_defaults(func=_cp)


def _remote(arg: str) -> tuple[str, str] | None:
    if os.path.exists(arg):
        return None  # a local path that happens to hold a colon
    match = _REMOTE.match(arg)
    if match is None:
        return None
    path = match.group(2) or "/workspace"
    return match.group(1), path if path.startswith("/") else f"/workspace/{path}"


class _Meter:
    """A progress line, redrawn at most a few times a second."""

    def __init__(self, on: bool) -> None:
        self.on, self.started, self.drawn = on, time.monotonic(), 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.on or (now - self.drawn < 0.25 and done != total):
            return
        self.drawn = now
        rate = done / max(now - self.started, 1e-6)
        of = f" / {_size(total)}" if total >= 0 else ""
        sys.stderr.write(f"\r{_size(done)}{of}  {_size(rate)}/s ")
        sys.stderr.flush()

    def end(self) -> None:
        if self.on and self.drawn:
            sys.stderr.write("\n")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _cp(args: argparse.Namespace) -> int:
    src, dst = _remote(args.src), _remote(args.dst)
    if (src is None) == (dst is None):
        raise errors.InvalidRequest("exactly one of SRC and DST is a sandbox's ID:path")
    meter = _Meter(sys.stderr.isatty() if args.progress is None else args.progress)

    async def go() -> str:
        async with client.connect(args.nats, name="sandfleet-cli") as fleet:
            if dst is not None:
                sb = await fleet.sandbox(dst[0])
                target = dst[1]
                if await _remote_dir(sb, target):
                    target = str(PurePosixPath(target) / Path(args.src).resolve().name)
                done = await sb.upload(args.src, target, progress=meter)
                return f"{args.src} -> {sb.id}:{target}\t{done.size} bytes\t{done.check} {done.digest}"
            assert src is not None
            sb = await fleet.sandbox(src[0])
            local = Path(args.dst)
            if local.is_dir():
                local = local / (PurePosixPath(src[1]).name or "root")
            done = await sb.download(src[1], local, progress=meter)
            return f"{sb.id}:{src[1]} -> {local}\t{done.size} bytes\t{done.check} {done.digest}"

    try:
        summary = asyncio.run(go())
    finally:
        meter.end()
    try:
        print(summary, flush=True)
    except BrokenPipeError:  # `| head` closed it: the copy is done, say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


async def _remote_dir(sb, path: str) -> bool:
    try:
        return (await sb.files.stat(path)).kind == "dir"
    except errors.NotFound:
        return False

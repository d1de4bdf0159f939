"""`sandfleet fusion layers`: the language layers the SandboxFusion endpoint (`services/fusion`)
judges code in, each a minimal Debian root with that language's packages, named `lang-<language>`
(the endpoint's default for each language); and `sandfleet fusion serve`, the endpoint alone.

`--combined NAME` builds one layer with the toolchains of every language asked for instead: a
Debian root is a base layer (it cannot go on a shared base), so separate layers each carry their
own copy of the ~70 MiB base system; one layer carries it once. Point the endpoint at it with
`SANDFLEET_FUSION_LAYERS=python=NAME,cpp=NAME,...` (the command prints the setting)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from sandfleet.extras import require
from sandfleet.layers_client import connect

# Debian packages of each language's toolchain (bash is in every Debian root; named for clarity).
PACKAGES = {
    "python": ["python3"],
    "bash": ["bash"],
    "cpp": ["g++"],
    "nodejs": ["nodejs"],
    "go": ["golang-go"],
    "java": ["default-jdk-headless"],
}


def register(sub: argparse._SubParsersAction) -> None:
    fusion = sub.add_parser("fusion", help="the SandboxFusion-compatible endpoint: its language layers, or serve it")
    verbs = fusion.add_subparsers(dest="verb", required=True)
    layers = verbs.add_parser("layers", help="build the language layers from Debian's packages")
    layers.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    layers.add_argument("--only", default=",".join(PACKAGES), metavar="LANG,LANG",
                        help=f"these languages only (default all: {','.join(PACKAGES)})")
    layers.add_argument("--combined", default=None, metavar="NAME",
                        help="one layer NAME with every asked language's toolchain, instead of one each")
    layers.set_defaults(func=_layers)
    serve = verbs.add_parser("serve", help="run the endpoint in the foreground against a running bus")
    serve.add_argument("--nats", default=None)
    serve.add_argument("--port", type=int, default=None, help="default $SANDFLEET_FUSION_PORT or 8080")
    serve.add_argument("--host", default=None, help="default $SANDFLEET_FUSION_HOST or 127.0.0.1")
    serve.set_defaults(func=_serve)


def build_plan(only: str, combined: str | None) -> list[tuple[str, list[str]]]:
    """(layer, packages) to build, in order; ValueError for a language without a recipe."""
    langs = [lang.strip() for lang in only.split(",") if lang.strip()]
    unknown = [lang for lang in langs if lang not in PACKAGES]
    if unknown or not langs:
        raise ValueError(f"unknown language {', '.join(unknown) or '(none)'}: choose from {', '.join(PACKAGES)}")
    if combined:
        return [(combined, sorted({p for lang in langs for p in PACKAGES[lang]}))]
    return [(f"lang-{lang}", PACKAGES[lang]) for lang in langs]


def _layers(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args.only, args.combined)
    except ValueError as exc:
        print(f"sandfleet fusion layers: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_build(args.nats, plan))
    if args.combined:
        langs = [lang.strip() for lang in args.only.split(",") if lang.strip()]
        print("SANDFLEET_FUSION_LAYERS=" + ",".join(f"{lang}={args.combined}" for lang in langs))
    return 0


async def _build(url: str | None, plan: list[tuple[str, list[str]]]) -> None:
    layers = await connect(url)
    try:
        total = time.monotonic()
        for name, packages in plan:
            reply = await layers.build_debian(name, packages)
            print(f"{name:<14} {' '.join(packages):<28} {reply.layer.size / 2**20:7.1f} MiB  "
                  f"{reply.layer.files:6d} files  {reply.seconds:6.1f} s", flush=True)
        print(f"{len(plan)} layer(s) in {time.monotonic() - total:.1f} s")
    finally:
        await layers.bus.close()


def _serve(args: argparse.Namespace) -> int:
    require("gateway", "serving the SandboxFusion endpoint")
    env = dict(os.environ)
    for value, name in ((args.nats, "SANDFLEET_NATS_URL"), (args.port, "SANDFLEET_FUSION_PORT"),
                        (args.host, "SANDFLEET_FUSION_HOST")):
        if value is not None:
            env[name] = str(value)
    # The endpoint is a service of its own: this package starts it as a process, never imports it.
    os.execve(sys.executable, [sys.executable, "-m", "services.fusion"], env)
    return 0  # not reached

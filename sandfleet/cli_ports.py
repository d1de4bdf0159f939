"""`sandfleet port-forward ID 8000[:LOCAL]`: a sandbox's port on this machine's loopback until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal

from sandfleet import client, errors


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("port-forward", help="reach a port of a sandbox on 127.0.0.1 (until Ctrl-C)")
    p.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("id")
    p.add_argument("ports", type=_ports, metavar="PORT[:LOCAL]",
                   help="the sandbox's port, and the local one (default: the same number; 0: any free one)")
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "::1", "own"],
                   help="where in the sandbox: its loopback (default) or its own egress address")
    p.set_defaults(func=_port_forward)


def _ports(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d{1,5})(?::(\d{1,5}))?", text)
    remote = int(m.group(1)) if m else 0
    local = int(m.group(2)) if m and m.group(2) is not None else remote
    if not (1 <= remote <= 65535 and 0 <= local <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r}: PORT or PORT:LOCAL, ports 1-65535 (LOCAL 0: any free one)")
    return remote, local


def _port_forward(args: argparse.Namespace) -> int:
    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        remote, local = args.ports
        async with client.connect(args.nats, name="sandfleet-cli") as fleet:
            sb = await fleet.sandbox(args.id)
            async with sb.forward(remote, local_port=local, host=args.host) as (host, port):
                with contextlib.suppress(BrokenPipeError):
                    print(f"forwarding {host}:{port} -> {args.id} port {remote} (Ctrl-C to stop)", flush=True)
                await stop.wait()
        return 0

    try:
        return asyncio.run(go())
    except OSError as exc:  # the local port is taken, say
        raise errors.InvalidRequest(f"cannot listen on 127.0.0.1:{args.ports[1]}: {exc.strerror}") from None

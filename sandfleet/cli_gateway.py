"""`sandfleet gateway`: the E2B-compatible gateway (services/gateway) in the foreground, against a
running bus; point the `e2b` SDK at it with E2B_API_URL and E2B_SANDBOX_URL (see the README)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from sandfleet.config import nats_url
from sandfleet.extras import require


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="serve the E2B API (REST, envd, port proxy) over this platform")
    p.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--listen", default=None, metavar="HOST:PORT", help="where to serve (default 127.0.0.1:3000)")
    p.add_argument("--domain", default=None,
                   help="the sandboxes' domain, for `<port>-<id>.<domain>` (default sandfleet.localhost:PORT)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT",
                   help="an API key and the tenant it is (repeatable; adds to $SANDFLEET_GATEWAY_API_KEYS)")
    p.add_argument("--templates", default=None, metavar="JSON",
                   help='named sandbox specs, e.g. {"base": {"isolation": "container", "layers": ["debian"]}}')
    p.add_argument("--isolation", default=None, help="of a template that is just a layer name (default container)")
    p.set_defaults(func=_gateway)


def _gateway(args: argparse.Namespace) -> int:
    require("gateway", "serving the E2B API")
    env = {**os.environ, "SANDFLEET_NATS_URL": nats_url(args.nats)}
    keys = [k for k in (env.get("SANDFLEET_GATEWAY_API_KEYS", ""), *args.api_key) if k]
    settings = {"SANDFLEET_GATEWAY_LISTEN": args.listen, "SANDFLEET_GATEWAY_DOMAIN": args.domain,
                "SANDFLEET_GATEWAY_API_KEYS": ",".join(keys) or None, "SANDFLEET_GATEWAY_TEMPLATES": args.templates,
                "SANDFLEET_GATEWAY_ISOLATION": args.isolation}
    env.update({k: v for k, v in settings.items() if v})
    # The service is a module above this package (floors: sandfleet never imports services): run it.
    os.execve(sys.executable, [sys.executable, "-m", "services.gateway"], env)
    return 0  # not reached


def wait_listening(listen: str | None, timeout_s: float = 30.0) -> bool:
    """For `up --detach --gateway`: whether the gateway listens at HOST:PORT within `timeout_s`
    (it starts after the services it needs, so "healthy" comes a moment before it)."""
    if not listen:
        return True
    host, _, port = listen.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False

"""What bus authentication costs: create → exec `true` → destroy cycles on a platform with auth on
(the default: nkey users, per-subject permissions, and the cycles run by a tenant, whose every
request crosses a shared service import and is checked against the sandbox's tenant) beside one
started with `--no-auth` (SANDFLEET_AUTH=off).

    .venv/bin/python -m loadtest.auth_cost [--n 200] [--concurrency 8] [--rounds 3] [--as tenant|admin]

Both platforms run at once on this machine (each its own node id, data dir and share of the
egress subnet), so both see the same load; rounds alternate between them and cycles/s is the
median over rounds, with the median of each round's on/off ratio beside it (the two sides run
back to back, so they share the moment's load) and CPU per cycle of every process of each
platform, which moves far less than the rate with other people's work.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

from loadtest.container_rate import platform_ticks
from loadtest.create_rate import platform_round
from loadtest.platform import CLI, running_platform
from loadtest.report import alternating_rounds, print_rounds, write_json
from sandfleet.credentials import CREDS_ENV

SIDES = ("on", "off")


def _tenant_creds(data_dir: Path) -> Path:
    out = data_dir / "bench-tenant.creds"
    subprocess.run([*CLI, "tenant", "add", "bench", "--data-dir", str(data_dir), "--out", str(out)],
                   check=True, capture_output=True)
    return out


def _round(url: str, n: int, concurrency: int, creds: Path | None) -> tuple[float, dict[str, list[float]]]:
    """One round, signed in with `creds` (None: whatever the SDK finds: the local operator's, or none)."""
    if creds is not None:
        os.environ[CREDS_ENV] = str(creds)
    try:
        return asyncio.run(platform_round(url, n, concurrency))
    finally:
        os.environ.pop(CREDS_ENV, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=200, help="cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--as", dest="role", choices=["tenant", "admin"], default="tenant",
                    help="who runs the cycles on the `on` side (tenant: the full cost, imports and ownership checks)")
    ap.add_argument("--node-id", default="bench-auth")
    ap.add_argument("--out", type=Path, default=Path("results/auth_cost.json"))
    args = ap.parse_args()

    # Pressure admission off: on a loaded machine it would refuse creates, and this measures the create path.
    common = {"SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0"}
    envs = {"on": {**common, "SANDFLEET_AUTH": "on", "SANDFLEET_EGRESS_SUBNET": "10.219.0.0/17"},
            "off": {**common, "SANDFLEET_AUTH": "off", "SANDFLEET_EGRESS_SUBNET": "10.219.128.0/17"}}
    with running_platform(f"{args.node_id}-on", envs["on"]) as (url_on, data_on), \
            running_platform(f"{args.node_id}-off", envs["off"]) as (url_off, data_off):
        urls, data = {"on": url_on, "off": url_off}, {"on": data_on, "off": data_off}
        creds = {"on": _tenant_creds(data_on) if args.role == "tenant" else None, "off": None}
        measured = alternating_rounds(SIDES, args.rounds, args.n,
                                      lambda side, n: _round(urls[side], n, args.concurrency, creds[side]),
                                      label="auth", cpu_ticks=lambda side: platform_ticks(data[side]))
    results = measured.results()
    print_rounds(results, SIDES, "auth", f"create → exec true → destroy as {args.role}, n={args.n} x {args.rounds} "
                 f"rounds, concurrency {args.concurrency} (ms)", target=0.95)
    out = write_json(args.out, "auth_cost", vars(args) | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

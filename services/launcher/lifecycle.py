"""The launcher's sandboxes on this node: launch, destroy, quarantine, drop, expiry.

A launch asks the node agent for the confinement and the layer-cache for the root at once
(both or neither: a failure of one gives the other back), then has the level's driver start
it; destroy and a failed launch give both back. The live table is memory only (state.py);
recovery.py rebuilds it after a restart. The launch path is hot (hundreds of sandboxes a
second): it makes no bus round trip beyond confine, compose and its record writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from sandfleet import errors, metrics, telemetry
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas.errors import ErrorCode
from schemas.layers import Rootfs
from schemas.node import Confinement, LaunchItem, LaunchResult
from schemas.sandbox import Reason, SandboxRecord, SandboxSpec, State
from services.launcher import decisions, desktop, records
from services.launcher.clients import LayerCache, NodeAgent
from services.launcher.drivers import Drivers
from services.launcher.drivers.base import Anchor, LaunchRefused, StartFailed
from services.launcher.keys import LOGGER, about
from services.launcher.settings import LauncherSettings
from services.launcher.starting import StartingMarks, placed_record
from services.launcher.state import Intake, Live

log = logging.getLogger(LOGGER)

# What a failed launch logs as a warning, not with a traceback.
_EXPECTED = (errors.SandfleetError, LaunchRefused, StartFailed, OSError, ValueError)


@dataclass
class Launcher:
    store: SandboxStore
    node_id: str
    drivers: Drivers
    agent: NodeAgent
    layers: LayerCache
    settings: LauncherSettings = field(default_factory=LauncherSettings)
    default_layers: tuple[str, ...] = ()  # `sandfleet up --default-layers`: the root of a sandbox naming none
    live: dict[str, Live] = field(default_factory=dict)
    intake: Intake = field(default_factory=Intake)
    building: int = 0  # launches past their slot, not yet live or failed
    launching: set[str] = field(default_factory=set)  # ids queued or being built
    closing: bool = False  # destroy_all has begun: queued launches end instead of being built
    slots: asyncio.Semaphore = field(init=False)  # launch_concurrency builds at once
    # What capabilities hold of a sandbox (its tunnels...) and end before its processes do.

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.settings.launch_concurrency)

    @property
    def isolation(self) -> list[str]:
        """The levels this node advertises in its registration."""
        return self.drivers.levels

    def get_live(self, sandbox_id: str) -> Live:
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no running sandbox {sandbox_id} on node {self.node_id}")
        return live

    # -- launch ------------------------------------------------------------------------

    async def launch(self, item: LaunchItem, marks: StartingMarks) -> LaunchResult:
        """Build one sandbox of a launch request (`_launch`), in a span of its own and timed."""
        started = time.monotonic()
        with telemetry.phase("launcher.launch", telemetry.sandbox_attributes(item.id, self.node_id, item.spec)):
            result = await self._launch(item, marks)
        metrics.LAUNCHES.observe(time.monotonic() - started, isolation=item.spec.isolation,
                                 outcome="ok" if result.ok else "failed")
        return result

    async def _launch(self, item: LaunchItem, marks: StartingMarks) -> LaunchResult:
        """Build one sandbox of a launch request. `marks` writes `starting` for those still queued
        or building after the grace (so placement never fails them as unlaunched); they are
        built a few at a time: a batch of thousands at once would send the agent and the
        layer-cache thousands of requests together, and the last would wait past their timeouts."""
        if item.id in self.live or item.id in self.launching:  # a launch request sent twice
            await marks.settle(item.id)
            return LaunchResult(id=item.id, ok=False, error=f"sandbox {item.id} is already launched here",
                                code=ErrorCode.CONFLICT)
        if placed_record(item) is None:  # not sent by placement with its record: claim it before building
            refused = await marks.claim(item.id)
            if refused is not None:
                return LaunchResult(id=item.id, ok=False, error=refused.message, code=refused.code)
        if item.spec.build:  # rare: the record is read when placement did not send it
            tenant = item.record.tenant if item.record is not None else (await self.store.get(item.id))[0].tenant
            refused = decisions.build_refusal(item.spec, tenant)
            if refused is not None:
                log.warning("launch of %s refused: %s", item.id, refused.message, extra=about(item.id))
                return await self._refuse(item, marks, Reason.LAUNCH_FAILED, refused.message, refused.message,
                                          refused.code)
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
        await records.ended(self.store, item.id, State.FAILED, reason, detail)
        return LaunchResult(id=item.id, ok=False, error=error, code=code)

    async def build(self, sandbox_id: str, spec: SandboxSpec) -> Live:
        """Confine, compose and start one sandbox, nothing recorded and not yet live: a launch's,
        or a warm pool's spare (pool.py). A failure gives back whatever of it was made."""
        try:
            driver = self.drivers.driver(spec.isolation)
            # Both or neither: a failure of one must not leave the other half made.
            confined, composed = await asyncio.gather(
                self.agent.confine(sandbox_id, spec), self._compose(sandbox_id, spec), return_exceptions=True
            )
            for result in (confined, composed):
                if isinstance(result, BaseException):
                    raise result
            confinement: Confinement = confined  # type: ignore[assignment]
            rootfs: Rootfs | None = composed  # type: ignore[assignment]
            with telemetry.phase("launcher.spawn", telemetry.sandbox_attributes(sandbox_id, self.node_id)):
                instance = await driver.start(sandbox_id, spec, confinement, rootfs)
        except Exception:  # whatever failed, nothing of the sandbox may stay behind
            await self._release(sandbox_id, spec)
            raise
        return Live(id=sandbox_id, spec=spec, driver=driver, instance=instance, deadline=time.time() + spec.timeout_s,
                    rootfs=rootfs)

    async def discard(self, live: Live) -> None:
        """Stop and give back a sandbox that was built and never made live (a pool's spare)."""
        live.unwatch()
        await live.driver.stop(live.id, live.instance.anchor)
        await self._release(live.id, live.spec)

    async def _start(self, item: LaunchItem, marks: StartingMarks) -> LaunchResult:
        spec = item.spec
        try:
            live = await self.build(item.id, spec)
        except Exception as exc:
            detail = str(exc) or type(exc).__name__
            if isinstance(exc, _EXPECTED):
                log.warning("launch of %s failed: %s", item.id, detail, extra=about(item.id))
            else:
                log.exception("launch of %s failed", item.id, extra=about(item.id))
            await marks.settle(item.id)
            await records.ended(self.store, item.id, State.FAILED, Reason.LAUNCH_FAILED, detail)
            return LaunchResult(id=item.id, ok=False, error=detail, code=_failure_code(exc))
        now = time.time()
        live.deadline = now + spec.timeout_s
        instance = live.instance
        self.adopt(live)
        try:
            refused = await marks.settle(item.id)
            if refused is not None:  # it ended while being built (placement gave up on it)
                raise refused
            await records.running(self.store, item.id, instance.anchor, now, live.deadline, known=placed_record(item))
        except ServiceError as exc:  # destroyed while starting
            await self.destroy(item.id, Reason.REQUESTED)
            return LaunchResult(id=item.id, ok=False, error=exc.message)
        if spec.desktop is not None:
            await self._start_display(item.id)
        return LaunchResult(id=item.id, ok=True)

    async def _start_display(self, sandbox_id: str) -> None:
        """A desktop's display is up when its create returns, so its programs find it; one that
        cannot start (layers without Xvfb) is said again, typed, by the first screen request."""
        try:
            await desktop.ensure(self, sandbox_id)
        except ServiceError as exc:
            log.warning("the display of %s did not start: %s", sandbox_id, exc.message, extra=about(sandbox_id))

    async def _compose(self, sandbox_id: str, spec: SandboxSpec) -> Rootfs | None:
        if spec.host_view:
            return None  # the host's system directories, read-only (process only)
        layers = list(spec.layers or self.default_layers)
        if not layers:
            raise LaunchRefused("no layers given and no default layers; pass layers=[...] or host_view=True")
        return await self.layers.compose(sandbox_id, layers, spec.disk_mb)

    def adopt(self, live: Live) -> None:
        """Into the live table, watched: an instance ending on its own is destroyed."""
        self.live[live.id] = live
        live.unwatch = live.driver.watch(live.instance, lambda: self._ended_on_its_own(live))

    def _ended_on_its_own(self, live: Live) -> None:
        if not live.ending and self.live.get(live.id) is live:
            log.warning("sandbox %s: init exited on its own", live.id, extra=about(live.id))
            detail = live.driver.why_ended(live.instance)
            asyncio.get_running_loop().create_task(self.destroy(live.id, Reason.PROCESS_EXITED, detail))

    # -- giving back ---------------------------------------------------------------------

    async def _release(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Give back the confinement and the composed root; the sandbox's processes are gone."""
        await asyncio.gather(self.release_confinement(sandbox_id),
                             *([] if spec.host_view else [self.release_rootfs(sandbox_id)]))

    async def release_confinement(self, sandbox_id: str) -> None:
        try:
            await self.agent.release(sandbox_id)
        except errors.SandfleetError as exc:
            # The agent removes what no live sandbox owns when it starts again.
            log.warning("release of %s failed (%s); the node agent reclaims it on restart", sandbox_id, exc,
                        extra=about(sandbox_id))

    async def release_rootfs(self, sandbox_id: str) -> None:
        try:
            await self.layers.release(sandbox_id)
        except errors.SandfleetError as exc:
            # A restarted launcher releases every root of this node that no live sandbox owns.
            log.warning("rootfs release of %s failed (%s); the next launcher start releases it", sandbox_id, exc,
                        extra=about(sandbox_id))

    async def finish(self, record: SandboxRecord, anchor: Anchor | None, ending: decisions.Ending) -> None:
        """End a sandbox that is not live here from its record: stop what is left of it, give back
        its confinement and root, and write how it ended (recovery)."""
        await self.drivers.stop(record.spec.isolation, record.id, anchor)
        await self._release(record.id, record.spec)
        await records.ended(self.store, record.id, ending.state, ending.reason, ending.detail)

    # -- destroy -----------------------------------------------------------------------

    async def _end_attachments(self, sandbox_id: str, live: Live | None) -> None:
        """What the sandbox's capabilities hold (`Live.attached`: transfers, watches, tunnels), ended
        before its processes go. One attached while these end is ended too."""
        while live is not None and live.attached:
            try:
                await live.attached.popitem()[1].end()
            except Exception:  # never let one capability's failure keep a sandbox alive
                log.exception("ending what %s held failed", sandbox_id, extra=about(sandbox_id))

    async def destroy(self, sandbox_id: str, reason: Reason, detail: str = "") -> SandboxRecord:
        live = self.live.get(sandbox_id)
        if live is None:
            record, _ = await self.store.get(sandbox_id)
            if decisions.already_destroyed(record, reason, self.node_id):
                return record
            refused = decisions.destroy_refusal(sandbox_id, record, self.node_id)
            if refused is not None:
                raise refused
        elif live.ending:
            raise ServiceError(ErrorCode.CONFLICT, f"sandbox {sandbox_id} is already being destroyed")
        else:
            live.ending = True
        await records.stopping(self.store, sandbox_id, reason, detail)
        await self._end_attachments(sandbox_id, live)
        if live is not None:
            live.unwatch()
            await live.driver.stop(sandbox_id, live.instance.anchor)
            spec = live.spec
        else:  # a crash left it stopping (or running): its init is gone or orphaned
            spec = record.spec
            await self.drivers.stop(spec.isolation, sandbox_id, records.anchor_of(record))
        await self._release(sandbox_id, spec)
        self.live.pop(sandbox_id, None)
        return await records.ended(self.store, sandbox_id, decisions.destroyed_state(reason), reason, detail)

    async def quarantine(self, sandbox_id: str, detail: str) -> SandboxRecord:
        """Freeze every process of the sandbox (a kill still reaches frozen tasks, so destroy
        works later) and keep it `paused` with reason `violation`; idempotent."""
        live = self.get_live(sandbox_id)
        if not live.quarantined:
            await live.driver.freeze(live.instance)
            live.quarantined = True
            for running in list(live.execs):  # frozen mid-command: their callers get an answer now
                running.cancel()
        return await records.quarantined(self.store, sandbox_id, detail)

    async def drop(self, sandbox_id: str, why: str) -> bool:
        """Tear down, on this node only, a sandbox whose record someone else ended (placement
        failed it while this node was cut off) or that has no record any more: processes,
        confinement and root go, the record stays as it is. False if it is already going."""
        live = self.live.get(sandbox_id)
        if live is None or live.ending:
            return False
        live.ending = True
        log.warning("sandbox %s: %s; tearing it down", sandbox_id, why, extra=about(sandbox_id))
        try:
            await self._end_attachments(sandbox_id, live)
            live.unwatch()
            await live.driver.stop(sandbox_id, live.instance.anchor)
            await self._release(sandbox_id, live.spec)
        finally:  # what could not be undone here, the agent and layer-cache reclaim when they restart
            self.live.pop(sandbox_id, None)
        return True

    async def destroy_all(self, reason: Reason) -> None:
        """Destroy every sandbox, a few at a time; launches still queued end `failed`, and those
        being built are destroyed once they are live."""
        self.closing = True
        slots = asyncio.Semaphore(self.settings.launch_concurrency)

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

    async def _destroy_quietly(self, sandbox_id: str, reason: Reason) -> None:
        try:
            await self.destroy(sandbox_id, reason)
        except errors.SandfleetError as exc:
            log.warning("destroy of %s failed: %s", sandbox_id, exc, extra=about(sandbox_id))
        except ServiceError as exc:
            log.warning("destroy of %s failed: %s", sandbox_id, exc.message, extra=about(sandbox_id))

    async def expire_loop(self, period_s: float = 0.5) -> None:
        while True:
            now = time.time()
            for live in [l for l in self.live.values() if l.deadline <= now and not l.ending]:
                asyncio.create_task(self._destroy_quietly(live.id, Reason.EXPIRED))
            await asyncio.sleep(period_s)


def _failure_code(exc: Exception) -> ErrorCode:
    """The caller's error kind: a refused spec or a missing layer is theirs, the rest is ours."""
    if isinstance(exc, LaunchRefused):
        return ErrorCode.INVALID_REQUEST
    if isinstance(exc, errors.ServiceFailure):
        return exc.code
    return ErrorCode.INTERNAL

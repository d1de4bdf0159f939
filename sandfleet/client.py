"""The asyncio SDK: `connect()` → `Fleet` → `Sandbox`.

Creation goes to placement (`sandbox.v1.*`); everything done to a sandbox afterwards goes
straight to the node that holds it (`node.v1.<node>.*`), the node named in the create reply.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.api
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from sandfleet import errors, telemetry
from sandfleet.allow_rules import parse_allow
from sandfleet.bus import Bus, decode
from sandfleet.config import nats_url
from schemas import events, node, sandbox, security, violations
from schemas.events import AnySandboxEvent
from schemas.sandbox import Isolation, SandboxRecord
from schemas.security import Policy, SandboxSecurity, SecurityAction
from schemas.violations import Violation

QUIET_S = 30.0  # a gang batch with no event for this long has its records read instead
SERVICES = ("placement", "agent", "layer-cache", "launcher", "security-monitor")


@dataclass(frozen=True)
class BatchProgress:
    """Where a gang batch stands: `placed` sandboxes, of which `running` started and `failed` did not."""

    total: int
    placed: int
    running: int
    failed: int

    @property
    def done(self) -> bool:
        return self.running + self.failed >= self.placed


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float = 0.0


class Sandbox:
    """A handle on one sandbox; cheap to make, holds no resources of its own."""

    def __init__(self, fleet: Fleet, sandbox_id: str, node_id: str) -> None:
        self._fleet = fleet
        self.id = sandbox_id
        self.node = node_id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, node={self.node!r})"

    def _subject(self, verb: str) -> str:
        return node.subject(self.node, verb)

    async def exec(
        self,
        argv: list[str],
        *,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str = "/workspace",
        stdin: bytes = b"",
    ) -> ExecResult:
        req = node.ExecRequest(sandbox_id=self.id, argv=argv, env=env or {}, cwd=cwd, stdin=stdin, timeout_s=timeout_s)
        r = await self._fleet.bus.request(self._subject(node.EXEC), req, node.ExecReply, timeout=timeout_s + 10)
        return ExecResult(r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated, r.duration_ms)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        req = node.WriteFileRequest(sandbox_id=self.id, path=path, data=data, mode=mode)
        return (await self._fleet.bus.request(self._subject(node.WRITE_FILE), req, node.WriteFileReply, timeout=30)).size

    async def read_file(self, path: str) -> bytes:
        req = node.ReadFileRequest(sandbox_id=self.id, path=path)
        return (await self._fleet.bus.request(self._subject(node.READ_FILE), req, node.ReadFileReply, timeout=30)).data

    async def destroy(self) -> SandboxRecord:
        req = node.DestroyRequest(sandbox_id=self.id)
        return (await self._fleet.bus.request(self._subject(node.DESTROY), req, node.DestroyReply, timeout=60)).record

    async def info(self) -> SandboxRecord:
        return await self._fleet.get(self.id)

    async def pause(self) -> SandboxRecord:
        """Freeze every process (cgroup.freeze); the sandbox is `paused` until `resume()`."""
        req = node.PauseRequest(sandbox_id=self.id)
        return (await self._fleet.bus.request(self._subject(node.PAUSE), req, node.PauseReply, timeout=30)).record

    async def resume(self) -> SandboxRecord:
        """Thaw a paused sandbox; a quarantined one raises `Conflict`."""
        req = node.ResumeRequest(sandbox_id=self.id)
        return (await self._fleet.bus.request(self._subject(node.RESUME), req, node.ResumeReply, timeout=30)).record

    async def hint(self, hint: str) -> node.HintReply:
        """`idle` lowers the sandbox's CPU weight to the minimum, `active` restores the default."""
        req = _convert(dict(sandbox_id=self.id, hint=hint), node.HintRequest)
        return await self._fleet.bus.request(self._subject(node.HINT), req, node.HintReply, timeout=30)

    async def checkpoint(self, name: str | None = None, *, keep_paused: bool = False,
                         timeout_s: float = 600.0) -> node.Checkpoint:
        """Pack the sandbox's files (its writable layer, /workspace included) into layer `name`
        over its layers; pass the result to `Fleet.restore`. Processes are not captured."""
        name = name or f"ckpt-{self.id[:40]}-{secrets.token_hex(4)}"
        req = _convert(dict(sandbox_id=self.id, name=name, keep_paused=keep_paused), node.CheckpointRequest)
        return await self._fleet.bus.request(self._subject(node.CHECKPOINT), req, node.Checkpoint,
                                             timeout=timeout_s + 10)


@dataclass(frozen=True)
class RolloutChange:
    """What `Fleet.pause` / `Fleet.resume` did on every node: `matched` sandboxes with the label,
    `changed` by this call, `unchanged` (already so, or quarantined on a resume), `failed`."""

    matched: int
    changed: int
    unchanged: int
    failed: int
    nodes: list[node.SelectedReply]
    errors: list[str]


class Fleet:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(
        self,
        *,
        isolation: Isolation = "process",
        cpu: float = 1.0,
        memory_mb: int = 512,
        pids: int = 512,
        timeout_s: int = 600,
        labels: dict[str, str] | None = None,
        layers: list[str] | None = None,
        allow: list[str] | None = None,
        disk_mb: int = 1024,
        host_view: bool = False,
        request_timeout_s: float = 60.0,
    ) -> Sandbox:
        spec = _spec(isolation, cpu, memory_mb, pids, timeout_s, labels, layers, allow, disk_mb, host_view)
        with telemetry.tracer("sandfleet.sdk").start_as_current_span("sandbox.create", kind=SpanKind.INTERNAL):
            reply = await self.bus.request(sandbox.CREATE, spec, sandbox.CreateReply, timeout=request_timeout_s)
        return Sandbox(self, reply.id, reply.node)

    async def create_many(
        self,
        count: int,
        *,
        request_timeout_s: float | None = None,
        progress: Callable[[BatchProgress], object] | None = None,
        **spec: Any,
    ) -> list[Sandbox]:
        """Create `count` sandboxes with one request (a gang batch, up to 32,000): placement answers
        once all are placed, the nodes launch them in parallel, and `progress` is called as their
        `started`/`failed` events arrive. Returns when every one has started or failed.

        Raises `ServiceFailure` if any sandbox failed to start (the others are returned on the error
        as `.created`, so the caller can use or destroy them); `Capacity` if the batch cannot be
        placed whole (nothing was created), with a message starting `quota:` if a quota refused it.
        """
        req = sandbox.CreateManyRequest(count=count, spec=_spec(**spec), wait=False)
        timeout = request_timeout_s or 60 + 0.05 * count
        outcome: dict[str, events.SandboxEvent] = {}
        where: dict[str, str] = {}  # id → node, once placement has answered
        tally = {sandbox.State.RUNNING: 0, sandbox.State.FAILED: 0}
        arrived = asyncio.Event()

        def settled(event: events.SandboxEvent) -> None:
            if event.sandbox_id not in outcome:
                outcome[event.sandbox_id] = event
                if event.sandbox_id in where:
                    tally[event.state] += 1
                arrived.set()

        async def on_event(msg: Msg) -> None:
            event = decode(msg.data, AnySandboxEvent)
            if event.state in tally:
                settled(event)

        # Subscribed before asking, so no event of the batch can pass unseen.
        subs = [
            await self.bus.nc.subscribe(events.sandbox_subject("*", name), cb=on_event,
                                        pending_msgs_limit=4 * count + 1024, pending_bytes_limit=-1)
            for name in ("started", "failed")
        ]
        try:
            reply = await self.bus.request(sandbox.CREATE_MANY, req, sandbox.CreateManyReply, timeout=timeout)
            where.update((i, p.node) for p in reply.placements for i in p.ids)
            for i in where:
                if i in outcome:
                    tally[outcome[i].state] += 1
            for i in [i for i in outcome if i not in where]:
                del outcome[i]  # another batch's
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                state = BatchProgress(total=count, placed=len(where), running=tally[sandbox.State.RUNNING],
                                      failed=tally[sandbox.State.FAILED])
                if progress is not None:
                    progress(state)
                if state.done:
                    break
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    await self._settle(where, outcome, settled)  # an event may have been missed: ask the records
                    break
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), min(left, QUIET_S))
                except asyncio.TimeoutError:  # long silence: an event may have been missed
                    await self._settle(where, outcome, settled)
        finally:
            for sub in subs:
                await sub.unsubscribe()
        created = [Sandbox(self, i, n) for i, n in where.items() if i in outcome and outcome[i].state is sandbox.State.RUNNING]
        if len(created) < count:
            failed = [f"{i}: {outcome[i].detail if i in outcome else 'no outcome in time'}"
                      for i in where if i not in outcome or outcome[i].state is not sandbox.State.RUNNING]
            failure = errors.InternalError(f"{len(failed)} of {count} sandboxes failed: {failed[:3]}")
            failure.created = created  # type: ignore[attr-defined]
            raise failure
        return created

    async def _settle(self, where: dict[str, str], outcome: dict[str, events.SandboxEvent],
                      settled: Callable[[events.SandboxEvent], None]) -> None:
        """Read the records of the sandboxes with no outcome yet (their events were missed)."""
        pending = [i for i in where if i not in outcome]
        for start in range(0, len(pending), 256):
            found = await asyncio.gather(*(self.get(i) for i in pending[start : start + 256]), return_exceptions=True)
            for record in found:
                if isinstance(record, SandboxRecord):
                    self._settled(record, settled)

    @staticmethod
    def _settled(record: SandboxRecord, settled: Callable[[events.SandboxEvent], None]) -> None:
        if record.state is sandbox.State.RUNNING or record.state in sandbox.ENDED:
            kind = events.Started if record.state is sandbox.State.RUNNING else events.Failed
            state = sandbox.State.RUNNING if record.state is sandbox.State.RUNNING else sandbox.State.FAILED
            settled(kind(sandbox_id=record.id, node=record.node, state=state, seq=record.seq,
                         at=record.updated_at, reason=record.reason, detail=record.detail))

    async def set_quota(
        self, *, task: str | None = None, tenant: str | None = None, max_concurrent: int = 0,
        max_creates_per_s: float = 0.0,
    ) -> sandbox.QuotaState:
        """Limit the sandboxes labelled task=`task` (or tenant=`tenant`); 0 is no limit. A create past
        a limit raises `Capacity` with a message starting `quota:`."""
        scope, name = ("task", task) if task is not None else ("tenant", tenant)
        raw = dict(scope=scope, name=name, max_concurrent=max_concurrent, max_creates_per_s=max_creates_per_s)
        return await self.bus.request(sandbox.QUOTA_SET, raw, sandbox.QuotaState)

    async def quota(self, *, task: str | None = None, tenant: str | None = None) -> sandbox.QuotaState:
        scope, name = ("task", task) if task is not None else ("tenant", tenant)
        return await self.bus.request(sandbox.QUOTA_GET, dict(scope=scope, name=name), sandbox.QuotaState)

    async def get(self, sandbox_id: str) -> SandboxRecord:
        return await self.bus.request(sandbox.GET, sandbox.GetRequest(id=sandbox_id), SandboxRecord)

    async def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle for an existing sandbox (raises NotFound if there is none)."""
        record = await self.get(sandbox_id)
        return Sandbox(self, record.id, record.node)

    async def list(self, *, include_ended: bool = False) -> list[SandboxRecord]:
        req = sandbox.ListRequest(include_ended=include_ended)
        return (await self.bus.request(sandbox.LIST, req, sandbox.SandboxList, timeout=30)).sandboxes

    async def events(self, sandbox_id: str | None = None, *, replay: bool = False) -> AsyncIterator[AnySandboxEvent]:
        """Lifecycle events as they happen (`replay=True`: from the start of the stream first)."""
        subject = events.sandbox_filter(sandbox_id) if sandbox_id else events.ALL_SANDBOX
        policy = nats.js.api.DeliverPolicy.ALL if replay else nats.js.api.DeliverPolicy.NEW
        sub = await self.bus.js.subscribe(subject, ordered_consumer=True, deliver_policy=policy)
        try:
            async for msg in sub.messages:
                yield decode(msg.data, AnySandboxEvent)
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def violations(
        self, sandbox_id: str | None = None, *, task: str | None = None, replay: bool = False, actions: bool = False
    ) -> AsyncIterator[Violation | SecurityAction]:
        """What sandboxes tried and were refused, as it happens (of one sandbox, or one task label);
        with `actions=True` also what the security monitor did about it (kill, quarantine), in order."""
        subject = violations.sandbox_filter(sandbox_id) if sandbox_id else violations.ALL
        subjects = [subject]
        if actions:
            subjects.append(security.actions_filter(sandbox_id) if sandbox_id else security.ALL_ACTIONS)
        policy = nats.js.api.DeliverPolicy.ALL if replay else nats.js.api.DeliverPolicy.NEW
        config = nats.js.api.ConsumerConfig(filter_subjects=subjects) if actions else None
        sub = await self.bus.js.subscribe(
            subject, stream=events.STREAM, ordered_consumer=True, deliver_policy=policy, config=config
        )
        try:
            async for msg in sub.messages:
                event = decode(msg.data, Violation | SecurityAction)
                event_task = event.task if isinstance(event, SecurityAction) else event.labels.get("task")
                if task is None or event_task == task:
                    yield event
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def history(self, sandbox_id: str | None = None, *, idle_s: float = 1.0) -> list[AnySandboxEvent]:
        """Every stored lifecycle event (of one sandbox, or all), oldest first."""
        subject = events.sandbox_filter(sandbox_id) if sandbox_id else events.ALL_SANDBOX
        sub = await self.bus.js.subscribe(
            subject, ordered_consumer=True, deliver_policy=nats.js.api.DeliverPolicy.ALL
        )
        found: list[AnySandboxEvent] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_s)
                except nats.errors.TimeoutError:
                    break
                found.append(decode(msg.data, AnySandboxEvent))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return found

    async def set_policy(
        self, *, task: str, action: str = "record", thresholds: dict[str, int] | None = None, default_threshold: int = 1
    ) -> Policy:
        """What the security monitor does to a sandbox labelled task=`task` that makes violations:
        `record`, `kill` or `quarantine` once a kind prefix reaches its threshold (`{"network": 3}`)."""
        raw = dict(task=task, action=action, thresholds=thresholds or {}, default_threshold=default_threshold)
        return await self.bus.request(security.POLICY_SET, raw, Policy)  # the monitor validates it

    async def get_policy(self, task: str) -> Policy:
        return await self.bus.request(security.POLICY_GET, dict(task=task), Policy)

    async def policies(self) -> list[Policy]:
        return (await self.bus.request(security.POLICY_LIST, {}, security.PolicyList)).policies

    async def security_record(self, sandbox_id: str) -> SandboxSecurity:
        """The monitor's counts for one sandbox and the action taken: a trainer zeroes the reward
        of a trajectory whose sandbox has any (`total > 0`)."""
        return await self.bus.request(security.SANDBOX_GET, dict(sandbox_id=sandbox_id), SandboxSecurity)

    async def pause(self, *, task: str) -> RolloutChange:
        """Pause every live sandbox labelled `task=<task>` on every node (the trainer's GPUs are preempted)."""
        return await self._rollout(node.PAUSE_SELECTED, {"task": task})

    async def resume(self, *, task: str) -> RolloutChange:
        """Resume the sandboxes `pause(task=...)` paused; quarantined ones stay frozen."""
        return await self._rollout(node.RESUME_SELECTED, {"task": task})

    async def _rollout(self, verb: str, labels: dict[str, str]) -> RolloutChange:
        req = _convert(dict(labels=labels), node.SelectedRequest)
        nodes = [n.id for n in await self.nodes() if not n.simulated]
        replies = await asyncio.gather(
            *(self.bus.request(node.subject(n, verb), req, node.SelectedReply, timeout=60) for n in nodes),
            return_exceptions=True)
        answered = [r for r in replies if isinstance(r, node.SelectedReply)]
        problems = [f"{n}: {r}" for n, r in zip(nodes, replies) if isinstance(r, BaseException)]
        return RolloutChange(
            matched=sum(r.matched for r in answered), changed=sum(r.changed for r in answered),
            unchanged=sum(r.unchanged for r in answered), failed=sum(r.failed for r in answered),
            nodes=answered, errors=problems + [e for r in answered for e in r.errors])

    async def restore(self, checkpoint: node.Checkpoint, node: str | None = None, *,
                      request_timeout_s: float = 120.0) -> Sandbox:
        """Start a new sandbox from a checkpoint: its spec, with layers base + the checkpoint layer.
        Placement picks the node (preferring one that caches the layers); `node` pins it where
        placement supports pinning, which it does not yet: a given `node` raises Unsupported."""
        if node is not None:
            raise errors.Unsupported("placement cannot pin a sandbox to a node yet; restore with node=None")
        spec = msgspec.structs.replace(checkpoint.spec, layers=[*checkpoint.base, checkpoint.digest], host_view=False)
        reply = await self.bus.request(sandbox.CREATE, msgspec.convert(msgspec.to_builtins(spec), sandbox.CreateRequest),
                                       sandbox.CreateReply, timeout=request_timeout_s)
        return Sandbox(self, reply.id, reply.node)

    async def nodes(self) -> list[node.NodeInfo]:
        kv = await self.bus.js.key_value(node.KV_BUCKET)
        try:
            keys = await kv.keys()
        except Exception:  # nats raises NoKeysError on an empty bucket
            return []
        found = []
        for key in keys:
            entry = await kv.get(key)
            if entry.value:
                found.append(decode(entry.value, node.NodeInfo))
        return found

    async def security(self, node_id: str) -> node.NodeSecurity:
        """What the node agent of `node_id` enforces (eBPF egress, Landlock, AppArmor ...)."""
        return await self.bus.request(node.subject(node_id, node.SECURITY), node.Empty(), node.NodeSecurity)

    async def ping(self, service: str, timeout: float = 1.0) -> bool:
        try:
            await self.bus.nc.request(f"$SRV.PING.{service}", b"", timeout=timeout)
            return True
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return False


def _spec(
    isolation: Isolation = "process",
    cpu: float = 1.0,
    memory_mb: int = 512,
    pids: int = 512,
    timeout_s: int = 600,
    labels: dict[str, str] | None = None,
    layers: list[str] | None = None,
    allow: list[str] | None = None,
    disk_mb: int = 1024,
    host_view: bool = False,
) -> sandbox.CreateRequest:
    # Build through JSON so a bad value raises InvalidRequest here, as the service would.
    import msgspec

    raw = dict(
        isolation=isolation, cpu=cpu, memory_mb=memory_mb, pids=pids, timeout_s=timeout_s,
        labels=labels or {}, layers=layers or [], allow=allow or [], disk_mb=disk_mb, host_view=host_view,
    )
    try:
        spec = msgspec.convert(raw, sandbox.CreateRequest)
        parse_allow(spec.allow)  # a bad rule fails here, before anything is sent
    except (msgspec.ValidationError, ValueError) as exc:
        raise errors.InvalidRequest(str(exc)) from None
    return spec


class _Connect:
    """`await connect(url)` or `async with connect(url) as fleet:`."""

    def __init__(self, url: str | None, name: str) -> None:
        self._url = nats_url(url)
        self._name = name
        self._fleet: Fleet | None = None

    async def _open(self) -> Fleet:
        self._fleet = Fleet(await Bus.connect(self._url, self._name))
        return self._fleet

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._open().__await__()

    async def __aenter__(self) -> Fleet:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        if self._fleet is not None:
            await self._fleet.close()


def connect(url: str | None = None, *, name: str = "sandfleet-sdk") -> _Connect:
    return _Connect(url, name)


def _convert(raw: dict[str, Any], kind: type[Any]) -> Any:
    """Check a request here, so bad input raises InvalidRequest before anything is sent."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise errors.InvalidRequest(str(exc)) from None

"""The asyncio SDK: `connect()` → `Fleet` → `Sandbox`.

Creation goes to placement (`sandbox.v1.*`); everything done to a sandbox afterwards goes
straight to the node that holds it (`node.v1.<node>.*`), the node named in the create reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.api
from opentelemetry.trace import SpanKind

from sandfleet import errors, telemetry
from sandfleet.bus import Bus, decode
from sandfleet.config import nats_url
from schemas import events, node, sandbox, violations
from schemas.events import AnySandboxEvent
from schemas.sandbox import Isolation, SandboxRecord
from schemas.violations import Violation

SERVICES = ("placement", "agent", "layer-cache", "launcher")


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
        request_timeout_s: float = 60.0,
    ) -> Sandbox:
        spec = _spec(isolation, cpu, memory_mb, pids, timeout_s, labels, layers, allow)
        with telemetry.tracer("sandfleet.sdk").start_as_current_span("sandbox.create", kind=SpanKind.INTERNAL):
            reply = await self.bus.request(sandbox.CREATE, spec, sandbox.CreateReply, timeout=request_timeout_s)
        return Sandbox(self, reply.id, reply.node)

    async def create_many(self, count: int, *, request_timeout_s: float | None = None, **spec: Any) -> list[Sandbox]:
        """Create `count` sandboxes with one request; all-or-nothing placement, per-sandbox launch results.

        Raises `ServiceFailure` if any sandbox failed to start (the others are returned on the error
        as `.created`, so the caller can use or destroy them).
        """
        req = sandbox.CreateManyRequest(count=count, spec=_spec(**spec))
        timeout = request_timeout_s or 60 + 0.05 * count
        reply = await self.bus.request(sandbox.CREATE_MANY, req, sandbox.CreateManyReply, timeout=timeout)
        created = [Sandbox(self, r.id, r.node) for r in reply.sandboxes]
        if reply.failed:
            failure = errors.InternalError(f"{reply.failed} of {count} sandboxes failed: {reply.errors[:3]}")
            failure.created = created  # type: ignore[attr-defined]
            raise failure
        return created

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
        self, sandbox_id: str | None = None, *, task: str | None = None, replay: bool = False
    ) -> AsyncIterator[Violation]:
        """What sandboxes tried and were refused, as it happens (of one sandbox, or one task label)."""
        subject = violations.sandbox_filter(sandbox_id) if sandbox_id else violations.ALL
        policy = nats.js.api.DeliverPolicy.ALL if replay else nats.js.api.DeliverPolicy.NEW
        sub = await self.bus.js.subscribe(subject, ordered_consumer=True, deliver_policy=policy)
        try:
            async for msg in sub.messages:
                event = decode(msg.data, Violation)
                if task is None or event.labels.get("task") == task:
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
) -> sandbox.CreateRequest:
    # Build through JSON so a bad value raises InvalidRequest here, as the service would.
    import msgspec

    raw = dict(
        isolation=isolation, cpu=cpu, memory_mb=memory_mb, pids=pids, timeout_s=timeout_s,
        labels=labels or {}, layers=layers or [], allow=allow or [],
    )
    try:
        return msgspec.convert(raw, sandbox.CreateRequest)
    except msgspec.ValidationError as exc:
        raise errors.InvalidRequest(str(exc)) from None


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

"""Quotas per task and per tenant label: how many sandboxes may live at once and be created per second.

Limits and usage live in KV `quotas` (`q.<scope>.<name>` the limit, `u.<scope>.<name>` the
usage, updated with a revision check so replicas never admit past a limit together). A
sandbox under a quota gets a member key `m.<node>.<id>` naming what it counts against, written
before its record; placement replicas share one durable consumer of `stopped`/`failed`
events that deletes the member key (revision-checked, so once) and gives the slot back; that
consumer outlives any error, since while it is down no slot comes back. The key is found from
the event's subject, whose node the server checked against its publisher: an end another node
forges about a sandbox that is not its own names a key that does not exist, and gives nothing
back. `m.<id>`, the key of a sandbox an older placement admitted, is still looked for while any
is left (checked at each start of the consumer: one read more per end only then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from sandfleet.bus import Bus, decode, encode
from sandfleet.jetstream import kv_stream, kv_subject
from sandfleet.errors import ServiceError
from schemas import events
from schemas.errors import ErrorCode
from schemas.sandbox import QUOTA_BUCKET, Quota, QuotaGetRequest, QuotaState, QuotaUsage, SandboxSpec

log = logging.getLogger("sandfleet.placement")

SCOPES = ("task", "tenant")
CONSUMER = "placement-quotas"
ATTEMPTS = 20


class QuotaExceeded(Exception):
    pass


def _key(kind: str, scope: str, name: str) -> str:
    # label values may hold characters a KV key may not; hex keeps every name distinct
    return f"{kind}.{scope}.{name.encode().hex() or '-'}"


def _member(sandbox_id: str, node: str) -> str:
    return f"m.{events.node_token(node)}.{sandbox_id}"


def admit(quota: Quota, usage: QuotaUsage, n: int, now: float) -> QuotaUsage:
    """The usage after admitting `n` more sandboxes, or QuotaExceeded saying which limit."""
    who = f"{quota.scope} {quota.name!r}"
    tokens = usage.tokens
    if quota.max_creates_per_s:
        burst = max(quota.max_creates_per_s, 1.0)
        tokens = min(burst, tokens + (now - usage.at) * quota.max_creates_per_s) if usage.at else burst
        if n > burst:
            raise QuotaExceeded(f"quota: {who} allows {quota.max_creates_per_s:g} creates/s; a batch of {n} never fits")
        if n > tokens + 1e-9:
            raise QuotaExceeded(f"quota: {who} allows {quota.max_creates_per_s:g} creates/s; retry in "
                                f"{(n - tokens) / quota.max_creates_per_s:.2f}s")
        tokens -= n
    if quota.max_concurrent and usage.active + n > quota.max_concurrent:
        raise QuotaExceeded(f"quota: {who} allows {quota.max_concurrent} concurrent sandboxes; "
                            f"{usage.active} live, {n} asked")
    return QuotaUsage(active=usage.active + n, tokens=tokens, at=now)


class Quotas:
    def __init__(self, bus: Bus, kv: KeyValue) -> None:
        self.bus = bus
        self.kv = kv
        self.limits: dict[str, Quota] = {}  # usage key → limit, kept by the watch
        self.older_members = False  # whether keys `m.<id>` of an older placement were left

    @classmethod
    async def open(cls, bus: Bus) -> Quotas:
        kv = await bus.js.create_key_value(
            KeyValueConfig(bucket=QUOTA_BUCKET, history=1, storage=StorageType.FILE, description="quotas and usage")
        )
        return cls(bus, kv)

    def applicable(self, spec: SandboxSpec) -> list[tuple[str, Quota]]:
        found = []
        for scope in SCOPES:
            name = spec.labels.get(scope)
            if name is not None and (quota := self.limits.get(_key("u", scope, name))) is not None:
                found.append((_key("u", scope, name), quota))
        return found

    async def admit(self, spec: SandboxSpec, n: int, now: float) -> list[str]:
        """Count `n` new sandboxes against every quota on their labels; returns the usage keys."""
        taken: list[str] = []
        try:
            for key, quota in self.applicable(spec):
                await self._change(key, lambda u, q=quota: admit(q, u, n, now))
                taken.append(key)
        except QuotaExceeded as exc:
            await self.give_back(taken, n)
            raise ServiceError(ErrorCode.CAPACITY, str(exc)) from None
        return taken

    async def give_back(self, keys: list[str], n: int) -> None:
        for key in keys:
            await self._change(key, lambda u: msgspec.structs.replace(u, active=max(0, u.active - n)))

    async def _change(self, key: str, change) -> QuotaUsage:  # type: ignore[no-untyped-def]
        for _ in range(ATTEMPTS):
            try:
                entry = await self.kv.get(key)
                usage, revision = decode(entry.value, QuotaUsage) if entry.value else QuotaUsage(), entry.revision
            except nats.js.errors.KeyNotFoundError:
                usage, revision = QuotaUsage(), 0
            updated = change(usage)
            try:
                if revision:
                    await self.kv.update(key, encode(updated), last=revision)
                else:
                    await self.kv.create(key, encode(updated))
                return updated
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
                continue
        raise ServiceError(ErrorCode.CONFLICT, "quota usage is being changed by others; retry")

    async def remember(self, members: list[tuple[str, str]], keys: list[str]) -> None:
        """Say, per sandbox (its id, its node), what it counts against, before its record exists."""
        if keys:
            value = encode(keys)
            await asyncio.gather(*(self.kv.put(_member(i, n), value) for i, n in members))

    async def forget_members(self, members: list[tuple[str, str]]) -> None:
        await asyncio.gather(*(self.kv.delete(_member(i, n)) for i, n in members), return_exceptions=True)

    # -- limits --------------------------------------------------------------------------

    async def set(self, quota: Quota) -> QuotaState:
        await self.kv.put(_key("q", quota.scope, quota.name), encode(quota))
        self.limits[_key("u", quota.scope, quota.name)] = quota
        return await self.get(QuotaGetRequest(scope=quota.scope, name=quota.name))

    async def get(self, req: QuotaGetRequest) -> QuotaState:
        try:
            entry = await self.kv.get(_key("q", req.scope, req.name))
            quota = decode(entry.value, Quota)
        except (nats.js.errors.KeyNotFoundError, msgspec.DecodeError):
            raise ServiceError(ErrorCode.NOT_FOUND, f"no quota for {req.scope} {req.name!r}") from None
        try:
            usage = decode((await self.kv.get(_key("u", req.scope, req.name))).value, QuotaUsage)
        except (nats.js.errors.KeyNotFoundError, msgspec.DecodeError):
            usage = QuotaUsage()
        return QuotaState(quota=quota, active=usage.active)

    async def watch_limits(self) -> None:
        while True:
            try:
                watcher = await self.kv.watch("q.>")
                async for entry in watcher:
                    if entry is None:
                        continue
                    key = "u." + entry.key[2:]
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self.limits.pop(key, None)
                    else:
                        self.limits[key] = decode(entry.value, Quota)
            except (nats.js.errors.Error, nats.errors.Error) as exc:
                log.warning("quota watch interrupted (%s); resuming", exc)
                await asyncio.sleep(0.5)

    # -- ends give slots back --------------------------------------------------------------

    async def release_ended(self) -> None:
        """One durable consumer shared by every replica: each end is given back once."""
        ends = [events.sandbox_subject("*", "stopped"), events.sandbox_subject("*", "failed")]
        config = ConsumerConfig(
            durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW,
            filter_subjects=ends, ack_wait=30, max_ack_pending=4096,
        )
        while True:
            try:
                try:  # made, or an older placement's moved to these subjects
                    await self.bus.js.add_consumer(events.STREAM, config)
                except nats.js.errors.BadRequestError:
                    pass  # exists already (another replica made it)
                older = await self.bus.js.stream_info(kv_stream(QUOTA_BUCKET),
                                                      subjects_filter=kv_subject(QUOTA_BUCKET, "m.*"))
                self.older_members = bool(older.state.subjects)
                psub = await self.bus.js.pull_subscribe_bind(CONSUMER, stream=events.STREAM)
                try:
                    while True:
                        try:
                            msgs = await psub.fetch(batch=256, timeout=1.0)
                        except asyncio.TimeoutError:  # nats-py raises its own subclass, or under load the plain one
                            continue
                        await asyncio.gather(*(self._ended(m) for m in msgs))
                finally:
                    # A fetch cancelled mid-wait leaves its subscription open, and the connection's
                    # drain at shutdown would then wait out nats-py's 30 s drain timeout.
                    with contextlib.suppress(nats.errors.Error):
                        await psub.unsubscribe()
            except (nats.js.errors.Error, nats.errors.Error) as exc:
                log.warning("quota release consumer interrupted (%s); resuming", exc)
                await asyncio.sleep(0.5)
            except Exception:  # a dead consumer would keep every later slot for ever, silently
                log.exception("quota release consumer failed; resuming")
                await asyncio.sleep(0.5)

    async def _ended(self, msg) -> None:  # type: ignore[no-untyped-def]
        sandbox_id = events.sandbox_id_of(msg.subject)
        keys = [_member(sandbox_id, events.node_of(msg.subject))] + ([f"m.{sandbox_id}"] if self.older_members else [])
        for key in keys:
            try:
                entry = await self.kv.get(key)
                if entry.value:
                    await self.kv.delete(key, last=entry.revision)  # whoever deletes it gives back
                    await self.give_back(decode(entry.value, list[str]), 1)
                break
            except nats.js.errors.KeyNotFoundError:
                continue  # not under a quota (on this node), or given back already
            except nats.js.errors.KeyWrongLastSequenceError:
                break
            except ServiceError as exc:
                log.warning("could not give back the quota of %s: %s", sandbox_id, exc.message)
                break
        await msg.ack()

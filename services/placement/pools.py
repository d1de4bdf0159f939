"""Warm pools as placement keeps them: the pool config in KV `pools` (set, list, clear), and
sending a create that matches one to a node holding a spare of it.

Nodes build and advertise their spares (`NodeInfo.warm`, by pool key); a create is offered
first to the fresh, calm node with the most spares of its shape left, counting the claims this
replica sent since that node's last heartbeat, so a burst spreads over the spares instead of
asking one node for more than it has. A node that has none after all (another replica took it)
answers an empty claim, and the create is booked cold as any other: a claim never fails a
create that a cold one would start. A batch (`create_many`) claims as many spares as are
advertised, together, and the rest of it is booked cold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from sandfleet import errors
from sandfleet.bus import Bus, decode, encode
from sandfleet.errors import ServiceError
from schemas import node as node_schema
from schemas import pools as pools_schema
from schemas.errors import ErrorCode
from schemas.node import NodeInfo
from schemas.pools import (ClaimReply, ClaimRequest, Pool, PoolClearReply, PoolClearRequest, PoolList,
                           PoolListRequest, PoolState)
from schemas.sandbox import CreateReply, SandboxSpec
from services.placement.policy import NodeView
from services.placement.quotas import Quotas

log = logging.getLogger("sandfleet.placement")

CLAIM_TIMEOUT_S = 10.0
CLAIM_TRIES = 2  # nodes asked before a create goes cold
# A node's answer that says the create itself is wrong: a cold create would be refused alike.
CALLERS_FAULT = (ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED)


def warm_order(view: NodeView, taken: dict[tuple[str, str], tuple[NodeInfo, int]], key: str, isolation: str,
               now: float, node: str | None = None) -> list[str]:
    """The nodes to offer a create of pool `key` to, most spares left first."""
    left = spares_left(view, taken, key, isolation, now, node)
    return sorted(left, key=lambda n: left[n], reverse=True)


def spares_left(view: NodeView, taken: dict[tuple[str, str], tuple[NodeInfo, int]], key: str, isolation: str,
                now: float, node: str | None = None) -> dict[str, int]:
    """Spares of pool `key` each fresh, calm node has left: its heartbeat's count less the claims
    sent to it since that heartbeat."""
    left: dict[str, int] = {}
    for n in view.fresh(now):
        info = view.nodes[n]
        if (node is not None and n != node) or isolation not in info.isolation or view.pressured(n):
            continue
        sent = taken.get((n, key))
        spares = info.warm.get(key, 0) - (sent[1] if sent is not None and sent[0] is info else 0)
        if spares > 0:
            left[n] = spares
    return left


@dataclass
class PoolBook:
    bus: Bus
    kv: KeyValue
    # (node, key) → (the heartbeat the count is against, claims sent since it)
    taken: dict[tuple[str, str], tuple[NodeInfo, int]] = field(default_factory=dict)

    @classmethod
    async def open(cls, bus: Bus) -> PoolBook:
        kv = await bus.js.create_key_value(
            KeyValueConfig(bucket=pools_schema.KV_BUCKET, history=1, storage=StorageType.FILE,
                           description="warm pools: the specs nodes keep spares of")
        )
        return cls(bus, kv)

    # -- config -------------------------------------------------------------------------------

    async def set(self, pool: Pool, *, view: NodeView) -> PoolState:
        why = pools_schema.refusal(pool.spec)
        if why:
            raise ServiceError(ErrorCode.INVALID_REQUEST, why)
        levels = {lvl for n in view.fresh(time.time()) for lvl in view.nodes[n].isolation}
        if levels and pool.spec.isolation not in levels:
            raise ServiceError(ErrorCode.UNSUPPORTED, f"no node can run isolation {pool.spec.isolation!r}; "
                                                      f"nodes offer {sorted(levels)}")
        key = pools_schema.pool_key(pool.spec)
        pool = Pool(spec=pools_schema.shape_of(pool.spec), size=pool.size)
        if pool.size == 0:
            await self._delete(key)
        else:
            await self.kv.put(key, encode(pool))
        return PoolState(key=key, pool=pool, warm=self._warm(view, key))

    async def list(self, _: PoolListRequest, *, view: NodeView) -> PoolList:
        return PoolList(pools=[PoolState(key=k, pool=p, warm=self._warm(view, k))
                               for k, p in sorted((await self._all()).items())])

    async def clear(self, req: PoolClearRequest) -> PoolClearReply:
        if req.all == (req.spec is not None):
            raise ServiceError(ErrorCode.INVALID_REQUEST, "clear one pool (its spec) or every pool (all), not both")
        keys = sorted(await self._all()) if req.all else [pools_schema.pool_key(req.spec)]  # type: ignore[arg-type]
        cleared = [k for k in keys if await self._delete(k)]
        return PoolClearReply(cleared=cleared)

    async def _all(self) -> dict[str, Pool]:
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        found = {}
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue
            if entry.value:
                found[key] = decode(entry.value, Pool)
        return found

    async def _delete(self, key: str) -> bool:
        try:
            await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return False
        await self.kv.delete(key)
        return True

    @staticmethod
    def _warm(view: NodeView, key: str) -> dict[str, int]:
        return {n: info.warm[key] for n, info in sorted(view.nodes.items()) if info.warm.get(key)}

    # -- claims ---------------------------------------------------------------------------------

    async def claim_admitted(self, view: NodeView, quotas: Quotas | None, spec: SandboxSpec, tenant: str,
                             node: str | None = None) -> tuple[CreateReply | None, list[str] | None]:
        """A spare claimed for this create, admitted by the quotas as a cold create is. Else None
        and, if the create was admitted here, its quota keys: the cold create that follows takes
        them over instead of being admitted twice (a rate quota's token is not given back)."""
        if not any(info.warm for info in view.nodes.values()):
            return None, None  # no node keeps spares (no pools): a plain create pays nothing more
        spec = with_tenant(spec, tenant)
        if not pools_schema.poolable(spec) or not warm_order(view, self.taken, pools_schema.pool_key(spec),
                                                             spec.isolation, time.time(), node):
            return None, None  # no node has one: no quota work, nothing sent
        quota_keys = await quotas.admit(spec, 1, time.time()) if quotas else []
        try:
            claimed = await self.claim(view, spec, tenant, node)
        except BaseException:
            if quotas and quota_keys:
                await quotas.give_back(quota_keys, 1)
            raise
        if claimed is None:
            return None, quota_keys
        if quotas and quota_keys:
            # Only now is its id known (the node's spare's): a sandbox that ends before this write,
            # within moments of its start, keeps its quota slot (the ended-event consumer found no member).
            await quotas.remember([claimed], quota_keys)
        return CreateReply(id=claimed[0], node=claimed[1]), None

    async def claim_many_admitted(self, view: NodeView, quotas: Quotas | None, spec: SandboxSpec, tenant: str,
                                  count: int) -> tuple[list[tuple[str, str]], list[str] | None]:
        """Spares claimed for as many of a batch of `count` as the nodes have, (sandbox id, node)
        each, admitted by the quotas as the whole batch; and, if the batch was admitted here, its
        quota keys: the cold rest that follows takes them over instead of being admitted again."""
        if not any(info.warm for info in view.nodes.values()):
            return [], None
        spec = with_tenant(spec, tenant)
        if not pools_schema.poolable(spec):
            return [], None
        key, now = pools_schema.pool_key(spec), time.time()
        left = sum(spares_left(view, self.taken, key, spec.isolation, now).values())
        if not left:
            return [], None
        quota_keys = await quotas.admit(spec, count, now) if quotas else []
        # Each claim counts itself against its node before it is sent: together they spread.
        tries = await asyncio.gather(*(self.claim(view, spec, tenant) for _ in range(min(count, left))),
                                     return_exceptions=True)
        claimed = [c for c in tries if isinstance(c, tuple)]
        refused = next((c for c in tries if isinstance(c, BaseException)), None)
        if refused is not None and not claimed:  # the node says the spec is wrong: nothing was made
            if quotas and quota_keys:
                await quotas.give_back(quota_keys, count)
            raise refused
        if quotas and quota_keys and claimed:
            await quotas.remember(claimed, quota_keys)
        return claimed, quota_keys

    async def claim(self, view: NodeView, spec: SandboxSpec, tenant: str, node: str | None = None
                    ) -> tuple[str, str] | None:
        """(sandbox id, node) of a spare claimed for this create, or None: create it cold."""
        if not pools_schema.poolable(spec):
            return None
        key = pools_schema.pool_key(spec)
        for node_id in warm_order(view, self.taken, key, spec.isolation, time.time(), node)[:CLAIM_TRIES]:
            info = view.nodes[node_id]
            sent = self.taken.get((node_id, key))
            self.taken[(node_id, key)] = (info, (sent[1] if sent is not None and sent[0] is info else 0) + 1)
            try:
                reply = await self.bus.request(node_schema.subject(node_id, pools_schema.CLAIM),
                                               ClaimRequest(spec=spec, tenant=tenant), ClaimReply,
                                               timeout=CLAIM_TIMEOUT_S)
            except errors.ServiceFailure as exc:
                if exc.code in CALLERS_FAULT:
                    raise ServiceError(exc.code, exc.message) from None
                log.warning("claim on %s failed (%s); trying elsewhere", node_id, exc.message)
                continue
            except errors.SandfleetError as exc:  # no answer: the create goes cold (elsewhere, or there)
                log.warning("claim on %s got no answer (%s)", node_id, exc)
                continue
            if reply.id:
                return reply.id, node_id
        return None


def with_tenant(spec: SandboxSpec, tenant: str) -> SandboxSpec:
    """A tenant's quota counts what the server vouched for: its label, whatever the body said."""
    if tenant and spec.labels.get("tenant") != tenant:
        return msgspec.structs.replace(spec, labels={**spec.labels, "tenant": tenant})
    return spec

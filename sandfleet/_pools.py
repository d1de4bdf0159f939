"""Fleet calls about warm pools: keep spares of a spec's shape on every node that can run it,
list them with how many each node has ready, clear them. A create whose spec has a pool's shape
(isolation, cpu, memory_mb, pids, disk_mb, layers, host_view) takes a spare when a node has one
(its labels, egress rules and timeout are applied then); any other create is built cold."""

from __future__ import annotations

from typing import Any

import msgspec

from sandfleet import errors
from sandfleet.bus import Bus
from schemas import pools
from schemas.pools import Pool, PoolClearReply, PoolClearRequest, PoolList, PoolListRequest, PoolState
from schemas.sandbox import SandboxSpec


def _shape(spec: SandboxSpec | dict[str, Any] | None, shape: dict[str, Any]) -> SandboxSpec:
    """The pool's spec from a SandboxSpec, a dict or keyword fields; bad values raise InvalidRequest here."""
    raw = msgspec.to_builtins(spec) if isinstance(spec, SandboxSpec) else dict(spec or {})
    try:
        return msgspec.convert({**raw, **shape}, SandboxSpec)
    except (msgspec.ValidationError, ValueError) as exc:
        raise errors.InvalidRequest(str(exc)) from None


class _FleetPools:
    """The warm-pool half of `Fleet` (mixed into it)."""

    bus: Bus

    async def set_pool(self, spec: SandboxSpec | dict[str, Any] | None = None, *, size: int,
                       **shape: Any) -> PoolState:
        """Keep `size` spares of this shape on every node that runs its isolation (`size=0`
        removes the pool). Labels, egress rules and the timeout are not part of a pool: each
        create brings its own. A spec a pool cannot have raises InvalidRequest."""
        try:
            pool = msgspec.convert({"spec": msgspec.to_builtins(_shape(spec, shape)), "size": size}, Pool)
        except msgspec.ValidationError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        return await self.bus.request(pools.POOL_SET, pool, PoolState, timeout=30)

    async def pools(self) -> list[PoolState]:
        return (await self.bus.request(pools.POOL_LIST, PoolListRequest(), PoolList, timeout=30)).pools

    async def clear_pool(self, spec: SandboxSpec | dict[str, Any] | None = None, **shape: Any) -> list[str]:
        """Remove the pool of this shape; nodes destroy its spares. Returns the keys removed."""
        req = PoolClearRequest(spec=_shape(spec, shape))
        return (await self.bus.request(pools.POOL_CLEAR, req, PoolClearReply, timeout=30)).cleared

    async def clear_pools(self) -> list[str]:
        """Remove every pool."""
        return (await self.bus.request(pools.POOL_CLEAR, PoolClearRequest(all=True), PoolClearReply,
                                       timeout=30)).cleared

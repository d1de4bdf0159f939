"""E2B's `Idempotency-Key` on create: a create retried with the key it was first sent with gets
the sandbox the first one made (the SDK retries a create whose answer was lost: a 502, a
dropped connection), and the key sent with another body is refused. Kept in this replica's
memory for KEEP_S; a concurrent duplicate waits for the first to finish."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

KEEP_S = 3600.0
KEPT = 10_000


class KeyReused(ValueError):
    """The key came with a different request than the one it was first sent with."""


class IdempotentCreates:
    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[str, str], tuple[str, float, asyncio.Future]] = OrderedDict()

    async def once(self, tenant: str, key: str | None, body: Any, create: Callable[[], Awaitable[str]]) -> str:
        """The sandbox id `create()` makes, once per (tenant, key) and body."""
        if not key:
            return await create()
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        now = time.monotonic()
        while self._seen and next(iter(self._seen.values()))[1] < now - KEEP_S:
            self._seen.popitem(last=False)
        seen = self._seen.get((tenant, key))
        if seen is not None:
            if seen[0] != digest:
                raise KeyReused(f"Idempotency-Key {key!r} was sent before with another request")
            return await asyncio.shield(seen[2])
        made: asyncio.Future = asyncio.get_running_loop().create_future()
        self._seen[(tenant, key)] = (digest, now, made)
        while len(self._seen) > KEPT:
            self._seen.popitem(last=False)
        try:
            sandbox_id = await create()
        except BaseException as exc:
            self._seen.pop((tenant, key), None)  # a failed create may be tried again with the key
            if isinstance(exc, asyncio.CancelledError):
                made.cancel()
            else:
                made.set_exception(exc)
                made.exception()  # retrieved here: a duplicate nobody sent warns of nothing
            raise
        made.set_result(sandbox_id)
        return sandbox_id

"""A tenant reaches only its own sandboxes: every launcher endpoint, asked by a tenant, first
checks that the sandbox's record names that tenant.

Who asks is what the server wrote on the request (`Nats-Request-Info` of a shared service
import: the caller's account, `bus.CALLER_TENANT`), never a field of the body. A request from
inside the platform's account (placement, the security monitor, the operator) is not checked.
Another tenant's sandbox answers as no sandbox at all (NOT_FOUND), so a tenant learns nothing
of what others run; a verb about no sandbox (node-wide) is never a tenant's (FORBIDDEN).
The owner of a sandbox never changes: each is learnt from the record its
launch carries (or read from the store once, for a sandbox launched before a restart).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from sandfleet.bus import CALLER_TENANT, Endpoint
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas.errors import ErrorCode
from schemas.node import LaunchRequest

MAX_REMEMBERED = 100_000  # owners kept; past it the memory starts over (a read each, once more)


class Owners:
    """Sandbox id → tenant, read from the records on first need."""

    def __init__(self, store: SandboxStore) -> None:
        self.store = store
        self._known: dict[str, str] = {}

    def learn(self, launch: LaunchRequest) -> None:
        for item in launch.items():
            if item.record is not None:
                self._remember(item.id, item.record.tenant)

    def _remember(self, sandbox_id: str, tenant: str) -> str:
        if len(self._known) >= MAX_REMEMBERED:
            self._known.clear()
        self._known[sandbox_id] = tenant
        return tenant

    async def of(self, sandbox_id: str) -> str:
        owner = self._known.get(sandbox_id)
        if owner is None:
            record, _ = await self.store.get(sandbox_id)  # NOT_FOUND if there is none
            owner = self._remember(sandbox_id, record.tenant)
        return owner

    async def check(self, request: Any) -> None:
        tenant = CALLER_TENANT.get()
        if tenant is None:
            return
        sandbox_id = getattr(request, "sandbox_id", None)
        if not isinstance(sandbox_id, str):  # a node-wide verb: never a tenant's
            raise ServiceError(ErrorCode.FORBIDDEN, "a node-wide request is the platform's, not a tenant's")
        try:
            owner = await self.of(sandbox_id)
        except ServiceError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                raise ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}") from None
            raise
        if owner != tenant:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no sandbox {sandbox_id}")


def guarded(endpoints: list[Endpoint], owners: Owners) -> list[Endpoint]:
    """The same endpoints, each checking a tenant caller's ownership before its handler runs."""
    return [dataclasses.replace(ep, handler=_checked(ep.handler, owners)) for ep in endpoints]


def _checked(handler: Callable[..., Awaitable[Any]], owners: Owners) -> Callable[..., Awaitable[Any]]:
    async def checked(request: Any, *body: Any) -> Any:
        await owners.check(request)  # first: a tenant's launch is refused before it could teach an owner
        if isinstance(request, LaunchRequest):
            owners.learn(request)
        return await handler(request, *body)

    return checked

"""Which sandbox a request means, and whether its caller may use it: the REST plane names a
sandbox in its path and authenticates a tenant by API key; envd's protocol names it in the
`E2b-Sandbox-Id` header and carries its access token. Answers come from the platform over the
bus; the only thing kept here is the node each sandbox is on (it never changes), so a command
costs no lookup once its sandbox is known."""

from __future__ import annotations

from collections import OrderedDict

from sandfleet import errors
from sandfleet.client import Fleet, Sandbox
from schemas.sandbox import SandboxRecord
from services.gateway import shapes
from services.gateway.faults import SandboxGone, Unauthenticated
from services.gateway.tenants import TenantKeys

CACHED = 10_000


class Sandboxes:
    def __init__(self, fleet: Fleet, secret: bytes, api_keys: dict[str, str],
                 tenant_keys: TenantKeys | None = None) -> None:
        self.fleet = fleet  # the gateway's own (the platform's account)
        self._secret = secret
        self._api_keys = api_keys
        self.tenant_keys = tenant_keys
        self._known: OrderedDict[str, tuple[str, dict[str, str]]] = OrderedDict()  # id → (node, envs)

    def tenant(self, api_key: str | None) -> str:
        tenant = self._api_keys.get(api_key or "")
        if tenant is None and api_key and self.tenant_keys is not None:
            tenant = self.tenant_keys.tenant(api_key)
        if tenant is None:
            raise Unauthenticated("Invalid API key" if api_key else "Missing API key: send it in X-API-KEY")
        return tenant

    async def fleet_of(self, tenant: str) -> Fleet:
        """The connection a tenant's REST calls go through: its own credentials' where it has
        them (the bus keeps it to its own sandboxes), else the gateway's."""
        own = await self.tenant_keys.fleet(tenant) if self.tenant_keys is not None else None
        return own or self.fleet

    def token(self, sandbox_id: str) -> str:
        return shapes.access_token(self._secret, sandbox_id)

    def _remember(self, record: SandboxRecord) -> Sandbox:
        self._known[record.id] = (record.node, shapes.envs_of(record))
        self._known.move_to_end(record.id)
        while len(self._known) > CACHED:
            self._known.popitem(last=False)
        return Sandbox(self.fleet, record.id, record.node)

    def forget(self, sandbox_id: str) -> None:
        self._known.pop(sandbox_id, None)

    async def record(self, sandbox_id: str, tenant: str) -> SandboxRecord:
        """The live sandbox's record, if it is the tenant's; SandboxGone otherwise."""
        try:
            record = await (await self.fleet_of(tenant)).get(sandbox_id)
        except (errors.NotFound, errors.InvalidRequest):
            raise SandboxGone(sandbox_id) from None
        if not shapes.visible_to(record, tenant):
            raise SandboxGone(sandbox_id)
        self._remember(record)
        return record

    async def handle(self, sandbox_id: str, tenant: str) -> Sandbox:
        record = await self.record(sandbox_id, tenant)
        return Sandbox(await self.fleet_of(tenant), record.id, record.node)

    async def live(self, sandbox_id: str) -> Sandbox:
        """A live sandbox by id alone (the port proxy: E2B's sandbox ports are public by default)."""
        return self._remember(await self._live_record(sandbox_id))

    async def _live_record(self, sandbox_id: str) -> SandboxRecord:
        try:
            record = await self.fleet.get(sandbox_id)
        except (errors.NotFound, errors.InvalidRequest):
            raise SandboxGone(sandbox_id) from None
        if record.state not in shapes.LIVE:
            raise SandboxGone(sandbox_id)
        return record

    async def for_envd(self, sandbox_id: str | None, token: str | None) -> tuple[Sandbox, dict[str, str]]:
        """The sandbox an envd request names, checked against its access token; with the
        environment variables its creator asked for."""
        if not sandbox_id:
            raise errors.InvalidRequest("no E2b-Sandbox-Id header: which sandbox?")
        if not shapes.token_matches(self._secret, sandbox_id, token or ""):
            raise Unauthenticated(f"wrong or missing X-Access-Token for sandbox {sandbox_id}")
        known = self._known.get(sandbox_id)
        if known is not None:
            return Sandbox(self.fleet, sandbox_id, known[0]), known[1]
        record = await self._live_record(sandbox_id)
        return self._remember(record), shapes.envs_of(record)

"""The E2B API keys the operator gave tenants (`sandfleet tenant add NAME --e2b-key`), and a bus
connection per tenant made with that tenant's own credentials.

The table (`<data dir>/auth/e2b-keys.json`, key digest → tenant) is reread when it changes, so a
key added while the gateway runs works at once. A tenant with credentials has its sandboxes
made, listed and read through its own connection: the bus server, not a label the gateway sets,
makes them its own and keeps every other tenant's out of its answers. Keys given with
`--api-key KEY=TENANT` (no bus account) go through the gateway's own connection, told apart by
the tenant label, as before.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import sandfleet
from sandfleet.bus_accounts import AuthDir
from sandfleet.client import Fleet
from sandfleet.credentials import api_key_digest

log = logging.getLogger("sandfleet.gateway")


class TenantKeys:
    def __init__(self, auth: AuthDir | None, url: str) -> None:
        self._auth, self._url = auth, url
        self._table: dict[str, str] = {}
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the table last read
        self._fleets: dict[str, Fleet] = {}
        self._lock = asyncio.Lock()

    def tenant(self, api_key: str) -> str | None:
        if self._auth is None:
            return None
        self._reread()
        return self._table.get(api_key_digest(api_key))

    def _reread(self) -> None:
        assert self._auth is not None
        try:
            stat = self._auth.e2b_keys_file.stat()
        except OSError:
            self._table, self._seen = {}, None
            return
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            self._table, self._seen = self._auth.e2b_keys(), (stat.st_mtime_ns, stat.st_size)

    async def fleet(self, tenant: str) -> Fleet | None:
        """The tenant's own connection (made on first need), None for a tenant with no credentials."""
        if tenant in self._fleets or self._auth is None:
            return self._fleets.get(tenant)
        creds: Path | None = self._auth.tenant_creds(tenant)
        if creds is None:
            return None
        async with self._lock:
            if tenant not in self._fleets:
                self._fleets[tenant] = await sandfleet.connect(self._url, name=f"gateway-{tenant}", creds=creds)
                log.info("tenant %s: through its own bus credentials", tenant)
        return self._fleets[tenant]

    async def close(self) -> None:
        for fleet in self._fleets.values():
            await fleet.close()
        self._fleets.clear()

"""The monitor's JetStream state, shared by its replicas: policies by task (KV
`security-policies`), one revision-checked record per sandbox that made a violation (KV
`security-sandboxes`, entries expire after longer than any sandbox can live), and whose each
violated sandbox is (read from the sandbox records, which only the platform writes)."""

from __future__ import annotations

from collections.abc import Callable

import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from sandfleet.bus import Bus, decode, encode, kv_values
from sandfleet.errors import ServiceError
from sandfleet.store import SandboxStore
from schemas import security
from schemas.errors import ErrorCode
from schemas.security import Policy, SandboxSecurity
from services.security_monitor.policy import default_policy


async def _bucket(bus: Bus, config: KeyValueConfig) -> KeyValue:
    try:
        return await bus.js.create_key_value(config)
    except nats.js.errors.BadRequestError:  # exists with another config (an operator tuned it); keep theirs
        return await bus.js.key_value(config.bucket)


class Policies:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, bus: Bus) -> Policies:
        config = KeyValueConfig(bucket=security.POLICY_BUCKET, history=5, storage=StorageType.FILE,
                                description="security policy per task")
        return cls(await _bucket(bus, config))

    async def get(self, task: str) -> Policy:
        if not task:
            return default_policy("")
        try:
            entry = await self.kv.get(task)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.InvalidKeyError):
            return default_policy(task)  # a task label that cannot be a key cannot have a policy
        return decode(entry.value, Policy) if entry.value else default_policy(task)

    async def put(self, policy: Policy) -> None:
        await self.kv.put(policy.task, encode(policy))

    async def all(self) -> list[Policy]:
        return [await self.get(key) for key in sorted(await kv_values(self.kv, "list policies"))]


class Owners:
    """Sandbox id → the tenant its record names ("": none, or no record any more). A sandbox's
    owner never changes, so each is read once (and forgotten wholesale past MAX_REMEMBERED).
    Read through the store, which knows a sandbox still spoken for by its batch record."""

    MAX_REMEMBERED = 100_000

    def __init__(self, store: SandboxStore) -> None:
        self.store = store
        self._known: dict[str, str] = {}

    @classmethod
    async def open(cls, bus: Bus) -> Owners:
        return cls(await SandboxStore.open(bus))

    async def of(self, sandbox_id: str) -> str:
        owner = self._known.get(sandbox_id)
        if owner is None:
            try:
                record, _ = await self.store.get(sandbox_id)
            except ServiceError:
                return ""  # not remembered: a record may yet be read (a violation racing its create)
            owner = record.tenant
            if len(self._known) >= self.MAX_REMEMBERED:
                self._known.clear()
            self._known[sandbox_id] = owner
        return owner


class Ledger:
    """Per-sandbox counts and action state; every change is a revision-checked update."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, bus: Bus) -> Ledger:
        config = KeyValueConfig(bucket=security.SANDBOX_BUCKET, history=1, ttl=security.SANDBOX_MAX_AGE_S,
                                storage=StorageType.FILE, description="security counts per sandbox")
        return cls(await _bucket(bus, config))

    async def get(self, sandbox_id: str) -> tuple[SandboxSecurity, int]:
        """The record and its revision (0: none yet)."""
        try:
            entry = await self.kv.get(sandbox_id)
        except nats.js.errors.KeyNotFoundError:
            return SandboxSecurity(sandbox_id=sandbox_id), 0
        if not entry.value:
            return SandboxSecurity(sandbox_id=sandbox_id), 0
        return decode(entry.value, SandboxSecurity), entry.revision

    async def update(
        self, sandbox_id: str, change: Callable[[SandboxSecurity], SandboxSecurity | None]
    ) -> tuple[SandboxSecurity, bool]:
        """Apply `change` (None: leave it as it is); returns the record and whether it changed."""
        for _ in range(50):
            record, revision = await self.get(sandbox_id)
            updated = change(record)
            if updated is None:
                return record, False
            try:
                if revision == 0:
                    await self.kv.create(sandbox_id, encode(updated))
                else:
                    await self.kv.update(sandbox_id, encode(updated), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another replica wrote first: judge again on what it wrote
            return updated, True
        raise ServiceError(ErrorCode.CONFLICT, f"security record of {sandbox_id} keeps changing; retry")

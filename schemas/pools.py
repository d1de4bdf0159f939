"""Warm pools: the specs each node keeps pre-built sandboxes (spares) of, and claiming one.

A pool is set for a shape of sandbox, what it takes to build one (isolation, resources,
layers); what belongs to one use of it (labels, egress rules, timeout, tenant) is given by the
create that claims a spare and applied then. Pools are config, kept in the KV bucket `pools`
by placement and read by every node's launcher; a node advertises its spares by pool key in
its heartbeat (`NodeInfo.warm`), and placement sends a matching create to a node that has one
(`node.v1.<node>.claim`) before booking a cold one.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.sandbox import SandboxSpec

POOL_SET = "sandbox.v1.pool.set"
POOL_LIST = "sandbox.v1.pool.list"
POOL_CLEAR = "sandbox.v1.pool.clear"
KV_BUCKET = "pools"
CLAIM = "claim"  # node verb (`node.v1.<node>.claim`): placement → launcher

MAX_POOL_SIZE = 512  # spares per node per pool

# The fields a spare is built from: a create matches a pool when all of them are equal.
SHAPE_FIELDS = ("isolation", "cpu", "memory_mb", "pids", "disk_mb", "layers", "host_view")
# The fields of one use, applied when a spare is claimed: a pool's spec must leave them unset.
USE_FIELDS = ("labels", "allow")


def pool_key(spec: SandboxSpec) -> str:
    """The pool a spec belongs to, by its shape: `p` and 16 hex digits, stable across versions
    because it hashes the fields by name."""
    shape = {f: getattr(spec, f) for f in SHAPE_FIELDS}
    return "p" + hashlib.sha256(msgspec.json.encode(shape, order="sorted")).hexdigest()[:16]


def poolable(spec: SandboxSpec) -> bool:
    """Whether a create of this spec may take a spare (a desktop's display is part of its
    start, so a desktop is always built for its create; a build sandbox's root and
    capabilities are not an ordinary spare's)."""
    return spec.desktop is None and not spec.build


def shape_of(spec: SandboxSpec) -> SandboxSpec:
    """The spec a spare is built with: the shape, nothing of any one use."""
    return SandboxSpec(**{f: getattr(spec, f) for f in SHAPE_FIELDS})


def refusal(spec: SandboxSpec) -> str:
    """Why this spec cannot be a pool's (empty: it can)."""
    used = [f for f in USE_FIELDS if getattr(spec, f)]
    if used:
        return (f"a pool's spec is the shape of its sandboxes; {', '.join(used)} belong to each create "
                f"and are applied when it claims a spare")
    if spec.build:
        return "a build sandbox (build=true) is the builder's own and cannot be pooled"
    if not poolable(spec):
        return "a desktop sandbox is built for its create and cannot be pooled"
    if spec.isolation in ("microvm", "vm"):
        return f"isolation {spec.isolation!r} has no warm pools (its snapshot start is its fast path)"
    return ""


class Pool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of `sandbox.v1.pool.set` and the KV value `pools/<key>`: keep `size` spares of
    `spec` on every node that can run it (0 removes the pool, as `pool.clear` does)."""

    spec: SandboxSpec
    size: Annotated[int, Meta(ge=0, le=MAX_POOL_SIZE)]


class PoolState(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    pool: Pool
    warm: dict[str, int] = {}  # node → spares ready there now (from the nodes' heartbeats)


class PoolListRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class PoolList(msgspec.Struct, frozen=True, kw_only=True):
    pools: list[PoolState] = []


class PoolClearRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Remove the pool of `spec`'s shape, or every pool with `all`; nodes destroy their spares."""

    spec: SandboxSpec | None = None
    all: bool = False


class PoolClearReply(msgspec.Struct, frozen=True, kw_only=True):
    cleared: list[str] = []  # the keys removed


class ClaimRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Placement → launcher: take a spare of `spec`'s shape for this create; its labels, egress
    rules and timeout are applied, and its record is written with `tenant` (as placement's
    would be: `scheduled`, then `running`)."""

    spec: SandboxSpec
    tenant: str = ""


class ClaimReply(msgspec.Struct, frozen=True, kw_only=True):
    id: str = ""  # empty: no spare of that shape here now (placement creates it cold)

"""The JetStream state every service shares, made at each one's start (`ensure_state`): the
sandbox records and node heartbeat buckets, the layer catalogue's buckets, and the events stream.

Nodes put keys of every one of these buckets (records and heartbeats each its own, the layer
catalogue any: sandfleet/bus_accounts.py), so each is made to refuse rollup headers, with which
a put of one's own key could purge every key (`_bucket`); one made by an older sandfleet is
switched over by the first service whose user may update it (not a node's).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from sandfleet.bus import Bus
from sandfleet.jetstream import kv_stream, kv_subject
from schemas import events, layers, node, sandbox

log = logging.getLogger("sandfleet.store")

EVENTS_MAX_AGE_S = 7 * 24 * 3600


async def ensure_state(bus: Bus) -> None:
    """Create the buckets and the stream if they are missing; safe to call from every service.

    On a clustered bus the bus adapter gives each the cluster's replica count (`Bus.js`)."""
    js = bus.js
    # BatchedJetStream.kv_read_many: batched direct gets of the records
    await ensure_bucket(js, sandbox.KV_BUCKET, "sandbox records", direct=True)
    await ensure_bucket(js, node.KV_BUCKET, "node heartbeats", ttl=node.NODE_TTL_S)
    await ensure_layer_buckets(js)
    try:
        await js.add_stream(
            StreamConfig(
                name=events.STREAM,
                subjects=events.STREAM_SUBJECTS,
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=EVENTS_MAX_AGE_S,
                duplicate_window=120,
                allow_batched=True,  # events go in fast-ingest batches (BatchedJetStream.append_many)
            )
        )
    except nats.js.errors.BadRequestError:  # exists with another config (an operator tuned it): keep theirs,
        await _turn(js, events.STREAM, allow_batched=True)  # but let it take batches of events
        await _cover(js, events.STREAM, events.STREAM_SUBJECTS)  # and every event subject this version publishes


async def ensure_bucket(js: Any, bucket: str, description: str, *, direct: bool = False,
                        ttl: float | None = None) -> None:
    """Make a KV bucket that nodes write into (`_bucket`), or turn one an older sandfleet made
    (nats-py's `create_key_value`, or tuned by an operator) to refuse rollups, keeping the rest."""
    config = _bucket(bucket, description, direct=direct, ttl=ttl)
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:  # made by an older sandfleet (or tuned): keep it, but safe
        await _turn(js, config.name or "", allow_rollup_hdrs=False, **({"allow_direct": True} if direct else {}))


async def ensure_layer_buckets(js: Any) -> None:
    """The layer catalogue (`<name>`, `<name>.<tag>`) and the OCI diff ids: any node puts any key
    of them (nodes build layers for one another), so neither may take a rollup. (Their images'
    Object Store needs rollups for its own metadata: not made here.)"""
    await ensure_bucket(js, layers.KV_BUCKET, "layer catalogue")
    await ensure_bucket(js, layers.DIFF_BUCKET, "OCI layer diff ids and their EROFS images")


def _bucket(bucket: str, description: str, *, direct: bool = False, ttl: float | None = None) -> StreamConfig:
    """The stream of a KV bucket nodes write into, as nats-py's `create_key_value` makes one
    with history 1, but refusing rollup headers: with them, anyone allowed to put one key could
    purge the whole bucket (`Nats-Rollup: all`). With one value kept per key, a delete marker
    (no rollup) drops a key's value as a purge would, so nothing here needs them."""
    return StreamConfig(name=kv_stream(bucket), description=description, subjects=[kv_subject(bucket, ">")],
                        allow_direct=direct, allow_rollup_hdrs=False, deny_delete=True, discard=DiscardPolicy.NEW,
                        duplicate_window=min(120.0, ttl or 120.0), max_age=ttl, max_consumers=-1, max_msgs=-1,
                        max_msgs_per_subject=1, storage=StorageType.FILE)


async def _cover(js: Any, stream: str, subjects: list[str]) -> None:
    """Add to a stream the `subjects` it does not capture yet (a stream made before lifecycle
    events moved to `events.v3.`: without this their publishes would find no stream)."""
    info = await js.stream_info(stream)
    missing = [s for s in subjects if s not in (info.config.subjects or [])]
    if missing:
        try:
            await js.update_stream(dataclasses.replace(info.config, subjects=[*(info.config.subjects or []), *missing]))
        except nats.js.errors.Error as exc:
            log.warning("cannot add %s to stream %s: %s", missing, stream, exc)


async def _turn(js: Any, stream: str, **features: bool) -> None:
    """Set stream features (`allow_direct`, `allow_batched` on; `allow_rollup_hdrs` off) that a
    stream made by an older sandfleet lacks, keeping the rest of its config. Where the server
    refuses, the store reads or writes the slower way instead; where a user may not update the
    stream (a node), the services that may do it when they start."""
    info = await js.stream_info(stream)
    if any(getattr(info.config, f) != on for f, on in features.items()):
        try:
            await js.update_stream(dataclasses.replace(info.config, **features))
        except (nats.js.errors.Error, nats.errors.Error) as exc:
            log.warning("cannot set %s for stream %s: %s", features, stream, exc)

"""What a node may do to the JetStream state every node shares, on a real nats-server with the
accounts and node credentials `sandfleet up` makes (sandfleet/bus_accounts.py).

The events stream (the audit trail), the layer catalogue's buckets and other users' consumers:
node A tries to retune, purge or delete the stream, wipe the catalogue with a rollup, change the
buckets' limits, and delete, pull from, pause or take over the durable consumers placement and
the security monitor keep on the events. Each is refused and nothing changes; A's own work
(events published, layers recorded and removed, its KV watches and ordered consumers) goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator

import nats
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType

from sandfleet.buckets import ensure_state
from sandfleet.bus import Bus, encode
from sandfleet.bus_accounts import AuthDir
from sandfleet.jetstream import kv_stream, kv_subject, object_stream, refusal
from sandfleet.store import SandboxStore
from schemas import events, layers, sandbox
from schemas.layers import Layer
from services.layer_cache.store import LayerStore, Ref
from tests.conftest import NODE_ID
from tests.natsd import authed_nats_server, refused_publishes

pytestmark = pytest.mark.timeout(120)
A = f"{NODE_ID}-a"
DURABLE = "probe-durable"  # as placement's quota consumer and the monitor's violations consumer are


@pytest.fixture(scope="module")
def bus_url(tmp_path_factory) -> Iterator[tuple[str, AuthDir]]:
    with authed_nats_server(tmp_path_factory.mktemp("node-state-auth"), [A]) as found:
        yield found


@pytest.fixture
async def buses(bus_url) -> AsyncIterator[dict[str, Bus]]:
    url, auth = bus_url
    found = {"placement": await Bus.connect(url, "placement", creds=auth.service("placement"))}
    await ensure_state(found["placement"])
    found[A] = await Bus.connect(url, A, creds=auth.node(A))
    await ensure_state(found[A])  # as every node service does at its start: allowed, and changes nothing
    yield found
    for bus in found.values():
        await bus.close()


def _lower(subjects: list[tuple[str, bytes]]) -> set[str]:
    return {s.lower() for s, _ in subjects}  # nats-py lowercases the server's error


async def _stream(bus: Bus, stream: str) -> tuple[object, int, int]:
    info = await bus.js.stream_info(stream)
    return info.config, info.state.messages, info.state.last_seq


def _event(n: int) -> tuple[str, bytes]:
    return events.sandbox_subject(f"sb-{n:012x}", "started", events.NO_TENANT, A), encode({"n": n})  # its own


async def test_a_node_cannot_retune_purge_or_delete_the_events_stream(bus_url, buses):
    url, auth = bus_url
    placement, a = buses["placement"], buses[A]
    await a.js.publish(*_event(1))  # a node publishes events: allowed
    before = await _stream(placement, events.STREAM)
    shorter = json.dumps({"name": events.STREAM, "subjects": events.STREAM_SUBJECTS, "max_age": 1_000_000_000,
                          "max_msgs": 1, "storage": "file", "retention": "limits"}).encode()
    attempts = [(f"$JS.API.STREAM.UPDATE.{events.STREAM}", shorter), (f"$JS.API.STREAM.PURGE.{events.STREAM}", b""),
                (f"$JS.API.STREAM.DELETE.{events.STREAM}", b""),
                (f"$JS.API.STREAM.MSG.DELETE.{events.STREAM}", json.dumps({"seq": before[2]}).encode())]
    assert await refused_publishes(url, auth.node(A), attempts) == _lower(attempts)
    assert await _stream(placement, events.STREAM) == before  # nothing changed
    # Creating it is the node's still (a node may start before any service): the same config is no change.
    await ensure_state(a)
    await a.js.publish(*_event(2))
    config, messages, _ = await _stream(placement, events.STREAM)
    assert (config, messages) == (before[0], before[1] + 1)


def _layer(name: str, digest: str) -> Layer:
    return Layer(name=name, digest=digest, size=4096, built_from="test", created_at=time.time())


async def test_a_node_cannot_wipe_or_retune_the_layer_catalogue(bus_url, buses):
    url, auth = bus_url
    placement, a = buses["placement"], buses[A]
    store = await LayerStore.open(a.js)  # the node's layer-cache opens the store: allowed
    kept, doomed = _layer("kept", "sha256:" + "a" * 64), _layer("doomed", "sha256:" + "b" * 64)
    await store.record(kept)
    await store.record(doomed)
    assert store.diffs is not None
    await store.diffs.put("c" * 64, b"{}")
    for bucket in (layers.KV_BUCKET, layers.DIFF_BUCKET):
        info = await placement.js.stream_info(kv_stream(bucket))
        assert not info.config.allow_rollup_hdrs
    before = {b: await _stream(placement, kv_stream(b)) for b in (layers.KV_BUCKET, layers.DIFF_BUCKET)}

    # A rollup on a key A may put would purge every key: both buckets refuse it.
    for bucket in (layers.KV_BUCKET, layers.DIFF_BUCKET):
        with pytest.raises(nats.js.errors.APIError, match="(?i)rollup"):
            await a.js.publish(kv_subject(bucket, "evil"), b"", headers={"Nats-Rollup": "all"})
    attempts = [(f"$JS.API.STREAM.{verb}.{stream}", b"{}") for verb in ("UPDATE", "PURGE", "DELETE")
                for stream in (kv_stream(layers.KV_BUCKET), kv_stream(layers.DIFF_BUCKET))]
    attempts += [(f"$JS.API.STREAM.{verb}.{object_stream(layers.OBJECT_BUCKET)}", b"{}") for verb in ("UPDATE", "DELETE")]
    assert await refused_publishes(url, auth.node(A), attempts) == _lower(attempts)
    assert {b: await _stream(placement, kv_stream(b)) for b in before} == before  # nothing changed
    assert set(await store.all()) == {"kept", "doomed"}

    # A's own work: a layer removed (a delete marker, no rollup), the rest kept, a name recorded again.
    assert (await store.remove(Ref(name="doomed")))[0] == ["doomed"]
    assert set(await store.all()) == {"kept"}
    await store.record(doomed)
    assert (await store.get(Ref(name="doomed"))).digest == doomed.digest


async def test_a_catalogue_made_by_an_older_sandfleet_is_switched_by_a_service(bus_url, buses):
    """nats-py's `create_key_value` allows rollups: a service's start turns that off, keeping the keys."""
    placement, a = buses["placement"], buses[A]
    url, auth = bus_url
    operator = await Bus.connect(url, "admin", creds=auth.admin())
    try:
        await operator.js.delete_stream(kv_stream(layers.DIFF_BUCKET))
        old = await operator.js.create_key_value(KeyValueConfig(bucket=layers.DIFF_BUCKET, history=1,
                                                               storage=StorageType.FILE))
        await old.put("d" * 64, b"{}")
    finally:
        await operator.close()
    assert (await placement.js.stream_info(kv_stream(layers.DIFF_BUCKET))).config.allow_rollup_hdrs
    await ensure_state(placement)
    assert not (await placement.js.stream_info(kv_stream(layers.DIFF_BUCKET))).config.allow_rollup_hdrs
    assert (await (await a.js.key_value(layers.DIFF_BUCKET)).get("d" * 64)).value == b"{}"
    with pytest.raises(nats.js.errors.APIError, match="(?i)rollup"):
        await a.js.publish(kv_subject(layers.DIFF_BUCKET, "evil"), b"", headers={"Nats-Rollup": "all"})


async def test_a_node_cannot_touch_another_users_consumers(bus_url, buses):
    url, auth = bus_url
    placement, a = buses["placement"], buses[A]
    config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                            filter_subject=events.ALL_SANDBOX)
    for stream in (events.STREAM, kv_stream(sandbox.KV_BUCKET)):
        await placement.js.add_consumer(stream, config.evolve(filter_subject=None) if stream != events.STREAM else config)
    await a.js.publish(*_event(3))
    before = {s: await placement.js.consumer_info(s, DURABLE) for s in (events.STREAM, kv_stream(sandbox.KV_BUCKET))}

    # Its own: a KV watch (every listing of the records is one) and an ordered consumer of the events.
    assert await (await SandboxStore.open(a)).all(node_id=A) == []
    sub = await a.js.subscribe(events.ALL_SANDBOX, ordered_consumer=True)
    try:
        assert events.node_of((await sub.next_msg(timeout=10)).subject) == A
    finally:
        await sub.unsubscribe()

    taken = json.dumps({"stream_name": events.STREAM, "config": {"durable_name": DURABLE, "ack_policy": "none",
                                                                  "filter_subject": "events.v1.>"}}).encode()
    attempts = []
    for stream in (events.STREAM, kv_stream(sandbox.KV_BUCKET)):
        attempts += [(f"$JS.API.CONSUMER.DELETE.{stream}.{DURABLE}", b""),
                     (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{DURABLE}", b'{"batch": 1}'),
                     (f"$JS.API.CONSUMER.PAUSE.{stream}.{DURABLE}", b'{"pause_until": "2099-01-01T00:00:00Z"}'),
                     (f"$JS.API.CONSUMER.RESET.{stream}.{DURABLE}", b""),
                     (f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{DURABLE}", b""),
                     (f"$JS.API.CONSUMER.CREATE.{stream}.{DURABLE}", taken),
                     (f"$JS.API.CONSUMER.CREATE.{stream}.{DURABLE}.events.v1.>", taken),
                     (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{DURABLE}", taken),
                     (f"$JS.ACK.{stream}.{DURABLE}.1.1.1.0.0", b"")]
    assert await refused_publishes(url, auth.node(A), attempts) == _lower(attempts)
    # The one create a node may send (an ephemeral, named by the server) cannot name another's.
    for body in (taken, taken.replace(b'"durable_name"', b'"name"')):
        reply = await a.nc.request(f"$JS.API.CONSUMER.CREATE.{events.STREAM}", body, timeout=10)
        assert refusal(reply), reply.data
    after = {s: await placement.js.consumer_info(s, DURABLE) for s in before}
    assert {s: (i.config, i.delivered, i.num_pending) for s, i in after.items()} == {
        s: (i.config, i.delivered, i.num_pending) for s, i in before.items()}
    for stream in before:
        await placement.js.delete_consumer(stream, DURABLE)

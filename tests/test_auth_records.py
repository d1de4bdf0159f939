"""A node writes only its own sandbox records, on a real nats-server with the accounts and node
credentials `sandfleet up` makes (sandfleet/bus_accounts.py).

Node A tries every way to change node B's records: B's record key, an unwritten member of B's
batch, the batch record itself, a rollup that would purge the bucket, the bucket's stream
config. Each is refused and nothing changes; a record A puts under its own name for B's sandbox
is never what a reader gets. A's own records (a claimed spare's, as the warm pool writes them)
are written, moved and forgotten as before.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest

from sandfleet import errors
from sandfleet.bus import Bus, encode
from sandfleet.bus_accounts import AuthDir
from sandfleet.credentials import CredentialsError, read_seed
from sandfleet.jetstream import kv_stream, kv_subject, refusal
from sandfleet.store import SandboxStore, ensure_state
from schemas import node, sandbox
from schemas.sandbox import SandboxBatch, SandboxRecord, SandboxSpec, State
from tests.conftest import NODE_ID
from tests.natsd import authed_nats_server

pytestmark = pytest.mark.timeout(120)
A, B = f"{NODE_ID}-a", f"{NODE_ID}-b"
RECORDS = kv_stream(sandbox.KV_BUCKET)


@pytest.fixture(scope="module")
def bus_url(tmp_path_factory) -> Iterator[tuple[str, AuthDir]]:
    with authed_nats_server(tmp_path_factory.mktemp("records-auth"), [A, B]) as found:
        yield found


@pytest.fixture
async def stores(bus_url) -> AsyncIterator[dict[str, SandboxStore]]:
    """Placement's store (a service user, which makes the buckets) and each node's."""
    url, auth = bus_url
    buses = {"placement": await Bus.connect(url, "placement", creds=auth.service("placement"))}
    await ensure_state(buses["placement"])
    for n in (A, B):
        buses[n] = await Bus.connect(url, n, creds=auth.node(n))
        await ensure_state(buses[n])  # as every node service does at its start: allowed, and changes nothing
    yield {name: await SandboxStore.open(bus) for name, bus in buses.items()}
    for bus in buses.values():
        await bus.close()


async def _raw(url: str, creds: Path, refusals: list[str]) -> nats.NATS:
    async def error_cb(exc: Exception) -> None:
        refusals.append(str(exc))

    return await nats.connect(url, allow_reconnect=False, error_cb=error_cb, nkeys_seed_str=read_seed(creds))


def _spec() -> SandboxSpec:
    return SandboxSpec(cpu=0.1, memory_mb=64)


async def _placed_on_b(placement: SandboxStore, count: int) -> SandboxBatch:
    token = secrets.token_hex(sandbox.BATCH_TOKEN_HEX // 2)
    batch = SandboxBatch(token=token, node=B, spec=_spec(), count=count, created_at=time.time(), tenant="bob")
    await placement.create_batches([batch])
    return batch


def _spare(node_id: str, n: int) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(id=f"sb-{node_id[-1]}{n:011x}", node=node_id, spec=_spec(), state=State.SCHEDULED,
                         created_at=now, updated_at=now, tenant="bob")


async def _stream(store: SandboxStore) -> tuple[int, int]:
    state = (await store.bus.js.stream_info(RECORDS)).state
    return state.messages, state.last_seq


async def test_a_node_cannot_change_another_nodes_records(bus_url, stores):
    url, auth = bus_url
    placement, b = stores["placement"], stores[B]
    batch = await _placed_on_b(placement, 2)
    written, unwritten = batch.ids()
    await b.transition(written, State.STARTING)  # B's own record of member 0; member 1 as its batch says
    [spare] = await b.create_many([_spare(B, 1)])  # a claimed spare: B's own record, no batch
    before = {i: await placement.get(i) for i in (written, unwritten, spare[0].id)}
    stream_before = await _stream(placement)

    refusals: list[str] = []
    conn = await _raw(url, auth.node(A), refusals)
    forged = json.dumps({"id": written, "node": A, "spec": {"cpu": 0.1, "memory_mb": 64}, "state": "running",
                         "created_at": 1.0, "updated_at": 1.0, "tenant": "mallory"}).encode()
    refused_subjects = [
        kv_subject(sandbox.KV_BUCKET, sandbox.record_key(B, written)),  # B's record
        kv_subject(sandbox.KV_BUCKET, sandbox.record_key(B, unwritten)),  # its first write, before B's
        kv_subject(sandbox.KV_BUCKET, sandbox.record_key(B, spare[0].id)),
        kv_subject(sandbox.KV_BUCKET, sandbox.batch_key(batch.token)),  # the batch record
        kv_subject(sandbox.KV_BUCKET, written),  # the key the records had before they were node-keyed
        f"$JS.API.STREAM.UPDATE.{RECORDS}", f"$JS.API.STREAM.PURGE.{RECORDS}", f"$JS.API.STREAM.DELETE.{RECORDS}",
        f"$JS.API.STREAM.MSG.DELETE.{RECORDS}", f"$JS.API.STREAM.UPDATE.{kv_stream(node.KV_BUCKET)}",
        kv_subject(node.KV_BUCKET, B),  # B's heartbeat
    ]
    try:
        for subject in refused_subjects:
            await conn.publish(subject, forged, reply=conn.new_inbox())
        await conn.flush()
        for _ in range(100):  # the server's -ERRs come before its answer to the flush; their callbacks, soon after
            if len(refusals) >= len(refused_subjects):
                break
            await asyncio.sleep(0.05)
        said = {r.split('"')[1] for r in refusals if "permissions violation for publish" in r.lower()}
        assert said == {s.lower() for s in refused_subjects}  # (nats-py lowercases the error)
        # A rollup on a key A may put would purge every record: the bucket refuses rollups.
        [reply] = await stores[A].jetstream.burst(
            [(kv_subject(sandbox.KV_BUCKET, sandbox.record_key(A, "sb-rollup")), b"", {"Nats-Rollup": "all"})], 10)
        assert "rollup" in refusal(reply).lower()
    finally:
        await conn.close()
    assert await _stream(placement) == stream_before  # nothing stored
    assert {i: await placement.get(i) for i in before} == before

    # Records A puts under its own name for B's sandboxes (it may put those keys) are no reader's
    # record: B's batch names B; a reader that read the spare before keeps reading B's key, and
    # to one that did not, an id under two nodes' keys is no one's.
    a = stores[A]
    for victim in (written, unwritten, spare[0].id):
        record = msgspec.structs.replace(before[victim][0], node=A, tenant="mallory", state=State.RUNNING)
        revisions, refused = await a.jetstream.kv_write_many(
            sandbox.KV_BUCKET, [(sandbox.record_key(A, victim), encode(record), 0)], 10)
        assert revisions[0] and not refused, refused
    fresh = SandboxStore(placement.bus, placement.kv)  # knows no node of any id yet
    for reader in (placement, fresh):
        assert (await reader.get(written)) == before[written]
        assert (await reader.get(unwritten)) == before[unwritten]  # still as its batch says: B's to write first
    assert (await placement.get(spare[0].id)) == before[spare[0].id]
    with pytest.raises(errors.ServiceError) as no_one:
        await fresh.get(spare[0].id)
    assert no_one.value.code.value == "not_found"
    assert {r.id: r.node for r in await fresh.all()
            if r.id in before} == {written: B, unwritten: B}  # the spare's is no one's
    # B still writes its own, the first write of the member A tried to take included.
    assert (await b.transition(unwritten, State.STARTING)).node == B
    assert (await placement.get(unwritten))[0].state is State.STARTING


async def test_a_nodes_own_records_are_written_moved_and_forgotten(stores):
    a, placement = stores[A], stores["placement"]
    [(record, revision)] = await a.create_many([_spare(A, 2)])  # as the warm pool records a claimed spare
    assert revision > 0
    assert (await a.transition(record.id, State.STARTING)).state is State.STARTING
    await a.update(record.id, lambda r: msgspec.structs.replace(r, init_pid=42))
    running = await a.transition(record.id, State.RUNNING)
    assert (running.state, running.init_pid) == (State.RUNNING, 42)
    assert (await placement.get(record.id))[0] == running  # a reader finds it by id alone
    assert [r.id for r in await a.all(node_id=A)] == [record.id]
    await a.transition(record.id, State.STOPPING)
    await a.transition(record.id, State.STOPPED)
    await a.forget(record.id)
    with pytest.raises(errors.ServiceError):
        await placement.get(record.id)
    # A member of a batch on A: its first write, then the rest, all A's own.
    token = secrets.token_hex(sandbox.BATCH_TOKEN_HEX // 2)
    batch = SandboxBatch(token=token, node=A, spec=_spec(), count=3, created_at=time.time())
    await placement.create_batches([batch])
    moved = await a.transition_many(batch.ids(), State.STARTING)
    assert [r.state for r in moved] == [State.STARTING] * 3  # type: ignore[union-attr]
    assert {r.id for r in await placement.all(node_id=A)} == set(batch.ids())


def test_no_node_may_be_called_batch(tmp_path):
    """Its record keys would be placement's batch records."""
    with pytest.raises(CredentialsError):
        AuthDir.of(tmp_path).node(sandbox.BATCH_KEY_NODE)


async def test_records_of_the_layout_before_are_moved_to_their_nodes_keys(stores):
    """A platform upgraded with sandboxes on it: their records, keyed by id alone, are found
    again once placement has moved them (`rekey`), and a node's write since is not undone."""
    placement = stores["placement"]
    old = [_spare(B, 100 + n) for n in range(3)]
    revisions, refused = await placement.jetstream.kv_write_many(
        sandbox.KV_BUCKET, [(r.id, encode(r), 0) for r in old], 10)
    assert all(revisions) and not refused
    fresh = SandboxStore(placement.bus, placement.kv)
    assert await fresh.read_many([r.id for r in old]) == {}  # readers look under node keys only
    newer = msgspec.structs.replace(old[0], state=State.STARTING, seq=2)  # B wrote its new key already
    await stores[B].jetstream.kv_write_many(sandbox.KV_BUCKET, [(sandbox.record_key(B, newer.id), encode(newer), 0)], 10)
    assert await placement.rekey() == 2
    assert await placement.rekey() == 0  # nothing left under the old keys
    found = await SandboxStore(placement.bus, placement.kv).read_many([r.id for r in old])
    assert {i: r for i, (r, _) in found.items()} == {newer.id: newer, **{r.id: r for r in old[1:]}}
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await placement.kv.get(old[1].id)

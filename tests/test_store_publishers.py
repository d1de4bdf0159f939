"""The store's event publishers on a real nats-server of their own: the JetStream one stores each
move's event as `event_publisher.messages` spells it, the same one way whether a sandbox moved
alone or in a batch; the null one lets records change with no event stored."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import pytest

from sandfleet.bus import Bus
from sandfleet.event_publisher import NullEventPublisher, messages
from sandfleet.records import first, lifecycle_event
from sandfleet.store import BatchRefused, SandboxStore, ensure_state
from schemas import events
from schemas.sandbox import SandboxRecord, SandboxSpec, State
from tests.natsd import bare_nats_server


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory) -> Iterator[str]:
    with bare_nats_server(tmp_path_factory.mktemp("publishers") / "js") as url:
        yield url


@pytest.fixture
async def bus(nats_url) -> AsyncIterator[Bus]:
    bus = await Bus.connect(nats_url, "publishers-test")
    await ensure_state(bus)
    yield bus
    await bus.close()


def _new(n: int, tag: str) -> list[SandboxRecord]:
    now = time.time()
    return [SandboxRecord(id=f"sb-{tag}-{i}", node="n1", spec=SandboxSpec(cpu=0.1, memory_mb=64),
                          state=State.SCHEDULED, created_at=now, updated_at=now) for i in range(n)]


async def _stored(bus: Bus, sandbox_id: str) -> list[tuple[str, bytes, str]]:
    """Every event the stream holds for the sandbox, oldest first: subject, body, de-duplication id."""
    info = await bus.js.stream_info(events.STREAM, subjects_filter=events.sandbox_filter(sandbox_id))
    got = []
    for subject, count in (info.state.subjects or {}).items():
        assert count == 1, f"{count} events on {subject}"  # one event per state reached
        msg = await bus.js.get_last_msg(events.STREAM, subject)
        got.append((msg.seq, subject, msg.data, (msg.headers or {}).get("Nats-Msg-Id", "")))
    return [(subject, data, msg_id) for _, subject, data, msg_id in sorted(got)]


async def test_events_of_moves_alone_and_in_a_batch_are_stored_alike(bus):
    store = await SandboxStore.open(bus)
    alone, batched = _new(1, "alone") + _new(1, "batched")
    await store.create(alone)
    await store.create_many([batched])
    await store.transition(alone.id, State.RUNNING)
    await store.transition_many([batched.id], State.RUNNING)
    for record in (alone, batched):
        running, _ = await store.get(record.id)
        expected = messages([first(record)[1], lifecycle_event(running, State.SCHEDULED)])
        stored = await _stored(bus, record.id)
        assert stored == [(subject, body, headers["Nats-Msg-Id"]) for subject, body, headers in expected]
        assert [i for _, _, i in stored] == [f"{record.id}:1", f"{record.id}:2"]


async def test_a_batch_of_events_sent_again_is_stored_once(bus):
    store = await SandboxStore.open(bus)
    created = await store.create_many(_new(3, "again"))
    moved = await store.transition_many([r.id for r, _ in created], State.RUNNING)
    again = [lifecycle_event(r, State.SCHEDULED) for r in moved]  # type: ignore[arg-type]
    await store.publisher.publish_many(again, 10.0)  # a retried batch, e.g. after a lost ack
    for record, _ in created:
        assert [i for _, _, i in await _stored(bus, record.id)] == [f"{record.id}:1", f"{record.id}:2"]


async def test_a_store_with_the_null_publisher_changes_records_and_stores_no_event(bus):
    quiet = SandboxStore(bus, (await SandboxStore.open(bus)).kv, NullEventPublisher())
    one, *batch = _new(3, "quiet")
    await quiet.create(one)
    await quiet.create_many(batch)
    await quiet.transition(one.id, State.STARTING)
    await quiet.transition_many([r.id for r in batch], State.RUNNING)
    assert [(await quiet.get(r.id))[0].state for r in [one, *batch]] == [State.STARTING, State.RUNNING, State.RUNNING]
    for record in [one, *batch]:
        assert await _stored(bus, record.id) == []


async def test_records_stored_before_their_events_get_them_only_when_announced(bus):
    store = await SandboxStore.open(bus)
    batch = _new(3, "later")
    stored, announce = await store.record_many(batch)
    assert [(await store.get(r.id)) for r in batch] == stored  # written, with their revisions
    assert [await _stored(bus, r.id) for r in batch] == [[]] * 3  # no event yet
    await announce()
    for record in batch:
        assert [i for _, _, i in await _stored(bus, record.id)] == [f"{record.id}:1"]


async def test_a_refused_record_gets_no_event_and_the_written_ones_of_its_batch_get_theirs(bus):
    store = await SandboxStore.open(bus)
    (existing,) = _new(1, "taken")
    await store.create(existing)
    fresh = _new(2, "besides")
    with pytest.raises(BatchRefused) as refused:
        await store.record_many([fresh[0], existing, fresh[1]])
    assert list(refused.value.refused) == [existing.id]
    for record in fresh:
        assert [i for _, _, i in await _stored(bus, record.id)] == [f"{record.id}:1"]
    assert [i for _, _, i in await _stored(bus, existing.id)] == [f"{existing.id}:1"]  # its own, once

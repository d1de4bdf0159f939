"""The record state machine (sandfleet.records), how an event is stored (sandfleet.event_publisher),
and the JetStream batch client's reply demultiplexer, without a bus: pure functions, and replies
handed to the demultiplexer as the connection's reader would hand them."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.aio.msg import Msg

from sandfleet import errors, records
from sandfleet.event_publisher import messages
from sandfleet.jetstream import BatchedJetStream, _Batch, _Burst, _Ingest, refusal
from sandfleet.record_keys import resolve, unwritten
from schemas import events
from schemas.errors import ErrorCode
from schemas.sandbox import (TRANSITIONS, Reason, SandboxBatch, SandboxRecord, SandboxSpec, State, record_key,
                             record_key_parts)


def _record(state: State, seq: int = 4, **fields) -> SandboxRecord:  # type: ignore[no-untyped-def]
    return SandboxRecord(id="sb-1", node="n1", spec=SandboxSpec(cpu=0.5, memory_mb=64), state=state,
                         created_at=1.0, updated_at=2.0, seq=seq, reason=Reason.EXPIRED, detail="before", **fields)


LEGAL = [(s, n) for s, allowed in TRANSITIONS.items() for n in sorted(allowed)]  # sorted: xdist workers must collect alike
ILLEGAL = [(s, n) for s in State for n in State if n is not s and n not in TRANSITIONS[s]]


@pytest.mark.parametrize(("state", "new"), LEGAL)
def test_a_legal_move_sets_the_state_counts_the_event_and_yields_the_event_of_that_move(state, new):
    move = records.advance(_record(state), new, 9.5, Reason.VIOLATION, "why")
    assert move is not None
    record, event = move
    assert record == msgspec.structs.replace(_record(state), state=new, reason=Reason.VIOLATION, detail="why",
                                             updated_at=9.5, seq=5)
    assert type(event) is events.event_type(state, new)
    assert (event.sandbox_id, event.node, event.state, event.seq, event.at, event.reason, event.detail) == (
        "sb-1", "n1", new, 5, 9.5, Reason.VIOLATION, "why")


@pytest.mark.parametrize(("state", "new"), ILLEGAL)
def test_an_illegal_move_is_refused_as_a_conflict_that_names_both_states(state, new):
    with pytest.raises(errors.ServiceError) as refused:
        records.advance(_record(state), new, 3.0)
    assert refused.value.code is ErrorCode.CONFLICT
    assert refused.value.message == f"sandbox sb-1 is {state.value}, cannot become {new.value}"


@pytest.mark.parametrize("state", list(State))
def test_a_move_to_the_state_it_is_in_writes_nothing_and_publishes_nothing(state):
    assert records.advance(_record(state), state, 9.5, Reason.VIOLATION, "other") is None


def test_a_return_from_paused_is_resumed_and_a_first_run_is_started():
    assert records.advance(_record(State.PAUSED), State.RUNNING, 3.0)[1].name == "resumed"  # type: ignore[index]
    assert records.advance(_record(State.STARTING), State.RUNNING, 3.0)[1].name == "started"  # type: ignore[index]


def test_a_move_from_a_state_outside_only_from_is_refused_though_the_state_machine_allows_it():
    started = _record(State.RUNNING)
    with pytest.raises(errors.ServiceError) as refused:
        records.advance(started, State.FAILED, 3.0, Reason.LAUNCH_FAILED, only_from=frozenset({State.SCHEDULED}))
    assert refused.value.code is ErrorCode.CONFLICT
    assert records.advance(_record(State.SCHEDULED), State.FAILED, 3.0, only_from=frozenset({State.SCHEDULED})) is not None


def test_the_change_is_made_to_the_moved_record_before_its_event_is_made():
    move = records.advance(_record(State.SCHEDULED), State.STARTING, 3.0,
                           change=lambda r: msgspec.structs.replace(r, node="n2", detail=r.detail + "+", init_pid=7))
    assert move is not None
    record, event = move
    assert (record.node, record.detail, record.init_pid, record.seq) == ("n2", "+", 7, 5)
    assert (event.node, event.detail) == ("n2", "+")


def test_a_new_record_is_stored_as_event_one_whatever_seq_it_came_with():
    record, event = records.first(_record(State.SCHEDULED, seq=9))
    assert record.seq == 1 and record.state is State.SCHEDULED
    assert type(event) is events.Scheduled and event.seq == 1 and event.at == 2.0


def test_a_sandbox_never_recorded_ends_with_the_failed_event_its_first_record_would_have_had():
    event = records.unrecorded_end(_record(State.SCHEDULED, seq=0), Reason.LAUNCH_FAILED, "lost", 8.0)
    assert type(event) is events.Failed
    assert (event.seq, event.state, event.reason, event.detail, event.at) == (2, State.FAILED, Reason.LAUNCH_FAILED,
                                                                              "lost", 8.0)


def test_an_event_is_stored_on_its_subject_with_the_id_and_body_it_always_had():
    # The wire, spelled out: consumers and the stream's de-duplication depend on each byte. v2
    # added the tenant, in the subject (`_` for none) and the body; v3 the node, in the subject.
    move = records.advance(_record(State.PAUSED), State.RUNNING, 5.5)
    assert move is not None
    assert messages([move[1]]) == [(
        "events.v3.sandbox._.n1.sb-1.resumed",
        b'{"type":"sandbox.resumed","v":3,"sandbox_id":"sb-1","node":"n1","tenant":"","state":"running","seq":5,'
        b'"at":5.5,"reason":"none","detail":""}',
        {"Nats-Msg-Id": "sb-1:5"},
    )]
    owned = records.advance(msgspec.structs.replace(_record(State.PAUSED), tenant="team-a"), State.RUNNING, 5.5)
    assert owned is not None and messages([owned[1]])[0][0] == "events.v3.sandbox.team-a.n1.sb-1.resumed"
    placements = records.advance(msgspec.structs.replace(_record(State.PAUSED), node=""), State.RUNNING, 5.5)
    assert placements is not None and messages([placements[1]])[0][0] == "events.v3.sandbox._._.sb-1.resumed"


# -- the reply demultiplexer -----------------------------------------------------------------

PREFIX = "_INBOX.test"


def _client() -> BatchedJetStream:
    js = BatchedJetStream(bus=None)  # type: ignore[arg-type]  # replies are handed in below, nothing is sent
    js._mux_prefix = PREFIX
    return js


def _reply(subject: str, data: bytes = b"", headers: dict[str, str] | None = None) -> Msg:
    return Msg(_client=None, subject=subject, data=data, headers=headers)  # type: ignore[arg-type]


def _waiting(js: BatchedJetStream, token: str, waiting: _Burst | _Ingest | _Batch) -> None:
    js._waiting[token] = waiting


async def test_a_bursts_replies_are_put_in_order_and_each_counted_once():
    js = _client()
    burst = _Burst(replies=[None] * 3, left=3, done=asyncio.get_running_loop().create_future())
    _waiting(js, "7", burst)
    for n in (2, 0, 0, 9, -1):  # out of order, a duplicate, one out of range, one not a number
        js._on_reply(_reply(f"{PREFIX}.7.{n}", f'{{"seq":{n}}}'.encode()))
    js._on_reply(_reply(f"{PREFIX}.8.1", b"{}"))  # another exchange's, or one that gave up
    assert not burst.done.done() and burst.left == 1
    js._on_reply(_reply(f"{PREFIX}.7.1", b'{"seq":1}'))
    assert burst.done.done() and [m.data for m in burst.replies] == [b'{"seq":0}', b'{"seq":1}', b'{"seq":2}']


async def test_a_direct_get_batch_collects_messages_until_its_status():
    js = _client()
    batch = _Batch(done=asyncio.get_running_loop().create_future())
    _waiting(js, "3", batch)
    js._on_reply(_reply(f"{PREFIX}.3.0", b"a", {"Nats-Subject": "$KV.b.k1"}))
    js._on_reply(_reply(f"{PREFIX}.3.0", b"b", {"Nats-Subject": "$KV.b.k2"}))
    assert not batch.done.done()
    js._on_reply(_reply(f"{PREFIX}.3.0", b"", {"Status": "204", "Description": "EOB"}))
    js._on_reply(_reply(f"{PREFIX}.3.0", b"", {"Status": "408"}))  # after the end: ignored
    assert batch.done.done() and [m.data for m in batch.found] == [b"a", b"b"] and batch.status == "204"


@pytest.mark.parametrize(("frames", "error"), [
    ([b'{"type":"ack","seq":1}', b'{"stream":"EVENTS","count":3}'], ""),
    ([b'{"stream":"EVENTS","count":2}'], "the batch ended after 2 of 3 messages"),
    ([b'{"type":"err","error":{"code":400,"err_code":10205,"description":"batch publish is disabled"}}',
      b'{"stream":"EVENTS","count":0,"error":{"code":400,"err_code":10205}}'], "disabled"),
    ([b'{"stream":"EVENTS","error":{"code":400,"err_code":10199,"description":"batch too large"}}'],
     "batch too large (10199)"),
])
async def test_a_fast_ingest_batch_ends_at_its_terminal_frame_with_its_first_error(frames, error):
    js = _client()
    ingest = _Ingest(size=3, done=asyncio.get_running_loop().create_future())
    _waiting(js, "5", ingest)
    for frame in frames:
        assert not ingest.done.done()
        js._on_reply(_reply(f"{PREFIX}.5.abc5.3.fail.3.2.$FI", frame))
    assert ingest.done.done() and ingest.error == error


def test_a_refusal_is_an_error_reply_or_a_status_and_an_ack_is_neither():
    assert refusal(_reply("r", b'{"stream":"KV_sandboxes","seq":12}')) == ""
    assert refusal(_reply("r", b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}}')
                   ).startswith('{"error"')
    assert refusal(_reply("r", b"", {"Status": "503"})) == "status 503"


def test_a_record_is_read_only_under_the_key_of_the_node_trusted_with_it():
    """`record_keys.resolve`: the batch's node, else the only holder; a copy under a second node's
    key leaves the id to no one; a value naming another node than its key is not trusted."""
    spec = SandboxSpec(cpu=0.1, memory_mb=64)
    batch = SandboxBatch(token="0123456789", node="b", spec=spec, count=3, created_at=1.0)
    member, unwritten_member, forgotten = batch.ids()

    def entry(sandbox_id: str, node: str, revision: int = 5) -> tuple[SandboxRecord, int]:
        return SandboxRecord(id=sandbox_id, node=node, spec=spec, state=State.RUNNING, created_at=1.0,
                             updated_at=1.0), revision

    own = {record_key("b", member): entry(member, "b"), record_key("a", member): entry(member, "a"),
           record_key("a", unwritten_member): entry(unwritten_member, "a"),
           record_key("a", forgotten): entry(forgotten, "a"),
           record_key("b", "sb-spare"): entry("sb-spare", "b"), record_key("a", "sb-copied"): entry("sb-copied", "a"),
           record_key("b", "sb-copied"): entry("sb-copied", "b"), record_key("c", "sb-lying"): entry("sb-lying", "b")}
    resolved = resolve(own, [record_key("b", forgotten)], {batch.token: batch})
    assert {i: r.node for i, (r, _) in resolved.records.items()} == {member: "b", "sb-spare": "b"}
    assert resolved.gone == {forgotten}
    assert resolved.nodes == {member: "b", unwritten_member: "b", forgotten: "b", "sb-spare": "b", "sb-lying": "c"}
    assert unwritten(batch.ids(), resolved, {batch.token: batch}) == {unwritten_member: (batch.record(1), 0)}
    assert record_key_parts(record_key("n1", "sb-x")) == ("n1", "sb-x")
    assert record_key_parts("batch.0123456789") is None and record_key_parts("sb-x") is None

"""A gang batch's wait believes a sandbox's outcome from its own node (or placement) only, before
placement's answer as after it (sandfleet/_batch_outcomes.py; no bus)."""

from __future__ import annotations

from sandfleet._batch_outcomes import BatchOutcomes
from schemas import events
from schemas.sandbox import State


def _outcome(sandbox_id: str, node: str, state: State = State.RUNNING) -> events.SandboxEvent:
    kind = events.Started if state is State.RUNNING else events.Failed
    return kind(sandbox_id=sandbox_id, node=node, state=state, seq=3, at=1.0)


def test_an_outcome_heard_before_the_answer_counts_only_if_its_node_is_the_sandboxs():
    batch = BatchOutcomes()
    assert not batch.heard(_outcome("sb-1", "n2", State.FAILED))  # a forger's, first
    assert not batch.heard(_outcome("sb-1", "n1"))  # the sandbox's own node's
    assert not batch.heard(_outcome("sb-2", "n1", State.FAILED))
    assert not batch.heard(_outcome("sb-9", "n1"))  # another batch's
    batch.placed({"sb-1": "n1", "sb-2": "n1", "sb-3": "n1"})
    assert {i: e.state for i, e in batch.outcome.items()} == {"sb-1": State.RUNNING, "sb-2": State.FAILED}
    assert batch.tally == {State.RUNNING: 1, State.FAILED: 1}


def test_after_the_answer_another_nodes_word_is_ignored_and_the_first_believed_stays():
    batch = BatchOutcomes()
    batch.placed({"sb-1": "n1", "sb-2": "n1"})
    assert not batch.heard(_outcome("sb-1", "n2", State.FAILED))
    assert batch.heard(_outcome("sb-1", "n1"))
    assert not batch.heard(_outcome("sb-1", "n1", State.FAILED))  # one outcome each
    assert batch.heard(_outcome("sb-2", "", State.FAILED))  # placement's token: its word
    assert not batch.heard(_outcome("sb-7", "n1"))
    assert {i: (e.node, e.state) for i, e in batch.outcome.items()} == {"sb-1": ("n1", State.RUNNING),
                                                                        "sb-2": ("", State.FAILED)}


def test_an_event_is_vouched_for_by_its_subject_and_its_sandboxs_node():
    event = _outcome("sb-1", "n1")
    assert event.subject == "events.v3.sandbox._.n1.sb-1.started"
    assert events.vouched(event, event.subject) and events.vouched(event, event.subject, "n1")
    assert not events.vouched(event, event.subject, "n2")  # n1 speaking of n2's sandbox
    assert not events.vouched(event, events.sandbox_subject("sb-1", "started", events.NO_TENANT, "n2"))  # a body lying
    placements = _outcome("sb-1", "")
    assert placements.subject == "events.v3.sandbox._._.sb-1.started"
    assert events.node_of(placements.subject) == "" and events.vouched(placements, placements.subject, "n1")
    assert events.sandbox_id_of(event.subject) == "sb-1" and events.node_of(event.subject) == "n1"

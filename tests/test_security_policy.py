"""The security monitor's decisions without a bus: which count a violation adds to, when a
threshold triggers the task's action, and that a violation delivered twice counts once."""

from __future__ import annotations

import msgspec
import pytest

from schemas.security import Policy, SandboxSecurity
from schemas.violations import Violation
from services.security_monitor import policy as rules


def violation(kind: str = "network.connect", sandbox_id: str = "sb-1", task: str = "t1") -> Violation:
    return Violation(node="n1", sandbox_id=sandbox_id, kind=kind, pid=7, command="python3",
                     attempted=f"{kind} attempt", at=1.0, labels={"task": task})


def feed(policy: Policy, kinds: list[str], start_seq: int = 1) -> SandboxSecurity:
    record = SandboxSecurity(sandbox_id="sb-1")
    for seq, kind in enumerate(kinds, start_seq):
        record = rules.count(record, violation(kind), seq, policy, now=float(seq)) or record
    return record


def test_the_longest_matching_prefix_is_the_count_key_and_unmatched_kinds_count_under_their_layer():
    thresholds = {"network": 3, "network.dns": 1}
    assert rules.count_key("network.connect", thresholds) == "network"
    assert rules.count_key("network.dns", thresholds) == "network.dns"
    assert rules.count_key("networking.x", thresholds) == "networking"  # a prefix is whole tokens
    assert rules.count_key("file.landlock", thresholds) == "file"


def test_kill_is_pending_only_when_the_third_network_violation_arrives():
    policy = Policy(task="t1", action="kill", thresholds={"network": 3})
    two = feed(policy, ["network.connect", "network.sendmsg"])
    assert (two.counts, two.action_state) == ({"network": 2}, "none")
    three = feed(policy, ["network.connect", "network.sendmsg", "network.connect"])
    assert (three.counts["network"], three.action, three.action_state) == (3, "kill", "pending")
    assert three.trigger == "network"


def test_kinds_without_a_threshold_use_the_default_and_zero_never_acts():
    policy = Policy(task="t1", action="quarantine", thresholds={"network": 0}, default_threshold=2)
    assert feed(policy, ["network.connect"] * 10).action_state == "none"
    record = feed(policy, ["file.landlock", "file.sensitive"])
    assert (record.action, record.action_state, record.trigger) == ("quarantine", "pending", "file")


def test_record_policy_counts_but_never_acts():
    record = feed(Policy(task="t1"), ["network.connect"] * 5 + ["syscall.ptrace"])
    assert record.counts == {"network": 5, "syscall": 1} and record.total == 6
    assert record.action_state == "none"


def test_a_redelivered_violation_is_counted_once():
    policy = Policy(task="t1", action="kill", thresholds={"network": 2})
    record = feed(policy, ["network.connect"])
    assert rules.count(record, violation(), 1, policy, now=5.0) is None  # same stream sequence
    assert feed(policy, ["network.connect"]).counts == {"network": 1}


def test_violations_handled_out_of_order_by_two_replicas_are_all_counted():
    policy = Policy(task="t1")
    record = SandboxSecurity(sandbox_id="sb-1")
    for seq in (5, 3, 4):
        record = rules.count(record, violation(), seq, policy, now=1.0)
    assert record.counts == {"network": 3} and record.seen == [3, 4, 5]


def test_the_seen_window_is_bounded_and_older_sequences_count_as_seen():
    policy = Policy(task="t1")
    record = feed(policy, ["network.connect"] * (rules.SEEN_KEEP + 10), start_seq=100)
    assert len(record.seen) == rules.SEEN_KEEP and len(record.recent) == rules.RECENT_KEEP
    assert rules.count(record, violation(), 100, policy, now=1.0) is None


def test_an_action_is_decided_once_even_if_the_policy_changes_later():
    kill = Policy(task="t1", action="kill", thresholds={"network": 1})
    record = feed(kill, ["network.connect"])
    done = msgspec.structs.replace(record, action_state="done")
    quarantine = Policy(task="t1", action="quarantine", default_threshold=1)
    after = rules.count(done, violation("file.landlock"), 2, quarantine, now=2.0)
    assert (after.action, after.action_state, after.counts) == ("kill", "done", {"network": 1, "file": 1})


def test_the_action_event_carries_the_violations_that_counted_toward_it():
    policy = Policy(task="t1", action="kill", thresholds={"network": 2}, default_threshold=0)
    record = feed(policy, ["network.connect", "file.landlock", "network.sendmsg"])
    event = rules.action_event(record, policy, "done", now=9.0)
    assert [v.kind for v in event.violations] == ["network.connect", "network.sendmsg"]
    assert (event.action, event.trigger, event.count, event.threshold, event.task) == ("kill", "network", 2, 2, "t1")
    assert "kill after 2 network violation(s)" in rules.detail(record)


@pytest.mark.parametrize("raw", [
    {"task": "t1", "action": "nuke"},
    {"task": "t1", "thresholds": {"network": -1}},
    {"task": "t1", "thresholds": {"Network!": 3}},
    {"task": "", "action": "kill"},
    {"task": "t1", "colour": "red"},
])
def test_bad_policies_do_not_decode(raw):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(raw, Policy)

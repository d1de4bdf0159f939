"""Which outcomes (`started`, `failed`) a gang batch in flight believes, without I/O.

The SDK follows one subscription for every batch in flight. Before placement's answer names the
batch's sandboxes and their nodes, each outcome heard is kept by (id, node); after it, only an
outcome of one of the batch's sandboxes said by its own node (or by placement, under its
reserved token) counts, the first one each. The node is the one the event's subject names,
which the server checked against its publisher (the subscriber drops an event whose body says
otherwise: `schemas.events.vouched`), so another node's word about a sandbox that is not its own
is never believed, however early it comes. Unit-tested in tests/test_batch_outcomes.py.
"""

from __future__ import annotations

from schemas.events import SandboxEvent
from schemas.sandbox import State


class BatchOutcomes:
    def __init__(self) -> None:
        self.where: dict[str, str] = {}  # id → node, once placement has answered
        self.outcome: dict[str, SandboxEvent] = {}  # id → its believed outcome
        self.tally = {State.RUNNING: 0, State.FAILED: 0}
        self._early: dict[tuple[str, str], SandboxEvent] = {}  # (id, node) → the first heard, before the answer

    def heard(self, event: SandboxEvent) -> bool:
        """Take an outcome (of any batch); True if it counted for this one."""
        if not self.where:
            self._early.setdefault((event.sandbox_id, event.node), event)
            return False
        if event.sandbox_id in self.outcome or not self._believed(event):
            return False
        self._count(event)
        return True

    def placed(self, where: dict[str, str]) -> None:
        """Placement's answer: the batch's sandboxes and their nodes. What was heard before it is
        sorted out now (the rest was another batch's, or forged)."""
        self.where.update(where)
        for key in self.where.items():
            first = self._early.get(key) or self._early.get((key[0], ""))
            if first is not None:
                self._count(first)
        self._early.clear()

    def _believed(self, event: SandboxEvent) -> bool:
        node = self.where.get(event.sandbox_id)
        return node is not None and event.node in (node, "")

    def _count(self, event: SandboxEvent) -> None:
        self.outcome[event.sandbox_id] = event
        self.tally[event.state] += 1

"""Choosing nodes: pure functions over the node registry, no I/O.

A node is eligible when its heartbeat is fresh and it advertises the isolation level; among
eligible nodes, sandboxes go to the one with the most free slots, counting what this
replica has already sent it since its last heartbeat so a burst does not pile onto one node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.node import NODE_TTL_S, NodeInfo


class NoEligibleNode(Exception):
    """No node can run this isolation level at all (as opposed to: all are full)."""


class NoCapacity(Exception):
    pass


@dataclass
class NodeView:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    sent_since_heartbeat: dict[str, int] = field(default_factory=dict)

    def heartbeat(self, info: NodeInfo) -> None:
        self.nodes[info.id] = info
        self.sent_since_heartbeat[info.id] = 0

    def forget(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        self.sent_since_heartbeat.pop(node_id, None)

    def free(self, node_id: str) -> int:
        info = self.nodes[node_id]
        return info.capacity - info.running - self.sent_since_heartbeat.get(node_id, 0)

    def eligible(self, isolation: str, now: float) -> list[str]:
        alive = [n for n, info in self.nodes.items() if now - info.at <= NODE_TTL_S]
        capable = [n for n in alive if isolation in self.nodes[n].isolation]
        if not capable:
            levels = sorted({lvl for n in alive for lvl in self.nodes[n].isolation})
            if not alive:
                raise NoCapacity("no node is registered")
            raise NoEligibleNode(f"no node can run isolation {isolation!r}; nodes offer {levels}")
        return capable

    def place(self, isolation: str, count: int, now: float) -> dict[str, int]:
        """How many of `count` sandboxes each node gets, in proportion to free slots; all or nothing."""
        free = {n: max(0, self.free(n)) for n in self.eligible(isolation, now)}
        total = sum(free.values())
        if total < count:
            raise NoCapacity(f"{count} sandbox(es) asked, {total} free")
        plan = {n: count * f // total for n, f in free.items()}
        for node_id in sorted(free, key=lambda n: free[n] - plan[n], reverse=True):
            if sum(plan.values()) == count:
                break
            plan[node_id] += 1
        plan = {n: k for n, k in plan.items() if k > 0}
        for node_id, k in plan.items():
            self.sent_since_heartbeat[node_id] = self.sent_since_heartbeat.get(node_id, 0) + k
        return plan

"""Fleet calls for a whole rollout and for migration: pause/resume every sandbox of a task on every
node (the trainer's GPUs are preempted), and restore a sandbox from a checkpoint on any node."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from sandfleet._requests import _convert
from sandfleet._sandbox import Sandbox
from sandfleet.bus import Bus
from schemas import node, sandbox

if TYPE_CHECKING:
    from sandfleet.client import Fleet


@dataclass(frozen=True)
class RolloutChange:
    """What `Fleet.pause` / `Fleet.resume` did on every node: `matched` sandboxes with the label,
    `changed` by this call, `unchanged` (already so, or quarantined on a resume), `failed`."""

    matched: int
    changed: int
    unchanged: int
    failed: int
    nodes: list[node.SelectedReply]
    errors: list[str]


class _FleetRollout:
    """The rollout half of `Fleet` (mixed into it)."""

    bus: Bus

    async def pause(self, *, task: str) -> RolloutChange:
        """Pause every live sandbox labelled `task=<task>` on every node (the trainer's GPUs are preempted)."""
        return await self._rollout(node.PAUSE_SELECTED, {"task": task})

    async def resume(self, *, task: str) -> RolloutChange:
        """Resume the sandboxes `pause(task=...)` paused; quarantined ones stay frozen."""
        return await self._rollout(node.RESUME_SELECTED, {"task": task})

    async def _rollout(self: Fleet, verb: str, labels: dict[str, str]) -> RolloutChange:
        req = _convert(dict(labels=labels), node.SelectedRequest)
        nodes = [n.id for n in await self.nodes() if not n.simulated]
        replies = await asyncio.gather(
            *(self.bus.request(node.subject(n, verb), req, node.SelectedReply, timeout=60) for n in nodes),
            return_exceptions=True)
        answered = [r for r in replies if isinstance(r, node.SelectedReply)]
        problems = [f"{n}: {r}" for n, r in zip(nodes, replies) if isinstance(r, BaseException)]
        return RolloutChange(
            matched=sum(r.matched for r in answered), changed=sum(r.changed for r in answered),
            unchanged=sum(r.unchanged for r in answered), failed=sum(r.failed for r in answered),
            nodes=answered, errors=problems + [e for r in answered for e in r.errors])

    async def restore(self, checkpoint: node.Checkpoint, node: str | None = None, *,
                      request_timeout_s: float = 120.0) -> Sandbox:
        """Start a new sandbox from a checkpoint: its spec, with layers base + the checkpoint layer
        (a memory checkpoint's: the VM goes on from its saved machine, processes running).
        Placement picks the node (preferring one that caches the layers) unless `node` names one:
        then only that node (migration to a chosen node); `NotFound` if no such node is registered,
        `Capacity` if it has no room."""
        spec = msgspec.structs.replace(checkpoint.spec, layers=[*checkpoint.base, checkpoint.digest], host_view=False,
                                       machine_state=checkpoint.machine is not None)
        req = _convert({**msgspec.to_builtins(spec), "node": node}, sandbox.CreateRequest)
        reply = await self.bus.request(sandbox.CREATE, req, sandbox.CreateReply, timeout=request_timeout_s)
        return Sandbox(self, reply.id, reply.node)

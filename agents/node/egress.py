"""The node agent's egress enforcement: every sandbox cgroup carries the allowlist programs
(deny everything not allowed; a sandbox without rules is loopback-only), and every refusal,
by the programs or by the DNS stub, becomes a violation event on the bus.

The programs are compiled once per agent start. A restarted agent attaches its own
programs to the sandboxes that still live before it detaches its predecessor's, so a
sandbox is never unpoliced in between.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field

from linuxnode.bpf import BpfUnavailable, Denial, DenialKind, EgressPolicy, cgroup_id
from agents.node.dns_stub import DnsViolation
from agents.node.violations import ViolationPublisher

log = logging.getLogger("sandfleet.agent")

_PROTO = {socket.IPPROTO_TCP: "tcp", socket.IPPROTO_UDP: "udp"}


def describe(d: Denial) -> str:
    if d.kind is DenialKind.SOCKET:
        return f"socket(family={d.family}, type={d.socket_type}, protocol={d.protocol})"
    return f"{d.kind.value} {d.address}:{d.port}/{_PROTO.get(d.protocol, d.protocol)}"


@dataclass
class Egress:
    node_id: str
    publisher: ViolationPublisher
    policy: EgressPolicy | None = None
    why_not: str = ""
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    async def load(cls, node_id: str, publisher: ViolationPublisher) -> Egress:
        try:
            return cls(node_id, publisher, policy=await asyncio.to_thread(EgressPolicy))
        except BpfUnavailable as exc:
            log.warning("egress allowlists are off on this node: %s", exc)
            return cls(node_id, publisher, why_not=str(exc))

    @property
    def labels(self) -> dict[str, dict[str, str]]:
        """Task labels by sandbox, from its confine request (the publisher's, shared by every watcher)."""
        return self.publisher.labels

    @property
    def status(self) -> str:
        return "on" if self.policy is not None else f"off: {self.why_not}"

    def attach(self, v2_dir: str) -> int | None:
        """Police a sandbox cgroup; its cgroup id (None when the programs are off here)."""
        return self.policy.attach(v2_dir) if self.policy is not None else None

    def detach(self, v2_dir: str) -> None:
        if self.policy is not None and os.path.isdir(v2_dir):
            self.policy.detach(cgroup_id(v2_dir))

    def take_over(self, live_v2_dirs: list[str], node_v2_root: str) -> None:
        """Police the sandboxes that outlived a previous agent, then drop its programs."""
        if self.policy is None:
            return
        for d in live_v2_dirs:
            self.attach(d)
        self.detach_stale(node_v2_root)

    def detach_stale(self, node_v2_root: str) -> None:
        """Drop a previous agent's programs (ours must be attached, rules refilled, first)."""
        if self.policy is not None and os.path.isdir(node_v2_root):
            stale = self.policy.detach_stale(node_v2_root)
            if stale:
                log.info("detached %d program(s) a previous agent left", len(stale))

    def start(self) -> None:
        """Report the programs' refusals (the publisher must be bound to the bus)."""
        if self.policy is not None:
            self._tasks.append(asyncio.create_task(self._report()))

    async def report_dns(self, refused: DnsViolation) -> None:
        """A name the sandbox may not resolve, asked of the DNS stub: `network.dns`. The stub
        sees a packet, not a process (no pid), and a name, not an address."""
        await self.publisher.publish(refused.sandbox_id, "network.dns", f"dns {refused.name} {refused.qtype}",
                                     port=53, msg_id=f"{refused.sandbox_id}:dns:{refused.monotonic_ns}")

    async def _report(self) -> None:
        assert self.policy is not None
        async for denial in self.policy.denials():
            path = self.policy.attached().get(denial.cgroup_id)
            if path is None:
                continue  # a cgroup below a sandbox's own, or one just released
            sandbox_id = os.path.basename(path)
            await self.publisher.publish(sandbox_id, f"network.{denial.kind.value}", describe(denial),
                                         pid=denial.pid, command=denial.comm, address=denial.address,
                                         port=denial.port,
                                         msg_id=f"{sandbox_id}:{denial.monotonic_ns}:{denial.tid}")

    async def close(self) -> None:
        """Stop the reporter (its reader leaves the ring buffer's fd), then free the programs."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.policy is not None:
            self.policy.close()

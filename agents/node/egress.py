"""The node agent's egress enforcement: every sandbox cgroup carries the allowlist programs
(deny everything not allowed; sandboxes are loopback-only until they get rules), and every
refusal becomes a violation event on the bus.

The programs are compiled once per agent start. A restarted agent attaches its own
programs to the sandboxes that still live before it detaches its predecessor's, so a
sandbox is never unpoliced in between.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from agents.node.bpf import BpfUnavailable, Denial, DenialKind, EgressPolicy, cgroup_id
from sandfleet.bus import Bus
from sandfleet.store import SandboxStore
from schemas import violations
from schemas.violations import Violation

log = logging.getLogger("sandfleet.agent")

_PROTO = {socket.IPPROTO_TCP: "tcp", socket.IPPROTO_UDP: "udp"}


def describe(d: Denial) -> str:
    if d.kind is DenialKind.SOCKET:
        return f"socket(family={d.family}, type={d.socket_type}, protocol={d.protocol})"
    return f"{d.kind.value} {d.address}:{d.port}/{_PROTO.get(d.protocol, d.protocol)}"


@dataclass
class Egress:
    node_id: str
    policy: EgressPolicy | None = None
    why_not: str = ""
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    async def load(cls, node_id: str) -> Egress:
        try:
            return cls(node_id, policy=await asyncio.to_thread(EgressPolicy))
        except BpfUnavailable as exc:
            log.warning("egress allowlists are off on this node: %s", exc)
            return cls(node_id, why_not=str(exc))

    @property
    def status(self) -> str:
        return "on" if self.policy is not None else f"off: {self.why_not}"

    def attach(self, v2_dir: str) -> None:
        if self.policy is not None:
            self.policy.attach(v2_dir)

    def detach(self, v2_dir: str) -> None:
        if self.policy is not None and os.path.isdir(v2_dir):
            self.policy.detach(cgroup_id(v2_dir))

    def take_over(self, live_v2_dirs: list[str], node_v2_root: str) -> None:
        """Police the sandboxes that outlived a previous agent, then drop its programs."""
        if self.policy is None:
            return
        for d in live_v2_dirs:
            self.attach(d)
        if os.path.isdir(node_v2_root):
            stale = self.policy.detach_stale(node_v2_root)
            if stale:
                log.info("detached %d program(s) a previous agent left", len(stale))

    def report_to(self, bus: Bus, store: SandboxStore) -> None:
        if self.policy is not None:
            self._tasks.append(asyncio.create_task(self._report(bus, store)))

    async def _report(self, bus: Bus, store: SandboxStore) -> None:
        assert self.policy is not None
        async for denial in self.policy.denials():
            path = self.policy.attached().get(denial.cgroup_id)
            if path is None:
                continue  # a cgroup below a sandbox's own, or one just released
            sandbox_id = os.path.basename(path)
            try:
                labels = dict((await store.get(sandbox_id))[0].spec.labels)
            except Exception:
                labels = {}
            event = Violation(
                node=self.node_id,
                sandbox_id=sandbox_id,
                kind=f"network.{denial.kind.value}",
                pid=denial.pid,
                command=denial.comm,
                attempted=describe(denial),
                address=denial.address,
                port=denial.port,
                at=time.time(),
                labels=labels,
            )
            try:
                await bus.publish_durable(
                    violations.subject(self.node_id, sandbox_id, event.kind),
                    event,
                    msg_id=f"{sandbox_id}:{denial.monotonic_ns}:{denial.tid}",
                )
            except Exception as exc:  # the reporter must outlive a bad moment of the bus
                log.warning("violation of %s not published: %s", sandbox_id, exc)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.policy is not None:
            self.policy.close()

"""Violation events: what a sandbox tried and was refused, on
`events.v1.violation.<node>.<sandbox>.<kind>` (kept by the EVENTS stream as the audit trail).

`kind` is `<layer>.<what>`; in the subject it is one token with `_` for the dot, so
`events.v1.violation.*.*.network_connect` selects one kind on every node. The node agent
emits (agents/node/violations.py publishes them all):
- `network.connect`, `network.sendmsg`, `network.socket`: refused by the eBPF allowlist
  programs (a connect or a UDP send to an address not allowed; a raw, packet or other
  non-TCP/UDP socket);
- `network.dns`: a name not allowed, asked of the agent's DNS stub (pid 0: it sees a packet);
- `syscall.<name>` (`syscall.ptrace`, `syscall.mount`, `syscall.bpf`, `syscall.ioctl`,
  `syscall.clone`, ...): a syscall the sandbox seccomp filter refused;
- `file.sensitive`: an open of a sensitive host path (`/proc/kpagecgroup`, `/proc/kcore`...);
- `limit.pids`: the pids limit refused a fork; `limit.memory`: the OOM killer acted inside
  the sandbox's memory limit;
- `file.landlock`, `network.landlock`, `ipc.landlock`, `process.landlock`: a Landlock denial;
- `<class>.apparmor` (`file.apparmor`, `network.apparmor`, `capability.apparmor`, ...): an
  AppArmor denial, on a kernel that has AppArmor.
One sandbox's events are held back beyond a per-second budget; the next event that goes out
says in `attempted` how many similar attempts were not reported one by one.

A tenant's view: the security monitor, which reads each violated sandbox's record, publishes a
copy of every violation of a tenant's sandbox on `events.v2.violation.<tenant>.<node>.<sandbox>.<kind>`,
which that tenant's account imports (and no other). v1 stays the node's own subject: a node may
publish only under its own id, and the monitor, not the node, vouches for whose sandbox it was.
"""

from __future__ import annotations

import msgspec

ALL = "events.v1.violation.>"
VERSION = 1


def subject(node_id: str, sandbox_id: str, kind: str) -> str:
    return f"events.v1.violation.{node_id}.{sandbox_id}.{kind.replace('.', '_')}"


def sandbox_filter(sandbox_id: str) -> str:
    return f"events.v1.violation.*.{sandbox_id}.*"


def tenant_subject(tenant: str, node_id: str, sandbox_id: str, kind: str) -> str:
    return f"events.v2.violation.{tenant}.{node_id}.{sandbox_id}.{kind.replace('.', '_')}"


def tenant_filter(tenant: str, sandbox_id: str = "*") -> str:
    """One tenant's violations (of one sandbox, or all): `tenant_filter(name)` is what its account imports."""
    return f"events.v2.violation.{tenant}.*.{sandbox_id}.*"


class Violation(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="violation"):
    v: int = VERSION
    node: str
    sandbox_id: str
    kind: str
    pid: int
    command: str
    attempted: str  # e.g. "connect 10.1.2.3:80/tcp"
    address: str | None = None
    port: int = 0
    at: float
    labels: dict[str, str] = {}

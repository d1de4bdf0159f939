"""Lifetime and health of a sandbox, answered by the launcher of its node
(`node.v1.<node_id>.<verb>`): a new deadline (`set_timeout`) and what the sandbox uses now
(`metrics` for one, `node_metrics` for every live sandbox of the node, what `sandfleet top`
reads).

Every figure is read from outside the sandbox (cgroup files, its writable layer, the
/proc/<init>/net/dev of its network namespace): nothing runs inside it to report them. This is
a request/reply API, not a metric export: no Prometheus series per sandbox exists.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.node import subject
from schemas.sandbox import SandboxId, SandboxRecord

SET_TIMEOUT = "set_timeout"
METRICS = "metrics"
NODE_METRICS = "node_metrics"

__all__ = ["SET_TIMEOUT", "METRICS", "NODE_METRICS", "subject", "SetTimeoutRequest", "SetTimeoutReply",
           "MetricsRequest", "NodeMetricsRequest", "InterfaceBytes", "SandboxMetrics", "NodeMetrics"]


class SetTimeoutRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                        tag_field="type", tag="set_timeout_request"):
    """A new life for the sandbox: it ends (reason `expired`) `timeout_s` seconds from now, later or
    sooner than it would have. The node refuses more than its configured maximum."""

    sandbox_id: SandboxId
    timeout_s: Annotated[float, Meta(gt=0)]


class SetTimeoutReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="set_timeout_reply"):
    record: SandboxRecord  # with its new `deadline` (unix seconds)


class MetricsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                     tag_field="type", tag="metrics_request"):
    sandbox_id: SandboxId


class NodeMetricsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                         tag_field="type", tag="node_metrics_request"):
    """Every live sandbox of the node at once (one request per node per refresh of `top`)."""


class InterfaceBytes(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="interface_bytes"):
    """One interface of the sandbox's network namespace (`lo` and its veth), as its kernel counts."""

    name: str
    rx_bytes: int
    tx_bytes: int


class SandboxMetrics(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="sandbox_metrics"):
    """What one sandbox uses, read at `at` (unix seconds). A figure the node cannot read for this
    sandbox (a cgroup file its kernel lacks) is -1."""

    sandbox_id: str
    at: float
    cpu_s: float  # CPU time of every process it ran, user + system, since it started
    memory_bytes: int  # charged to its memory cgroup now (page cache included)
    memory_peak_bytes: int  # the most it was ever charged
    memory_limit_bytes: int
    disk_bytes: int  # used by its writable layer (the host view: its /workspace disk)
    processes: int  # processes in its cgroup now, its init included
    rx_bytes: int  # sums over every interface of `interfaces`
    tx_bytes: int
    interfaces: list[InterfaceBytes] = []
    deadline: float = 0.0  # when it expires (unix seconds)


class NodeMetrics(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="node_metrics"):
    node: str
    sandboxes: list[SandboxMetrics] = []

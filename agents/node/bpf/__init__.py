"""eBPF egress allowlists of the node's sandboxes: the programs, their loader and their records."""

from agents.node.bpf.build import BpfUnavailable
from agents.node.bpf.denials import Denial, DenialKind
from agents.node.bpf.loader import EgressPolicy, Rule, StaleAttachment, UnknownCgroup, cgroup_id

__all__ = [
    "BpfUnavailable", "Denial", "DenialKind", "EgressPolicy", "Rule", "StaleAttachment", "UnknownCgroup",
    "cgroup_id",
]

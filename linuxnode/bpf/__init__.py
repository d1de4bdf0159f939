"""eBPF egress allowlists of the node's sandboxes: the programs, their loader and their records."""

from linuxnode.bpf.build import BpfUnavailable
from linuxnode.bpf.denials import Denial, DenialKind
from linuxnode.bpf.loader import EgressPolicy, Rule, StaleAttachment, UnknownCgroup, cgroup_id

__all__ = [
    "BpfUnavailable", "Denial", "DenialKind", "EgressPolicy", "Rule", "StaleAttachment", "UnknownCgroup",
    "cgroup_id",
]

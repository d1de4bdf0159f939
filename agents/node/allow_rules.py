"""The allow-rule parser the agent enforces: one implementation, in sandfleet/allow_rules.py,
shared with the SDK and placement; re-exported here for the agent's modules."""

from __future__ import annotations

from sandfleet.allow_rules import (
    AllowList,
    DomainRule,
    IPNetwork,
    NetworkRule,
    Protocol,
    Rule,
    parse_allow,
    parse_rule,
)

__all__ = ["AllowList", "DomainRule", "IPNetwork", "NetworkRule", "Protocol", "Rule", "parse_allow", "parse_rule"]

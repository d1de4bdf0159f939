"""A sandbox's egress allowlist as the user writes it, parsed into typed rules. Pure: no I/O.

    allow=["api.example.com", "mirror.internal:443", "10.1.2.0/24:5432",
           "[2001:db8::1]:443", "*.pypi.org", "10.0.0.53:53/udp"]

A rule is a destination and an optional port (none = every port) and protocol suffix
`/tcp` or `/udp` (none = both). Destinations are domain names (exact, or `*.suffix` for
every name under suffix but not suffix itself), IP addresses or CIDR networks; IPv6 ones
take brackets when a port follows. IPv4-mapped IPv6 (`::ffff:a.b.c.d`) is IPv4 here, as
it is to the kernel. Anything else is a ValueError whose message names the rule.

It lives on the sandfleet floor because three places parse the same text: the SDK (a bad
rule fails before anything is sent), placement (before a sandbox is placed, whoever sent
the request) and the node agent (which enforces the parsed rules).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


class Protocol(IntEnum):
    """IP protocol numbers as the kernel and the BPF maps spell them; ANY matches both."""

    ANY = 0
    TCP = 6
    UDP = 17


@dataclass(frozen=True)
class DomainRule:
    name: str  # lower case, ASCII (IDNA), no trailing dot, without the "*." of a wildcard
    wildcard: bool = False
    port: int | None = None
    protocol: Protocol = Protocol.ANY

    def matches(self, qname: str) -> bool:
        """Does this rule allow resolving qname (any case, trailing dot or not)?"""
        name = qname.rstrip(".").lower()
        if self.wildcard:
            return name.endswith("." + self.name)
        return name == self.name

    def __str__(self) -> str:
        return _with_port(("*." if self.wildcard else "") + self.name, self.port, self.protocol)


@dataclass(frozen=True)
class NetworkRule:
    network: IPNetwork
    port: int | None = None
    protocol: Protocol = Protocol.ANY

    def __str__(self) -> str:
        net = self.network
        host = str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)
        if net.version == 6 and self.port is not None:
            host = f"[{host}]"
        return _with_port(host, self.port, self.protocol)


Rule = DomainRule | NetworkRule


@dataclass(frozen=True)
class AllowList:
    domains: tuple[DomainRule, ...] = ()
    networks: tuple[NetworkRule, ...] = ()

    def rules_for_name(self, qname: str) -> tuple[DomainRule, ...]:
        """The domain rules that allow qname; empty means the name is refused."""
        return tuple(r for r in self.domains if r.matches(qname))


def _with_port(host: str, port: int | None, protocol: Protocol) -> str:
    text = host if port is None else f"{host}:{port}"
    return text if protocol is Protocol.ANY else f"{text}/{protocol.name.lower()}"


def parse_allow(items: Iterable[str]) -> AllowList:
    """Parse every rule (duplicates dropped, order kept); the first bad one raises ValueError."""
    if isinstance(items, str):
        raise ValueError("allow must be a list of rules, not one string")
    domains: dict[DomainRule, None] = {}
    networks: dict[NetworkRule, None] = {}
    for item in items:
        rule = parse_rule(item)
        (domains if isinstance(rule, DomainRule) else networks)[rule] = None  # type: ignore[index]
    return AllowList(domains=tuple(domains), networks=tuple(networks))


def parse_rule(text: str) -> Rule:
    if not isinstance(text, str):
        raise ValueError(f"allow rule {text!r}: must be a string")
    if not text or text != text.strip() or any(c.isspace() for c in text):
        raise ValueError(f"allow rule {text!r}: empty or contains whitespace")
    if "://" in text or "@" in text:
        raise ValueError(f"allow rule {text!r}: give a host name, address or network, not a URL")
    rest, protocol = text, Protocol.ANY
    lowered = text.lower()
    for proto in (Protocol.TCP, Protocol.UDP):
        if lowered.endswith("/" + proto.name.lower()):
            rest, protocol = text[: -len(proto.name) - 1], proto
    host, port = _split_port(text, rest)
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"allow rule {text!r}: unbalanced '['")
        return NetworkRule(_network(text, host[1:-1], want_v6=True), port, protocol)
    if ":" in host:
        return NetworkRule(_network(text, host, want_v6=True), port, protocol)
    if "/" in host or re.fullmatch(r"[0-9.]+", host):
        return NetworkRule(_network(text, host, want_v6=False), port, protocol)
    return _domain(text, host, port, protocol)


def _split_port(text: str, rest: str) -> tuple[str, int | None]:
    """Split 'host:port' / '[v6]:port'; a bare IPv6 address (two or more colons) has no port."""
    if rest.startswith("["):
        close = rest.find("]")
        if close == -1:
            raise ValueError(f"allow rule {text!r}: unbalanced '['")
        host, tail = rest[: close + 1], rest[close + 1 :]
        if not tail:
            return host, None
        if not tail.startswith(":"):
            raise ValueError(f"allow rule {text!r}: expected ':port' after ']'")
        return host, _port(text, tail[1:])
    if rest.count(":") >= 2:
        return rest, None
    if ":" in rest:
        host, _, port = rest.partition(":")
        return host, _port(text, port)
    return rest, None


def _port(text: str, value: str) -> int:
    if not _PORT.match(value) or not 1 <= int(value) <= 65535:
        raise ValueError(f"allow rule {text!r}: port must be a number from 1 to 65535, not {value!r}")
    return int(value)


def _network(text: str, value: str, *, want_v6: bool) -> IPNetwork:
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise ValueError(f"allow rule {text!r}: {exc}") from None
    if want_v6 != (net.version == 6):
        raise ValueError(f"allow rule {text!r}: only IPv6 addresses take brackets")
    if net.version == 6 and net.prefixlen >= 96 and net.subnet_of(_MAPPED):  # type: ignore[arg-type]
        v4 = ipaddress.IPv4Address(int(net.network_address) & 0xFFFFFFFF)
        net = ipaddress.IPv4Network((v4, net.prefixlen - 96))
    if net.prefixlen and (net.network_address.is_loopback or net.network_address.is_unspecified):
        raise ValueError(f"allow rule {text!r}: loopback is always allowed inside a sandbox and never outside it")
    return net


def _domain(text: str, host: str, port: int | None, protocol: Protocol) -> DomainRule:
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if "*" in name:
        raise ValueError(f"allow rule {text!r}: '*' is allowed only as a whole first label ('*.example.com')")
    name = name[:-1] if name.endswith(".") else name  # the root label of a fully qualified name
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValueError(f"allow rule {text!r}: not a valid internationalised domain name") from None
    name = name.lower()
    if not name or len(name) > 253:
        raise ValueError(f"allow rule {text!r}: a domain name has 1 to 253 characters")
    for label in name.split("."):
        if not _LABEL.match(label):
            raise ValueError(
                f"allow rule {text!r}: bad label {label!r} (letters, digits, '-' and '_', "
                "at most 63, not starting or ending with '-')"
            )
    if name.split(".")[-1].isdigit():
        raise ValueError(f"allow rule {text!r}: not a valid IP address, and a domain's last label is not numeric")
    return DomainRule(name=name, wildcard=wildcard, port=port, protocol=protocol)

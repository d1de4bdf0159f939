"""The allowlist parser: what users write, what the agent enforces, and what it refuses; and
that the SDK refuses a bad rule with the same parser before it sends anything."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

import agents.node.allow_rules
import sandfleet.allow_rules
from sandfleet import errors
from sandfleet.allow_rules import AllowList, DomainRule, NetworkRule, Protocol, parse_allow, parse_rule
from sandfleet.client import Fleet, _spec

net = ipaddress.ip_network


@pytest.mark.parametrize(
    "text, rule",
    [
        ("api.example.com", DomainRule("api.example.com")),
        ("mirror.internal:443", DomainRule("mirror.internal", port=443)),
        ("*.pypi.org", DomainRule("pypi.org", wildcard=True)),
        ("*.pypi.org:443/tcp", DomainRule("pypi.org", wildcard=True, port=443, protocol=Protocol.TCP)),
        ("API.Example.COM.", DomainRule("api.example.com")),
        ("bücher.example", DomainRule("xn--bcher-kva.example")),
        ("_dmarc.example.com", DomainRule("_dmarc.example.com")),
        ("localhost-like", DomainRule("localhost-like")),
        ("10.1.2.3", NetworkRule(net("10.1.2.3/32"))),
        ("10.1.2.0/24:5432", NetworkRule(net("10.1.2.0/24"), port=5432)),
        ("10.0.0.53:53/udp", NetworkRule(net("10.0.0.53/32"), port=53, protocol=Protocol.UDP)),
        ("10.0.0.0/8/TCP", NetworkRule(net("10.0.0.0/8"), protocol=Protocol.TCP)),
        ("[2001:db8::1]:443", NetworkRule(net("2001:db8::1/128"), port=443)),
        ("2001:db8::1", NetworkRule(net("2001:db8::1/128"))),
        ("2001:db8::/32", NetworkRule(net("2001:db8::/32"))),
        ("[2001:db8::/32]:80", NetworkRule(net("2001:db8::/32"), port=80)),
        ("[2001:db8::1]", NetworkRule(net("2001:db8::1/128"))),
        ("[::ffff:10.0.0.1]:80", NetworkRule(net("10.0.0.1/32"), port=80)),
        ("::ffff:10.0.0.0/104", NetworkRule(net("10.0.0.0/8"))),
        ("0.0.0.0/0", NetworkRule(net("0.0.0.0/0"))),
    ],
)
def test_valid_rules(text, rule):
    assert parse_rule(text) == rule


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        (" api.example.com", "whitespace"),
        ("api .example.com", "whitespace"),
        ("https://api.example.com", "not a URL"),
        ("user@host", "not a URL"),
        ("a.*.example.com", "whole first label"),
        ("*", "whole first label"),
        ("*example.com", "whole first label"),
        ("**.example.com", "whole first label"),
        ("10.1.2.3/24", "host bits set"),
        ("10.1.2.0/33", "10.1.2.0/33"),
        ("1.2.3.4.5", "does not appear"),
        ("999.1.1.1", "does not appear"),
        ("host:0", "1 to 65535"),
        ("host:65536", "1 to 65535"),
        ("host:-1", "1 to 65535"),
        ("host:http", "1 to 65535"),
        ("host:", "1 to 65535"),
        ("[1.2.3.4]:80", "only IPv6"),
        ("[2001:db8::1", "unbalanced"),
        ("[2001:db8::1]443", "expected ':port'"),
        ("a..b", "bad label"),
        ("-a.example", "bad label"),
        ("a-.example", "bad label"),
        ("x" * 64 + ".example", "bad label"),
        (".".join(["a" * 60] * 5), "1 to 253"),
        ("example.123", "numeric"),
        ("2001:db8::zz", "does not appear"),
        ("127.0.0.1:4222", "loopback"),
        ("127.0.0.0/8", "loopback"),
        ("[::1]:80", "loopback"),
        ("0.0.0.0", "loopback"),
        ("::", "loopback"),
    ],
)
def test_invalid_rules_name_the_rule(text, message):
    with pytest.raises(ValueError) as exc:
        parse_rule(text)
    assert message in str(exc.value)
    assert repr(text) in str(exc.value)


def test_non_string_rules():
    with pytest.raises(ValueError, match="must be a string"):
        parse_rule(443)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not one string"):
        parse_allow("api.example.com")  # type: ignore[arg-type]


def test_parse_allow_splits_names_from_networks_and_drops_duplicates():
    allow = parse_allow(["api.example.com", "10.1.2.0/24:5432", "*.pypi.org", "api.example.com", "[2001:db8::1]:443"])
    assert allow == AllowList(
        domains=(DomainRule("api.example.com"), DomainRule("pypi.org", wildcard=True)),
        networks=(NetworkRule(net("10.1.2.0/24"), port=5432), NetworkRule(net("2001:db8::1/128"), port=443)),
    )
    assert parse_allow([]) == AllowList()


def test_the_first_bad_rule_raises():
    with pytest.raises(ValueError, match="'bad rule'"):
        parse_allow(["api.example.com", "bad rule", "also:bad:"])


def test_domain_matching():
    exact, wild = DomainRule("api.example.com"), DomainRule("pypi.org", wildcard=True)
    assert exact.matches("api.example.com") and exact.matches("API.Example.com.")
    assert not exact.matches("x.api.example.com") and not exact.matches("example.com")
    assert wild.matches("files.pypi.org") and wild.matches("a.b.pypi.org.")
    assert not wild.matches("pypi.org"), "*.suffix does not cover the suffix itself"
    assert not wild.matches("evilpypi.org") and not wild.matches("pypi.org.evil.com")
    allow = parse_allow(["api.example.com:443", "api.example.com:80", "*.example.com"])
    assert [str(r) for r in allow.rules_for_name("api.example.com")] == [
        "api.example.com:443", "api.example.com:80", "*.example.com",
    ]
    assert allow.rules_for_name("example.com") == ()


@pytest.mark.parametrize(
    "text", ["api.example.com", "*.pypi.org:443/udp", "10.1.2.0/24:5432", "[2001:db8::1]:443", "2001:db8::/32",
             "10.0.0.1", "10.0.0.1:53/tcp"],
)
def test_str_round_trips(text):
    assert str(parse_rule(text)) == text
    assert parse_rule(str(parse_rule(text))) == parse_rule(text)


@given(st.ip_addresses(), st.one_of(st.none(), st.integers(1, 65535)))
def test_any_address_with_any_port_round_trips(address, port):
    mapped = address.ipv4_mapped if address.version == 6 else None
    if (mapped or address).is_loopback or (mapped or address).is_unspecified:
        return
    host = f"[{address}]" if address.version == 6 and port is not None else str(address)
    text = host if port is None else f"{host}:{port}"
    rule = parse_rule(text)
    assert isinstance(rule, NetworkRule) and rule.port == port
    assert rule.network.network_address == (mapped or address)
    assert parse_rule(str(rule)) == rule


@given(st.text(max_size=40))
def test_arbitrary_text_parses_or_raises_value_error(text):
    try:
        rule = parse_rule(text)
    except ValueError:
        return
    assert parse_rule(str(rule)) == rule


def test_the_agent_enforces_the_same_parser_the_sdk_and_placement_use():
    for name in agents.node.allow_rules.__all__:
        assert getattr(agents.node.allow_rules, name) is getattr(sandfleet.allow_rules, name), name


@pytest.mark.parametrize("allow", [["http://evil.test"], ["api.example.com", "127.0.0.1:4222"], ["host:99999"]])
async def test_the_sdk_refuses_a_bad_rule_before_it_has_a_bus_to_send_on(allow):
    fleet = Fleet(bus=None)  # type: ignore[arg-type]  # any send would fail with AttributeError
    with pytest.raises(errors.InvalidRequest) as exc:
        await fleet.create(allow=allow)
    assert repr(allow[-1]) in exc.value.message
    with pytest.raises(errors.InvalidRequest):
        await fleet.create_many(3, allow=allow)


def test_the_sdk_passes_good_rules_on_as_written():
    allow = ["api.example.com", "mirror.internal:443", "10.1.2.0/24:5432"]
    assert _spec(allow=allow).allow == allow

"""The egress network's configuration, without a kernel: what the agent reads from its environment."""

from __future__ import annotations

import ipaddress

import pytest

from agents.node.network import DEFAULT_SUBNET, NetworkConfig, host_port


@pytest.mark.parametrize("text, expected", [
    ("10.77.100.53", ("10.77.100.53", 53)),
    ("10.77.100.53:5353", ("10.77.100.53", 5353)),
    ("fd00::53", ("fd00::53", 53)),
    ("[fd00::53]:5353", ("fd00::53", 5353)),
    ("[fd00::53]", ("fd00::53", 53)),
])
def test_dns_upstream_is_host_and_optional_port(text, expected):
    assert host_port(text, 53) == expected


def test_config_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("SANDFLEET_EGRESS_SUBNET", raising=False)
    monkeypatch.setenv("SANDFLEET_DNS_UPSTREAM", "192.0.2.53:5353")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    config = NetworkConfig.from_env("nats://127.0.0.1:4222,nats://10.0.0.2:4222")
    assert config.subnet == ipaddress.IPv4Network(DEFAULT_SUBNET)
    assert config.upstream == ("192.0.2.53", 5353)
    assert config.bus_urls == ("nats://127.0.0.1:4222", "nats://10.0.0.2:4222")
    assert config.extra_blocked == ("http://127.0.0.1:4318",)
    monkeypatch.setenv("SANDFLEET_EGRESS_SUBNET", "10.9.0.0/30")
    with pytest.raises(ValueError, match="too small"):
        NetworkConfig.from_env("nats://127.0.0.1:4222")

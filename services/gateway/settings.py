"""The gateway's settings, read once from the environment by its composition root.

SANDFLEET_GATEWAY_LISTEN     host:port it serves on (default 127.0.0.1:3000)
SANDFLEET_GATEWAY_DOMAIN     the domain sandboxes are reached under, as E2B's `domain`: the SDK
                             builds `<port>-<sandbox id>.<domain>` from it (default
                             `sandfleet.localhost:<listen port>`: *.localhost is loopback)
SANDFLEET_GATEWAY_API_KEYS   `KEY=TENANT,KEY2=TENANT2`: which API key is which tenant
SANDFLEET_GATEWAY_TEMPLATES  JSON {template: {isolation, layers, host_view, cpu, memory_mb,
                             disk_mb, allow}}; a template not named there is a layer name
SANDFLEET_GATEWAY_ISOLATION  isolation of a template that is only a layer name (container)
SANDFLEET_GATEWAY_SECRET     key of the sandboxes' envd access tokens (HMAC); replicas of the
                             gateway must share it (default: random, new at every start)
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

DEFAULT_LISTEN = "127.0.0.1:3000"
TEMPLATE_KEYS = frozenset({"isolation", "layers", "host_view", "cpu", "memory_mb", "disk_mb", "allow", "pids"})


class SettingsError(ValueError):
    """A setting the gateway cannot start with; the message names it."""


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 3000
    domain: str = ""
    api_keys: dict[str, str] = field(default_factory=dict)  # key → tenant
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    isolation: str = "container"
    secret: bytes = b""

    @property
    def sandbox_domain(self) -> str:
        return self.domain or f"sandfleet.localhost:{self.port}"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> GatewaySettings:
        env = dict(os.environ) if env is None else env
        host, port = parse_listen(env.get("SANDFLEET_GATEWAY_LISTEN") or DEFAULT_LISTEN)
        secret = env.get("SANDFLEET_GATEWAY_SECRET", "")
        return cls(host=host, port=port, domain=env.get("SANDFLEET_GATEWAY_DOMAIN", ""),
                   api_keys=parse_api_keys(env.get("SANDFLEET_GATEWAY_API_KEYS", "")),
                   templates=parse_templates(env.get("SANDFLEET_GATEWAY_TEMPLATES", "")),
                   isolation=env.get("SANDFLEET_GATEWAY_ISOLATION") or "container",
                   secret=secret.encode() if secret else secrets.token_bytes(32))


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(f"SANDFLEET_GATEWAY_LISTEN={text!r}: HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_api_keys(text: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, tenant = item.partition("=")
        if not sep or not key or not tenant:
            raise SettingsError(f"SANDFLEET_GATEWAY_API_KEYS: {item!r} is not KEY=TENANT")
        keys[key] = tenant
    return keys


def parse_templates(text: str) -> dict[str, dict[str, Any]]:
    if not text.strip():
        return {}
    try:
        templates = json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"SANDFLEET_GATEWAY_TEMPLATES is not JSON: {exc}") from None
    if not isinstance(templates, dict) or not all(isinstance(v, dict) for v in templates.values()):
        raise SettingsError("SANDFLEET_GATEWAY_TEMPLATES: an object of template name → object")
    for name, spec in templates.items():
        unknown = set(spec) - TEMPLATE_KEYS
        if unknown:
            raise SettingsError(f"SANDFLEET_GATEWAY_TEMPLATES[{name!r}]: unknown keys {sorted(unknown)}")
    return templates

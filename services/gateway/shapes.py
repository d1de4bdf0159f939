"""E2B's shapes, computed from sandfleet's: pure functions, no I/O (unit-tested without a bus).

What a sandbox record looks like to the E2B SDK (its `Sandbox`, `SandboxDetail`, `ListedSandbox`
JSON), how a create request becomes a sandfleet spec (a template is a layer name, or a named
spec from the settings; metadata and envs ride on labels so any replica of the gateway reads
them back), E2B's error body, a sandbox's envd access token, and the port proxy's host names.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
import re
from datetime import datetime, timezone
from typing import Any

from schemas.sandbox import SandboxRecord, State

# The envd version the gateway claims: the SDK switches features on by it (octet-stream
# uploads since 0.5.7, entry info in watch events since 0.6.3), and every one it gates is served.
ENVD_VERSION = "0.6.4"
ENVD_PORT = 49983  # where E2B's envd listens: `49983-<id>.<domain>` is the envd API itself
HOME = "/workspace"  # where a relative path and a command without cwd start (E2B's user home)
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox lifetime

TENANT_LABEL = "tenant"
TEMPLATE_LABEL = "e2b.template"
META_PREFIX = "e2b.meta/"
ENV_PREFIX = "e2b.env/"
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PORT_HOST = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9-]{0,63})\.(.+)$")
LIVE = frozenset({State.REQUESTED, State.SCHEDULED, State.STARTING, State.RUNNING, State.PAUSED})


class BadRequest(ValueError):
    """A request E2B would refuse with 400; the message says why."""


def error_body(code: int, message: str) -> dict[str, Any]:
    """E2B's REST error: the SDK reads `message` (and maps the status code)."""
    return {"code": code, "message": message}


def access_token(secret: bytes, sandbox_id: str) -> str:
    """The sandbox's envd access token: derived, not stored, so every gateway replica sharing the
    secret checks it, and nothing is kept per sandbox."""
    return hmac.new(secret, sandbox_id.encode(), hashlib.sha256).hexdigest()[:40]


def token_matches(secret: bytes, sandbox_id: str, token: str) -> bool:
    return hmac.compare_digest(access_token(secret, sandbox_id), token or "")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts or 0.0, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def metadata_of(record: SandboxRecord) -> dict[str, str]:
    labels = record.spec.labels
    return {k[len(META_PREFIX):]: v for k, v in labels.items() if k.startswith(META_PREFIX)}


def envs_of(record: SandboxRecord) -> dict[str, str]:
    labels = record.spec.labels
    return {k[len(ENV_PREFIX):]: v for k, v in labels.items() if k.startswith(ENV_PREFIX)}


def template_of(record: SandboxRecord) -> str:
    return record.spec.labels.get(TEMPLATE_LABEL, ",".join(record.spec.layers))


def tenant_of(record: SandboxRecord) -> str:
    return record.spec.labels.get(TENANT_LABEL, "")


def sandbox_json(record: SandboxRecord, *, domain: str, token: str) -> dict[str, Any]:
    """E2B's `Sandbox`: the answer to create and connect."""
    return {"templateID": template_of(record), "sandboxID": record.id, "clientID": record.node,
            "envdVersion": ENVD_VERSION, "envdAccessToken": token, "domain": domain,
            "alias": template_of(record)}


def e2b_state(record: SandboxRecord) -> str:
    return "paused" if record.state is State.PAUSED else "running"


def listed_json(record: SandboxRecord) -> dict[str, Any]:
    """E2B's `ListedSandbox`."""
    spec = record.spec
    return {"templateID": template_of(record), "alias": template_of(record), "sandboxID": record.id,
            "clientID": record.node, "startedAt": _iso(record.started_at or record.created_at),
            "endAt": _iso(record.deadline), "cpuCount": max(1, round(spec.cpu)), "memoryMB": spec.memory_mb,
            "diskSizeMB": spec.disk_mb, "state": e2b_state(record), "envdVersion": ENVD_VERSION,
            "metadata": metadata_of(record)}


def detail_json(record: SandboxRecord, *, domain: str, token: str) -> dict[str, Any]:
    """E2B's `SandboxDetail`: the answer to get_info."""
    return {**listed_json(record), "envdAccessToken": token, "domain": domain}


def metric_json(record: SandboxRecord, m: Any) -> dict[str, Any]:
    """E2B's `SandboxMetric` from a sandfleet reading; CPU as the average since it started (a
    reading is a counter, not a rate), a figure the node cannot read as 0."""
    cpus = max(1, round(record.spec.cpu))
    ran_s = max(1e-3, m.at - (record.started_at or record.created_at))
    return {"timestamp": _iso(m.at), "timestampUnix": int(m.at), "cpuCount": cpus,
            "cpuUsedPct": round(max(0.0, m.cpu_s) / ran_s / cpus * 100, 2), "memUsed": max(0, m.memory_bytes),
            "memTotal": max(0, m.memory_limit_bytes), "memCache": 0, "diskUsed": max(0, m.disk_bytes),
            "diskTotal": record.spec.disk_mb << 20}


def _strings(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequest(f"{what} must be an object of strings")
    return value


def create_spec(body: Any, *, tenant: str, templates: dict[str, dict[str, Any]], isolation: str) -> dict[str, Any]:
    """The keyword arguments of `Fleet.create` for E2B's NewSandbox body."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        raise BadRequest("templateID is required")
    timeout = body.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise BadRequest("timeout must be a whole number of seconds, at least 1")
    labels = {TENANT_LABEL: tenant, TEMPLATE_LABEL: template[:256]}
    for key, value in _strings(body.get("metadata"), "metadata").items():
        if not _LABEL_KEY.match(META_PREFIX + key) or len(META_PREFIX + key) > 63 or len(value) > 256:
            raise BadRequest(f"metadata key {key!r}: letters, digits and _.-/ only, at most "
                             f"{63 - len(META_PREFIX)} characters, values at most 256")
        labels[META_PREFIX + key] = value
    for key, value in _strings(body.get("envVars"), "envVars").items():
        if not _ENV_NAME.match(key) or len(ENV_PREFIX + key) > 63 or len(value) > 256:
            raise BadRequest(f"envVars {key!r}: a variable name of at most {63 - len(ENV_PREFIX)} characters, "
                             "values at most 256")
        labels[ENV_PREFIX + key] = value
    if len(labels) > 32:
        raise BadRequest("at most 30 metadata entries and envVars together")
    named = templates.get(template)
    spec: dict[str, Any] = dict(named) if named is not None else {"isolation": isolation, "layers": [template]}
    spec.setdefault("isolation", isolation)
    return {**spec, "labels": labels, "timeout_s": timeout}


def visible_to(record: SandboxRecord, tenant: str) -> bool:
    """A tenant sees only its own sandboxes, and only while they live (E2B forgets killed ones)."""
    return tenant_of(record) == tenant and record.state in LIVE


def list_filter(records: list[SandboxRecord], tenant: str, *, metadata: dict[str, str],
                states: set[str]) -> list[SandboxRecord]:
    found = [r for r in records if visible_to(r, tenant) and e2b_state(r) in states
             and all(metadata_of(r).get(k) == v for k, v in metadata.items())]
    return sorted(found, key=lambda r: (r.created_at, r.id))


def port_host(host: str, domain: str) -> tuple[int, str] | None:
    """(port, sandbox id) of a Host header `<port>-<id>.<domain>` (ports stripped from both), or None."""
    bare_domain = domain.lower().rsplit(":", 1)[0] if ":" in domain and not domain.endswith("]") else domain.lower()
    bare_host = host.lower().rsplit(":", 1)[0] if ":" in host else host.lower()
    m = _PORT_HOST.match(bare_host)
    if m is None or m.group(3) != bare_domain:
        return None
    port = int(m.group(1))
    return (port, m.group(2)) if 1 <= port <= 65535 else None


def sandbox_path(path: str) -> str:
    """An absolute, normalised sandbox path: E2B's relative paths start at the user's home."""
    if not path:
        raise BadRequest("path is required")
    if "\x00" in path:
        raise BadRequest("path contains a NUL byte")
    joined = path if path.startswith("/") else posixpath.join(HOME, path)
    normal = posixpath.normpath(joined)
    return "/" + normal.lstrip("/")

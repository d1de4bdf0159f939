"""Bad input gets a typed error reply (NATS micro headers + error body) and the service keeps serving."""

from __future__ import annotations

import json

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandfleet import errors
from sandfleet.allow_rules import parse_rule
from sandfleet.credentials import connect_options
from schemas import node, sandbox
from schemas.errors import ErrorBody, ErrorCode

KNOWN = set(sandbox.CreateRequest.__struct_fields__)


@pytest.fixture(scope="module")
async def nc(platform):
    conn = await nats.connect(platform.url, **connect_options(platform.url))  # the operator's
    yield conn
    await conn.drain()


async def _error(nc, subject: str, payload: bytes) -> tuple[dict, ErrorBody]:
    msg = await nc.request(subject, payload, timeout=10)
    assert msg.headers and "Nats-Service-Error-Code" in msg.headers, msg.data[:200]
    return msg.headers, msgspec.json.decode(msg.data, type=ErrorBody)


@pytest.mark.parametrize(
    "payload",
    [
        b"{not json",
        b"[]",
        b'"create"',
        b'{"isolation": 7}',
        b'{"isolation": "teleport"}',
        b'{"cpu": -1}',
        b'{"memory_mb": 10000000}',
        b'{"timeout_s": 0}',
        b'{"labels": {"k": 5}}',
        b'{"labels": ' + json.dumps({f"k{i}": "v" for i in range(100)}).encode() + b"}",
    ],
)
async def test_malformed_create_gets_invalid_request(nc, payload):
    headers, body = await _error(nc, sandbox.CREATE, payload)
    assert headers["Nats-Service-Error-Code"] == "400"
    assert body.code is ErrorCode.INVALID_REQUEST
    assert "Traceback" not in body.message


async def test_oversized_payload_gets_invalid_request(nc):
    headers, body = await _error(nc, sandbox.CREATE, b'{"labels": {"a": "' + b"x" * 200_000 + b'"}}')
    assert body.code is ErrorCode.INVALID_REQUEST and "exceeds" in body.message


BAD_RULES = ["http://evil.test", "127.0.0.1:4222", "10.1.2.3/24", "a.*.example.com", "host:0", "[1.2.3.4]:80"]


async def _records(nc) -> set[str]:
    msg = await nc.request(sandbox.LIST, b'{"include_ended": true}', timeout=10)
    return {r.id for r in msgspec.json.decode(msg.data, type=sandbox.SandboxList).sandboxes}


@pytest.mark.parametrize("rule", BAD_RULES)
async def test_placement_refuses_a_bad_allow_rule_from_a_raw_request_before_placing(nc, rule):
    before = await _records(nc)
    for subject, body in ((sandbox.CREATE, {"allow": ["api.example.com", rule]}),
                          (sandbox.CREATE_MANY, {"count": 2, "spec": {"allow": [rule]}})):
        headers, error = await _error(nc, subject, json.dumps(body).encode())
        assert headers["Nats-Service-Error-Code"] == "400" and error.code is ErrorCode.INVALID_REQUEST
        assert repr(rule) in error.message, error.message
        assert "launch failed" not in error.message, "placement itself refuses it, not the node"
    # Only what was added counts: an earlier test's sandbox may end and be purged meanwhile.
    assert not await _records(nc) - before, "a refused create leaves no sandbox record"


async def test_generated_bad_allow_rules_all_get_invalid_request_from_placement(nc):
    rules: list[str] = []

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.text(min_size=1, max_size=40))
    def gather(text):
        try:
            parse_rule(text)
        except ValueError:
            rules.append(text)

    gather()
    assert len(rules) >= 50
    for rule in rules:
        _, error = await _error(nc, sandbox.CREATE, json.dumps({"allow": [rule]}).encode())
        assert error.code is ErrorCode.INVALID_REQUEST and "launch failed" not in error.message, (rule, error)


async def test_the_sdk_sends_nothing_for_a_bad_allow_rule(nc, fleet):
    sent: list[bytes] = []

    async def seen(msg):
        sent.append(msg.data)

    subs = [await nc.subscribe(s, cb=seen) for s in (sandbox.CREATE, sandbox.CREATE_MANY)]
    await nc.flush()
    with pytest.raises(errors.InvalidRequest, match="http://evil.test"):
        await fleet.create(allow=["http://evil.test"])
    with pytest.raises(errors.InvalidRequest, match="host:0"):
        await fleet.create_many(2, allow=["host:0"])
    await fleet.bus.nc.flush()
    await nc.flush()
    assert sent == []
    for sub in subs:
        await sub.unsubscribe()


async def test_exec_on_unknown_sandbox_is_not_found(nc, platform):
    req = msgspec.json.encode(node.ExecRequest(sandbox_id="sb-nope", argv=["true"]))
    headers, body = await _error(nc, node.subject(platform.node_id, node.EXEC), req)
    assert headers["Nats-Service-Error-Code"] == "404" and body.code is ErrorCode.NOT_FOUND


async def test_exec_with_empty_argv_is_invalid(nc, platform):
    _, body = await _error(nc, node.subject(platform.node_id, node.EXEC), b'{"sandbox_id":"sb-x","argv":[]}')
    assert body.code is ErrorCode.INVALID_REQUEST


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
# Every generated create is invalid: it has a field the schema does not know, or is not an object.
bad_creates = st.one_of(
    st.binary(max_size=200).map(lambda b: b"\x00" + b),
    st.dictionaries(st.sampled_from(sorted(KNOWN)), json_values, max_size=3).flatmap(
        lambda d: st.text(min_size=1, max_size=12)
        .filter(lambda k: k not in KNOWN)
        .map(lambda k: json.dumps({**d, k: 1}).encode())
    ),
    st.lists(json_values, max_size=3).map(lambda v: json.dumps(v).encode()),
)


async def test_thousands_of_generated_bad_requests_then_a_valid_create_works(nc, fleet):
    payloads: list[bytes] = []

    @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bad_creates)
    def gather(p):
        payloads.append(p)

    gather()
    assert len(payloads) >= 1000
    for p in payloads:
        msg = await nc.request(sandbox.CREATE, p, timeout=10)
        body = msgspec.json.decode(msg.data, type=ErrorBody)
        assert msg.headers["Nats-Service-Error-Code"] == "400", (p, body)
    sb = await fleet.create(memory_mb=64, host_view=True)
    assert (await sb.exec(["echo", "ok"])).stdout == b"ok\n"
    await sb.destroy()

"""Every subject a client or a node answers, fuzzed like `sandbox.v1.create` (tests/test_bad_input.py).

The subjects are the ones `schemas/` spells, each with the request type its service decodes.
Generated payloads are arbitrary bytes, non-objects, and objects of the request's own fields
holding values of any JSON type (plus, sometimes, a field it does not know); only those the
schema itself refuses are sent, so none can act on the shared platform. Each must get a
typed error reply (NATS micro error headers and an ErrorBody, code `invalid_request`); the
service must not crash (the supervisor would restart it under a new pid) and must answer a
valid request afterwards.

A raw subject (sandfleet.bus.Raw: the request's Struct in the `Sandfleet-Meta` header, bytes
as the body) is fuzzed both ways: arbitrary bodies with the header missing, and arbitrary
bodies under a header that is garbled (not JSON, the wrong fields, values of any type) or over
the body's limit; and the SDK's side of a raw reply whose header is garbled gets a typed error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandfleet import errors
from sandfleet.bus import META, Bus, decode
from sandfleet.credentials import connect_options
from schemas import desktop, files, health, layers, node, pools, ports, pty, reclaim, sandbox, security
from schemas import process as proc_schema
from schemas.errors import ErrorBody, ErrorCode

EXAMPLES = 30  # per subject: ~40 subjects, each payload refused at decoding, so seconds in all
ERROR_CODE = "Nats-Service-Error-Code"


@dataclass(frozen=True)
class Subject:
    service: str  # the supervisor's name for the process that answers it
    verb: str  # a cluster subject, or a node verb (`node.v1.<node>.<verb>`)
    request: type
    probe: dict  # a valid request that changes nothing: answered, whatever the answer
    on_node: bool = True
    raw: bool = False  # the request travels in the META header, bytes as the body

    def address(self, node_id: str) -> str:
        if not self.on_node:
            return self.verb
        if self.verb == reclaim.SAVINGS:
            return reclaim.savings_subject(node_id)
        return node.subject(node_id, self.verb)


NOWHERE = {"sandbox_id": "sb-fuzz-none"}
SUBJECTS = [
    # placement (sandbox.v1.create is fuzzed in tests/test_bad_input.py)
    Subject("placement", sandbox.CREATE_MANY, sandbox.CreateManyRequest, {}, on_node=False),
    Subject("placement", sandbox.GET, sandbox.GetRequest, {"id": "sb-fuzz-none"}, on_node=False),
    Subject("placement", sandbox.LIST, sandbox.ListRequest, {}, on_node=False),
    Subject("placement", sandbox.QUOTA_SET, sandbox.Quota, {"name": "fuzz-none"}, on_node=False),
    Subject("placement", sandbox.QUOTA_GET, sandbox.QuotaGetRequest, {"name": "fuzz-none"}, on_node=False),
    Subject("placement", pools.POOL_SET, pools.Pool, {"spec": {}, "size": 0}, on_node=False),
    Subject("placement", pools.POOL_LIST, pools.PoolListRequest, {}, on_node=False),
    Subject("placement", pools.POOL_CLEAR, pools.PoolClearRequest, {"spec": {"memory_mb": 17}}, on_node=False),
    # security monitor
    Subject("security-monitor", security.POLICY_SET, security.Policy, {"task": "fuzz-none"}, on_node=False),
    Subject("security-monitor", security.POLICY_GET, security.PolicyGetRequest, {"task": "fuzz-none"}, on_node=False),
    Subject("security-monitor", security.POLICY_LIST, security.PolicyListRequest, {}, on_node=False),
    Subject("security-monitor", security.SANDBOX_GET, security.SandboxGetRequest, NOWHERE, on_node=False),
    # layer-cache, cluster-wide
    Subject("layer-cache", layers.BUILD, layers.BuildRequest, {}, on_node=False),
    Subject("layer-cache", layers.LIST, layers.ListRequest, {}, on_node=False),
    Subject("layer-cache", layers.GET, layers.GetRequest, {"ref": "fuzz-none"}, on_node=False),
    Subject("layer-cache", layers.REMOVE, layers.RemoveRequest, {"ref": "fuzz-none"}, on_node=False),
    Subject("layer-cache", layers.PUSH, layers.TransferRequest, {}, on_node=False),
    Subject("layer-cache", layers.PULL, layers.TransferRequest, {}, on_node=False),
    Subject("layer-cache", layers.KNOWN_DIFFS, layers.KnownDiffsRequest, {"diff_ids": []}, on_node=False),
    # layer-cache, this node
    Subject("layer-cache", layers.ROOTFS_COMPOSE, layers.ComposeRequest, {"sandbox_id": "sb-fuzz-none",
                                                                           "layers": ["fuzz-none"]}),
    Subject("layer-cache", layers.ROOTFS_RELEASE, layers.ReleaseRootfsRequest, NOWHERE),
    Subject("layer-cache", layers.CACHE, layers.CacheRequest, {}),
    Subject("layer-cache", layers.CACHE_DROP, layers.CacheDropRequest, {}),
    # launcher
    Subject("launcher", node.LAUNCH, node.LaunchRequest, {}),
    Subject("launcher", pools.CLAIM, pools.ClaimRequest, {"spec": {"memory_mb": 17}}),
    Subject("launcher", node.EXEC, node.ExecRequest, NOWHERE | {"argv": ["true"]}),
    Subject("launcher", node.WRITE_FILE, node.WriteFileRequest, NOWHERE | {"path": "/x", "data": ""}),
    Subject("launcher", node.READ_FILE, node.ReadFileRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", node.DESTROY, node.DestroyRequest, NOWHERE),
    Subject("launcher", node.QUARANTINE, node.QuarantineRequest, NOWHERE),
    Subject("launcher", node.PAUSE, node.PauseRequest, NOWHERE),
    Subject("launcher", node.RESUME, node.ResumeRequest, NOWHERE),
    Subject("launcher", node.PAUSE_SELECTED, node.SelectedRequest, {"labels": {"fuzz": "none"}}),
    Subject("launcher", node.RESUME_SELECTED, node.SelectedRequest, {"labels": {"fuzz": "none"}}),
    Subject("launcher", node.HINT, node.HintRequest, NOWHERE | {"hint": "idle"}),
    Subject("launcher", node.CHECKPOINT, node.CheckpointRequest, NOWHERE | {"name": "fuzz-none"}),
    Subject("launcher", health.SET_TIMEOUT, health.SetTimeoutRequest, NOWHERE | {"timeout_s": 60}),
    Subject("launcher", health.METRICS, health.MetricsRequest, NOWHERE),
    Subject("launcher", health.NODE_METRICS, health.NodeMetricsRequest, {}),
    Subject("launcher", proc_schema.SPAWN, proc_schema.SpawnRequest, NOWHERE | {"argv": ["true"]}),
    Subject("launcher", proc_schema.READ, proc_schema.ReadRequest, NOWHERE | {"pid": 1, "wait_s": 0}),
    Subject("launcher", proc_schema.WRITE, proc_schema.WriteRequest, NOWHERE | {"pid": 1}),
    Subject("launcher", proc_schema.SIGNAL, proc_schema.SignalRequest, NOWHERE | {"pid": 1}),
    Subject("launcher", proc_schema.WAIT, proc_schema.WaitRequest, NOWHERE | {"pid": 1, "wait_s": 0}),
    Subject("launcher", proc_schema.LIST, proc_schema.ListRequest, NOWHERE),
    Subject("launcher", ports.PORT_OPEN, ports.PortOpenRequest, NOWHERE | {"port": 1, "reply_subject": "_INBOX.fuzz"}),
    # launcher: files (schemas/files.py)
    Subject("launcher", files.UPLOAD, files.UploadRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.UPLOAD_CHUNK, files.UploadChunk, NOWHERE | {"transfer_id": "ab", "seq": 0}, raw=True),
    Subject("launcher", files.UPLOAD_END, files.UploadEnd, NOWHERE | {"transfer_id": "ab", "chunks": 0, "size": 0,
                                                                      "digest": "0" * 32}),
    Subject("launcher", files.DOWNLOAD, files.DownloadRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.DOWNLOAD_CHUNK, files.DownloadChunkRequest, NOWHERE | {"transfer_id": "ab", "seq": 0}),
    Subject("launcher", files.CLOSE, files.CloseRequest, NOWHERE | {"transfer_id": "ab"}),
    Subject("launcher", files.LIST, files.ListRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.STAT, files.StatRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.MKDIR, files.MkdirRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.REMOVE, files.RemoveRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.RENAME, files.RenameRequest, NOWHERE | {"src": "/x", "dst": "/y"}),
    Subject("launcher", files.WATCH, files.WatchRequest, NOWHERE | {"path": "/x"}),
    Subject("launcher", files.WATCH_NEXT, files.WatchNextRequest, NOWHERE | {"watch_id": "ab", "wait_s": 0}),
    Subject("launcher", files.WATCH_CLOSE, files.WatchCloseRequest, NOWHERE | {"watch_id": "ab"}),
    # launcher: terminals (schemas/pty.py)
    Subject("launcher", pty.PTY_SPAWN, pty.PtySpawnRequest, NOWHERE | {"argv": ["sh"]}),
    Subject("launcher", pty.PTY_RESIZE, pty.ResizeRequest, NOWHERE | {"pid": 1, "cols": 80, "rows": 24}),
    # launcher: screens (schemas/desktop.py)
    Subject("launcher", desktop.SCREEN_INFO, desktop.ScreenInfoRequest, NOWHERE),
    Subject("launcher", desktop.SCREENSHOT, desktop.ScreenshotRequest, NOWHERE),
    Subject("launcher", desktop.MOUSE, desktop.MouseRequest, NOWHERE | {"x": 1, "y": 1}),
    Subject("launcher", desktop.KEYS_PRESS, desktop.KeysRequest, NOWHERE | {"keys": ["Return"]}),
    Subject("launcher", desktop.TYPE_TEXT, desktop.TypeRequest, NOWHERE | {"text": "x"}),
    # node agent
    Subject("agent", node.CONFINE, node.ConfineRequest, {}),
    Subject("agent", node.RELEASE, node.ReleaseRequest, NOWHERE),
    Subject("agent", node.AGENT_LIST, node.Empty, {}),
    Subject("agent", node.SECURITY, node.Empty, {}),
    # reclaimer
    Subject("reclaimer", reclaim.SAVINGS, reclaim.SavingsRequest, {}),
]
# A probe that would act (create, build, confine, launch, drop the cache, transfer) is replaced
# by one to the same service that only reads.
READ_ONLY = {s.service: s for s in SUBJECTS if s.verb in (sandbox.LIST, layers.LIST, node.EXEC, node.AGENT_LIST)}
ACTING = {sandbox.CREATE_MANY, layers.BUILD, layers.PUSH, layers.PULL, layers.CACHE_DROP, node.LAUNCH, node.CONFINE,
          pools.POOL_SET, pools.CLAIM}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def _payloads(request: type) -> st.SearchStrategy[bytes]:
    fields = sorted(request.__struct_fields__)
    objects = st.dictionaries(st.sampled_from(fields), json_values, max_size=4) if fields else st.just({})
    with_unknown = objects.flatmap(lambda d: st.text(min_size=1, max_size=12).map(lambda k: {**d, k: 1}))
    candidates = st.one_of(
        st.binary(max_size=200),
        objects.map(lambda d: json.dumps(d).encode()),
        with_unknown.map(lambda d: json.dumps(d).encode()),
        st.lists(json_values, max_size=3).map(lambda v: json.dumps(v).encode()),
        json_values.map(lambda v: json.dumps(v).encode()),
    )
    return candidates.filter(lambda p: _refused(p, request))


def _refused(payload: bytes, request: type) -> bool:
    """Whether the services' own decoding refuses it (an empty body stands for `{}` there)."""
    try:
        decode(payload, request)
    except msgspec.MsgspecError:
        return True
    return False


def _gather(request: type) -> list[bytes]:
    found: list[bytes] = []

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_payloads(request))
    def gather(p):
        found.append(p)

    gather()
    return found


@pytest.fixture(scope="module")
async def nc(platform):
    conn = await nats.connect(platform.url, **connect_options(platform.url))  # the operator's
    yield conn
    await conn.drain()


async def _answered(nc, subject: str, payload: dict, raw: bool = False) -> None:
    """A valid request gets a reply: a result, or a typed error that is not about its shape."""
    if raw:
        msg = await nc.request(subject, b"\x00garbage body", headers={META: json.dumps(payload)}, timeout=30)
    else:
        msg = await nc.request(subject, json.dumps(payload).encode(), timeout=30)
    if msg.headers and ERROR_CODE in msg.headers:
        body = msgspec.json.decode(msg.data, type=ErrorBody)
        assert body.code is not ErrorCode.INVALID_REQUEST, (subject, payload, body)


@pytest.mark.parametrize("s", SUBJECTS, ids=[f"{s.service}:{s.verb}" for s in SUBJECTS])
async def test_generated_bad_requests_get_typed_errors_and_the_service_serves_on(nc, platform, s):
    pid = platform.service_pid(s.service)
    subject = s.address(platform.node_id)
    payloads = _gather(s.request)
    assert len(payloads) >= EXAMPLES // 2, f"too few refused payloads generated for {s.request.__name__}"
    for p in payloads:
        msg = await nc.request(subject, p, timeout=10)
        assert msg.headers and msg.headers.get(ERROR_CODE) == "400", (subject, p, msg.headers, msg.data[:300])
        body = msgspec.json.decode(msg.data, type=ErrorBody)
        assert body.code is ErrorCode.INVALID_REQUEST and "Traceback" not in body.message, (subject, p, body)

    probe = READ_ONLY[s.service] if s.verb in ACTING else s
    await _answered(nc, probe.address(platform.node_id), probe.probe, probe.raw)
    assert platform.service_pid(s.service) == pid, f"{s.service} was restarted: it crashed on a payload"


RAW = [s for s in SUBJECTS if s.raw]
header_values = st.one_of(
    st.text(max_size=60),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
    json_values.map(json.dumps),
    st.dictionaries(st.text(max_size=12), json_values, max_size=4).map(json.dumps),
).map(lambda v: v.replace("\r", "").replace("\n", "").strip())


def _garbled(request: type) -> list[tuple[str, bytes]]:
    """(META header value, body) pairs whose header the service's decoding refuses."""
    fields = sorted(request.__struct_fields__)
    near = st.dictionaries(st.sampled_from(fields), json_values, max_size=len(fields)).map(json.dumps)
    pairs = st.tuples(st.one_of(header_values, near), st.binary(max_size=300))
    found: list[tuple[str, bytes]] = []

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(pairs.filter(lambda p: _refused(p[0].encode(), request)))
    def gather(p):
        found.append(p)

    gather()
    return found


@pytest.mark.parametrize("s", RAW, ids=[f"{s.service}:{s.verb}" for s in RAW])
async def test_raw_bodies_under_garbled_or_oversized_headers_get_typed_errors(nc, platform, s):
    pid = platform.service_pid(s.service)
    subject = s.address(platform.node_id)
    cases = _garbled(s.request)
    assert len(cases) >= EXAMPLES // 2, f"too few garbled headers generated for {s.request.__name__}"
    too_big = b"\0" * (files.CHUNK_BYTES + 1)  # a valid header, a body past the chunk's limit
    for header, body in [*cases, (json.dumps(s.probe), too_big)]:
        msg = await nc.request(subject, body, headers={META: header} if header else None, timeout=10)
        assert msg.headers and msg.headers.get(ERROR_CODE) == "400", (subject, header, msg.headers, msg.data[:300])
        reply = msgspec.json.decode(msg.data, type=ErrorBody)
        assert reply.code is ErrorCode.INVALID_REQUEST and "Traceback" not in reply.message, (subject, header, reply)
    await _answered(nc, subject, s.probe, raw=True)
    assert platform.service_pid(s.service) == pid, f"{s.service} was restarted: it crashed on a raw payload"


async def test_a_raw_reply_with_a_garbled_header_is_a_typed_error_in_the_sdk(platform):
    """The client's side of raw replies (file chunks down, process output): whatever a responder
    puts in the header, `request_raw` raises a typed error, never a foreign exception."""
    bus = await Bus.connect(platform.url, "fuzz-raw-replies")
    responder = await nats.connect(platform.url, **connect_options(platform.url))
    subject = responder.new_inbox()  # a subject of nobody's: only this responder answers it
    headers = iter(["{not json", '{"type":"files.download_chunk.v2","seq":"x"}', "[]", '{"type":"other"}', ""])

    async def answer(msg):
        value = next(headers)
        await responder.publish(msg.reply, b"\xff\x00body", headers={META: value or " "})

    sub = await responder.subscribe(subject, cb=answer)
    await responder.flush()  # the server has the subscription before the first request
    try:
        for _ in range(5):
            req = files.DownloadChunkRequest(sandbox_id="sb-fuzz-none", transfer_id="ab", seq=0)
            with pytest.raises(errors.InternalError, match="undecodable reply"):
                await bus.request_raw(subject, req, files.DownloadChunk, timeout=10)
    finally:
        await sub.unsubscribe()
        await responder.drain()
        await bus.close()


def test_every_subject_the_launcher_serves_is_fuzzed():
    """The launcher gains subjects with every capability: one left out of SUBJECTS fails here."""
    from types import SimpleNamespace

    from services.launcher.__main__ import endpoints

    launcher = SimpleNamespace(node_id="fuzz-node")
    served = {ep.subject for ep in endpoints(launcher, None, SimpleNamespace(launcher=launcher),  # type: ignore[arg-type]
                                             SimpleNamespace(claim=None))}
    fuzzed = {s.address("fuzz-node") for s in SUBJECTS if s.service == "launcher"}
    assert served == fuzzed, f"served, not fuzzed: {sorted(served - fuzzed)}; fuzzed, not served: {sorted(fuzzed - served)}"

"""The one bus adapter: typed request/reply, publish, JetStream publish, and service endpoints.

Every message is JSON from a msgspec Struct, except bulk bytes (file chunks, process output):
a `Raw` message carries its Struct as JSON in the `Sandfleet-Meta` header and its bytes as the
body as they are, so a chunk costs no base64 and no JSON around its data (`request_raw`, and
`Endpoint(raw=True)` or a handler returning `Raw` on the service side); those bytes are read
into one buffer and sent unjoined to their frame (natspy_bulk). Outgoing messages carry
W3C trace context in headers; every handled request runs inside a span whose parent is the caller's. Handler
errors become NATS micro error headers plus an `ErrorBody`, and transport failures become
the `sandfleet.errors` tree, so neither side ever sees a foreign exception or a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamConfig, StreamInfo
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from nats.micro.service import EndpointConfig, Service, ServiceConfig
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from sandfleet import credentials, errors, natspy_bulk, natspy_internals, telemetry
from sandfleet.config import js_replicas, nats_servers
from schemas.errors import ErrorBody, ErrorCode

log = logging.getLogger("sandfleet.bus")
T = TypeVar("T")

# What JetStream answers while a clustered bus fails over (a server gone, a leader being
# elected): worth asking again, unlike a refusal.
TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
FAILOVER_S = 30.0  # a 3-server loopback cluster elects a new leader within ~8 s
# A closing service waits this long for its subscriptions to drain (nats-py's default is 30 s:
# one stuck subscription made every `down` that much slower).
DRAIN_TIMEOUT_S = 5
_WRITE_CHUNK = 1 << 20  # publish_many hands the connection frames in pieces of about this size
natspy_internals.read_per_turn(8 << 20)  # raw 4 MiB chunks in a turn or two, not 128

_REFUSED_PUBLISH = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)  # the server's -ERR
META = "Sandfleet-Meta"  # the header holding a raw message's Struct (JSON, one line)
# The tenant the server says sent the request being handled (None: from inside the platform's
# account), set for each request's own task: what placement records and the node checks.
CALLER_TENANT: ContextVar[str | None] = ContextVar("caller_tenant", default=None)

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}
_error_decoder = msgspec.json.Decoder(ErrorBody)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: type[T]) -> T:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decoder.decode(data or b"{}")


@dataclass(frozen=True)
class Raw:
    """A message of bulk bytes: `meta` travels in the META header, `data` is the body unchanged."""

    meta: Any
    data: natspy_bulk.Payload = b""  # bytes, a file range sent by sendfile, or parts sent as one


@dataclass(frozen=True)
class Endpoint:
    """One subject a service answers: requests are decoded into `request`, then `handler` runs.

    With `raw`, the request is a `Raw`: `request` is decoded from its META header and the
    handler is called as `handler(meta, body)`; `max_bytes` bounds the body. Any handler may
    answer with a `Raw` instead of a Struct."""

    name: str
    subject: str
    request: type
    handler: Callable[..., Awaitable[Any]]
    max_bytes: int = 64 * 1024
    queue_group: str | None = None
    raw: bool = False


async def through_failover(op: Callable[[], Awaitable[T]], what: str, within_s: float = FAILOVER_S) -> T:
    """Run a JetStream operation, again while the cluster fails over, for up to `within_s`;
    then a typed TIMEOUT. Only for operations a repeat cannot double (revision-checked or
    de-duplicated writes, reads)."""
    deadline = asyncio.get_running_loop().time() + within_s
    delay = 0.1
    while True:
        try:
            return await op()
        except TRANSIENT as exc:
            if asyncio.get_running_loop().time() + delay > deadline:
                raise errors.ServiceError(
                    ErrorCode.TIMEOUT, f"JetStream did not answer {what} within {within_s:g}s: {exc}"
                ) from None
            log.info("JetStream %s: %s; again in %.1fs", what, type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


async def kv_values(kv: KeyValue, what: str, timeout: float = 30.0, gone: set[str] | None = None) -> dict[str, bytes]:
    """Every key's current value in a KV bucket, in one pass (one ordered consumer of each key's
    last message), instead of nats-py's `keys()` then a read per key.

    nats-py's end-of-listing marker can come before the entries already on their way (it
    compares the server's pending count, 0 once they are sent, with what its callback has
    handled), so a listing ending there could miss keys or come back empty. This one ends at
    the entry with nothing pending after it, or at the stream's last message when the listing
    began (writes may go on meanwhile). A key written during the listing keeps its last value;
    one deleted meanwhile is left out. `gone`, if given, gets the keys whose last entry is a
    delete or purge marker (a key that had a value, unlike one never written)."""
    state = (await through_failover(kv.status, what)).stream_info.state
    if state.messages == 0:
        return {}
    watcher = await through_failover(kv.watchall, what)
    latest: dict[str, bytes] = {}
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=timeout)
            except nats.errors.TimeoutError:  # unreadable is not absent
                raise errors.ServiceError(ErrorCode.TIMEOUT, f"{what} stalled for {timeout:g} s") from None
            if entry is None:
                continue  # nats-py's marker: see above
            if entry.value:
                latest[entry.key] = entry.value
                if gone is not None:
                    gone.discard(entry.key)
            else:
                latest.pop(entry.key, None)
                if gone is not None:
                    gone.add(entry.key)
            if entry.delta == 0 or entry.revision >= state.last_seq:
                return latest
    finally:
        await watcher.stop()


class ReplicatedJetStream(JetStreamContext):
    """JetStream whose every new stream, and so every KV bucket and object store, is kept by
    `replicas` servers, whichever service creates it: on a clustered bus no state lives on
    one server only (SANDFLEET_JS_REPLICAS, which `sandfleet up --nats-cluster 3` sets to 3)."""

    def __init__(self, nc: nats.NATS, replicas: int) -> None:
        super().__init__(nc)
        self.replicas = replicas

    async def add_stream(self, config: StreamConfig | None = None, **params: Any) -> StreamInfo:
        config = (config or StreamConfig()).evolve(**params)
        if self.replicas > (config.num_replicas or 1):
            config = config.evolve(num_replicas=self.replicas)
        return await super().add_stream(config)


class Refusals:
    """The server's refusals of this connection's publishes, and the requests they cut short.

    A publish these credentials may not make is dropped by the server, which says so at once
    in an `-ERR` (nats-py's error callback); the request itself would only time out. So each
    request notes its task while it waits, and a refusal of its subject cancels it, to leave
    as Forbidden at once instead of a Timeout many seconds later."""

    def __init__(self) -> None:
        self._when: dict[str, float] = {}  # subject → when the server last refused a publish to it
        self._waiting: dict[str, set[asyncio.Task]] = {}
        self._cut: set[asyncio.Task] = set()

    def asking(self, subject: str) -> asyncio.Task | None:
        task = asyncio.current_task()
        if task is not None:
            self._waiting.setdefault(subject, set()).add(task)
        return task

    def done(self, subject: str, task: asyncio.Task | None) -> None:
        waiting = self._waiting.get(subject)
        if waiting is not None:
            waiting.discard(task)  # type: ignore[arg-type]
            if not waiting:
                del self._waiting[subject]

    def refused(self, subject: str) -> None:
        self._when[subject] = time.monotonic()
        for task in self._waiting.pop(subject, ()):
            if not task.done():
                self._cut.add(task)
                task.cancel()

    def cut_short(self, task: asyncio.Task | None) -> bool:
        """Whether this cancellation was a refusal's (then it is taken back), not the caller's."""
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    def refused_since(self, subject: str, since: float) -> bool:
        return self._when.get(subject, -1.0) >= since


class Bus:
    def __init__(self, nc: nats.NATS, name: str, refusals: Refusals | None = None) -> None:
        self.nc = nc
        self.name = name
        self._refusals = refusals if refusals is not None else Refusals()
        self._bulk_subjects = natspy_bulk.read_bulk_in_place(nc)  # the raw endpoints' (serve)
        self.js: JetStreamContext = ReplicatedJetStream(nc, js_replicas())
        self._tasks: set[asyncio.Task] = set()
        self._services: list[Service] = []
        self._tracer = telemetry.tracer(name)

    @classmethod
    async def connect(cls, url: str, name: str, deadline_s: float = 5.0, *, creds: str | Path | None = None,
                      **options: Any) -> Bus:
        """Connect, or raise NoResponders within `deadline_s` (nats-py alone retries forever).

        `url` may list a cluster's servers, comma-separated: the client fails over between them.
        Signs in with `creds`, else the credentials `sandfleet.credentials` finds for `url` (none
        found: none sent); a bus that refuses them says so in the NoResponders' message."""
        refused: list[str] = []  # nats-py retries a refused sign-in until the deadline: say why it timed out

        refusals = Refusals()

        async def quiet(exc: Exception) -> None:  # nats-py prints a traceback for every hiccup otherwise
            log.debug("nats: %s", exc)
            if refused or "authorization violation" in str(exc).lower():
                refused.append(str(exc))
            denied = _REFUSED_PUBLISH.search(str(exc))
            if denied:
                refusals.refused(denied.group(1))

        try:
            signed = credentials.connect_options(url, creds)
        except (OSError, credentials.CredentialsError) as exc:
            raise errors.NoResponders(f"cannot sign in to NATS at {url}: {exc}") from None
        settings = dict(name=name, connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                        drain_timeout=DRAIN_TIMEOUT_S, error_cb=quiet, **signed)
        try:
            nc = await asyncio.wait_for(nats.connect(nats_servers(url), **{**settings, **options}), deadline_s)
        except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
            if refused or "authorization violation" in str(exc).lower():
                raise errors.NoResponders(f"NATS at {url} refused the credentials (or wants some): see "
                                          f"`sandfleet tenant add`, --creds, ${credentials.CREDS_ENV}") from None
            raise errors.NoResponders(f"cannot reach NATS at {url}: {str(exc) or 'timed out'}") from None
        return cls(nc, name, refusals)

    async def close(self) -> None:
        for service in self._services:
            await service.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if not self.nc.is_closed:
            await self.nc.drain()

    # -- client side --------------------------------------------------------------------

    async def request(self, subject: str, msg: Any, reply: type[T], timeout: float = 5.0) -> T:
        with self._tracer.start_as_current_span(f"send {subject}", kind=SpanKind.CLIENT) as span:
            span.set_attribute(telemetry.SUBJECT, subject)
            payload = msg if isinstance(msg, bytes) else encode(msg)
            try:
                resp = await self._ask(subject, payload, telemetry.inject(), timeout)
            except errors.ServiceFailure as failure:
                span.set_status(Status(StatusCode.ERROR, failure.message))
                raise
            return _decoded(resp.data, reply, subject)

    async def request_raw(self, subject: str, msg: Any, reply: type[T], *, data: bytes | memoryview | None = None,
                          timeout: float = 5.0) -> tuple[T, bytes | bytearray]:
        """A request/reply where either side may be raw: with `data`, `msg` goes in the META
        header and `data` is the body; a reply with a META header is decoded from it and its
        body returned as it came (a large one as the bytearray it was read into), any other
        reply is decoded from its body (then b""). Neither body is copied to be joined to its
        frame (natspy_bulk.request_bulk).
        No span of its own: it carries bulk bytes, many a second, under the caller's span."""
        headers = telemetry.inject()
        if data is not None:
            headers[META] = encode(msg).decode()
        resp = await self._ask(subject, encode(msg) if data is None else data, headers, timeout, bulk=True)
        meta = (resp.headers or {}).get(META)
        if meta is not None:
            return _decoded(meta.encode(), reply, subject), resp.data
        return _decoded(resp.data, reply, subject), b""

    async def _ask(self, subject: str, payload: bytes | memoryview, headers: dict[str, str], timeout: float,
                   bulk: bool = False) -> Msg:
        """One request; transport failures and error replies as the sandfleet.errors tree. `bulk`:
        sent and its reply read with fewer copies (natspy_bulk.request_bulk), the reply's
        body then a bytearray."""
        asked = time.monotonic()
        task = self._refusals.asking(subject)
        try:
            if bulk:
                resp = await natspy_bulk.request_bulk(self.nc, subject, headers, payload, timeout)
            else:
                resp = await self.nc.request(subject, payload, timeout=timeout,  # type: ignore[arg-type]
                                             headers=headers)
        except asyncio.CancelledError:
            if not self._refusals.cut_short(task):
                raise
            raise errors.Forbidden(f"the bus does not let these credentials ask {subject}", subject=subject) from None
        except nats.errors.NoRespondersError:
            raise errors.NoResponders(f"no service answers {subject}", subject=subject) from None
        except nats.errors.TimeoutError:
            if self._refusals.refused_since(subject, asked):
                raise errors.Forbidden(f"the bus does not let these credentials ask {subject}",
                                       subject=subject) from None
            raise errors.Timeout(f"no reply on {subject} within {timeout:g}s", subject=subject) from None
        except nats.errors.MaxPayloadError:
            raise errors.InvalidRequest(
                f"request of {len(payload)} bytes exceeds the bus's maximum payload", subject=subject
            ) from None
        finally:
            self._refusals.done(subject, task)
        failure = reply_error(resp, subject)
        if failure is not None:
            raise failure
        return resp

    async def publish(self, subject: str, msg: Any) -> None:
        await self.nc.publish(subject, encode(msg), headers=telemetry.inject())

    async def publish_durable(self, subject: str, msg: Any, msg_id: str) -> None:
        """JetStream publish, de-duplicated by `msg_id` so a retried publish is stored once."""
        headers = telemetry.inject({"Nats-Msg-Id": msg_id})
        payload = encode(msg)
        await through_failover(lambda: self.js.publish(subject, payload, headers=headers), f"publish {subject}")

    async def publish_many(self, messages: list[tuple[str, bytes, dict[str, str] | None, str]]) -> None:
        """Many (subject, payload, headers, reply) publishes handed to the connection in large writes.

        nats-py has no batch publish, and its `publish` costs ~30 µs a message here (validation,
        header encoding, a buffer check per call): most of a 32,000-sandbox batch's time. These
        are the same PUB/HPUB frames it writes, built in one pass. Only for subjects, replies and
        headers this process made (ids, digits: no spaces or newlines). While the connection is
        down they go through `publish` one by one, so nats-py's reconnect buffering applies."""
        nc = self.nc
        if any(len(payload) > nc.max_payload for _, payload, _, _ in messages):  # the server would drop us
            raise errors.InvalidRequest(f"a message exceeds the bus's maximum payload of {nc.max_payload} bytes")
        if not nc.is_connected or nc.is_draining_pubs:  # publish knows what to do (buffer, or refuse)
            for subject, payload, headers, reply in messages:
                await nc.publish(subject, payload, reply=reply, headers=headers)
            return
        chunk: list[bytes] = []
        size = 0
        for subject, payload, headers, reply in messages:
            target = f"{subject} {reply}" if reply else subject
            if headers:
                hdr = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
                frame = b"".join((f"HPUB {target} {len(hdr)} {len(hdr) + len(payload)}\r\n".encode(),
                                  hdr, payload, b"\r\n"))
            else:
                frame = b"".join((f"PUB {target} {len(payload)}\r\n".encode(), payload, b"\r\n"))
            chunk.append(frame)
            size += len(frame)
            if size >= _WRITE_CHUNK:
                await natspy_internals.write_frames(nc, b"".join(chunk))
                chunk, size = [], 0
        if chunk:
            await natspy_internals.write_frames(nc, b"".join(chunk))
        nc.stats["out_msgs"] += len(messages)
        await natspy_internals.flush_frames(nc)

    async def subscribe_direct(self, subject: str, handler: Callable[[Msg], None]) -> Any:
        """A subscription whose messages go to `handler` (a plain function: quick, never blocking)
        as the connection reads them, instead of through nats-py's per-subscription queue and
        task. That queue hop costs several µs a message; the store's write acks and a batch's
        events come by the tens of thousands. The subscription unsubscribes as any other."""
        sub = await self.nc.subscribe(subject, pending_bytes_limit=-1)  # no callback: nats-py starts no task
        natspy_internals.hand_directly(sub, handler)
        return sub

    # -- service side -------------------------------------------------------------------

    async def serve(
        self, name: str, endpoints: list[Endpoint], *, version: str = "0.1.0", queue_group: str | None = None
    ) -> Service:
        """Start a nats.micro service (PING/INFO/STATS for health) with these endpoints.

        Each request is handled in its own task, so one slow exec never holds up the next.
        """
        service = await add_service(
            self.nc, ServiceConfig(name=name, version=version, description=name, queue_group=queue_group)
        )
        for ep in endpoints:
            if ep.raw:  # its requests' bodies are read into one buffer each (natspy_bulk)
                self._bulk_subjects.add(ep.subject.encode())
            await service.add_endpoint(
                EndpointConfig(
                    name=ep.name,
                    subject=ep.subject,
                    handler=self._dispatcher(ep),
                    queue_group=ep.queue_group or queue_group or name,
                )
            )
        self._services.append(service)
        return service

    def _dispatcher(self, ep: Endpoint) -> Callable[[Request], Awaitable[None]]:
        async def dispatch(req: Request) -> None:
            task = asyncio.create_task(self._handle(ep, req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return dispatch

    async def _handle(self, ep: Endpoint, req: Request) -> None:
        parent = telemetry.extract(req.headers)
        with self._tracer.start_as_current_span(
            ep.subject, context=parent, kind=SpanKind.SERVER, attributes={telemetry.SUBJECT: req.subject}
        ) as span:
            try:
                if len(req.data) > ep.max_bytes:
                    raise errors.ServiceError(
                        ErrorCode.INVALID_REQUEST, f"payload of {len(req.data)} bytes exceeds {ep.max_bytes}"
                    )
                if ep.raw:
                    meta = (req.headers or {}).get(META)
                    if meta is None:
                        raise errors.ServiceError(ErrorCode.INVALID_REQUEST, f"a raw request needs its {META} header")
                    text = meta.encode()
                else:
                    text = req.data
                try:
                    msg = decode(text, ep.request)
                except msgspec.ValidationError as exc:
                    raise errors.ServiceError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}") from None
                except msgspec.DecodeError as exc:
                    raise errors.ServiceError(ErrorCode.INVALID_REQUEST, f"malformed JSON: {exc}") from None
                CALLER_TENANT.set(credentials.tenant_of(req.headers))
                sandbox_id = getattr(msg, "sandbox_id", None)  # most node requests concern one sandbox
                if isinstance(sandbox_id, str):
                    span.set_attribute(telemetry.SANDBOX_ID, sandbox_id)
                result = await (ep.handler(msg, req.data) if ep.raw else ep.handler(msg))
                if isinstance(result, Raw):  # its bytes go to the socket as they are, not joined to the frame
                    await natspy_bulk.publish_bulk(self.nc, natspy_bulk.reply_to(req), "",
                                                        {META: encode(result.meta).decode()}, result.data)
                else:
                    await req.respond(encode(result))
            except errors.ServiceError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                span.set_attribute(telemetry.ERROR_CODE, exc.code.value)  # what metrics count errors by
                await _respond_error(req, exc)
            except asyncio.CancelledError:
                await _respond_error(req, errors.ServiceError(ErrorCode.INTERNAL, "service is shutting down"))
                raise
            except Exception as exc:  # a bug in a handler must not reach the caller as a traceback
                log.exception("handler for %s failed", ep.subject)
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                await _respond_error(
                    req, errors.ServiceError(ErrorCode.INTERNAL, f"{ep.name} failed: {type(exc).__name__}")
                )


async def _respond_error(req: Request, exc: errors.ServiceError) -> None:
    try:
        await req.respond_error(str(exc.status), exc.message, data=encode(exc.body()))
    except nats.errors.Error:
        log.warning("could not send error reply for %s", req.subject)


def _decoded(data: bytes, reply: type[T], subject: str) -> T:
    try:
        return decode(data, reply)
    except msgspec.MsgspecError as exc:
        raise errors.InternalError(f"undecodable reply on {subject}: {exc}", subject=subject) from None


def reply_error(resp: Msg, subject: str) -> errors.ServiceFailure | None:
    headers = resp.headers or {}
    if ERROR_CODE_HEADER not in headers:
        return None
    try:
        body = _error_decoder.decode(resp.data)
    except msgspec.MsgspecError:
        body = ErrorBody(code=ErrorCode.INTERNAL, message=headers.get(ERROR_HEADER, "unknown error"))
    return errors.from_body(body, subject)


def current_span() -> trace.Span:
    return trace.get_current_span()

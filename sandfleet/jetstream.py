"""JetStream in batches, and every `$JS`/`$KV`/`$O` subject sandfleet speaks: pipelined request bursts,
fast-ingest batches, batched direct gets, all answered on one reply subscription.

Through nats-py every JetStream write is a request of its own (its own reply future, ~30 µs of
publish overhead, one awaited ack); for a 32,000-sandbox batch that is most of the time. `BatchedJetStream` sends a batch back to back (`Bus.publish_many`)
and sorts the replies as the connection reads them (`Bus.subscribe_direct`) by the token each
request's reply subject carries. It knows subjects, headers and reply frames, never records.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg

from sandfleet import errors
from sandfleet.bus import Bus, encode
from schemas.errors import ErrorCode

T = TypeVar("T")
Message = tuple[str, bytes, dict[str, str] | None]  # subject, payload, headers

INGEST_CHUNK = 2000  # messages per fast-ingest batch
MULTI_LAST_MAX = 1024  # keys the server matches in one multi_last direct get
_NO_MESSAGE = 10037  # JetStream's "no message found": the key has no value
_BATCH_DISABLED = 10205  # JetStream's "batch publish is disabled": the stream has no allow_batched


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


def direct_get_subject(stream: str) -> str:
    """Where a stream's messages are read by sequence (any replica answers)."""
    return f"$JS.API.DIRECT.GET.{stream}"


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"  # nats-py's Object Store keeps a bucket in this stream


def object_chunk_subject(bucket: str, nuid: str) -> str:
    """An Object Store object's chunks, in order, are the messages on this subject."""
    return f"$O.{bucket}.C.{nuid}"


def _msg_get_subject(stream: str) -> str:
    return f"$JS.API.STREAM.MSG.GET.{stream}"


# -- what a bus user must be allowed to publish to reach JetStream (sandfleet/bus_accounts.py) --

JS_API_ALL = "$JS.API.>"
JS_API_INFO = "$JS.API.INFO"


def stream_api_subjects(stream: str, *, write: bool = False) -> list[str]:
    """One stream's JetStream API: info, direct and by-sequence reads, consumers on it (create,
    next, delete; acks and flow control); with `write`, creating and updating it."""
    # STREAM.NAMES: nats-py finds a stream by subject for a subscription that names none (names only)
    api = [JS_API_INFO, "$JS.API.STREAM.NAMES", f"$JS.API.STREAM.INFO.{stream}", direct_get_subject(stream), f"{direct_get_subject(stream)}.>",
           _msg_get_subject(stream), f"$JS.API.CONSUMER.*.{stream}", f"$JS.API.CONSUMER.*.{stream}.>",
           f"$JS.API.CONSUMER.*.*.{stream}.>", f"$JS.ACK.{stream}.>", "$JS.FC.>"]
    if write:
        api += [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}"]
    return api


def stream_reader_subjects(stream: str) -> list[str]:
    """One stream read as nats-py reads by itself, and nothing of other users' consumers: info,
    direct and by-sequence reads, consumers the server names (created unnamed) and their info,
    flow control; no consumer delete, pull or ack, no named or durable consumer."""
    direct = direct_get_subject(stream)
    return [JS_API_INFO, "$JS.API.STREAM.NAMES", f"$JS.API.STREAM.INFO.{stream}", direct, f"{direct}.>",
            _msg_get_subject(stream), f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.*",
            "$JS.FC.>"]


def stream_create_subject(stream: str) -> str:
    return f"$JS.API.STREAM.CREATE.{stream}"


def object_write_subjects(bucket: str) -> list[str]:
    """Putting objects: chunks and meta, and the purge that replaces an object's old chunks."""
    return [f"$O.{bucket}.>", f"$JS.API.STREAM.PURGE.{object_stream(bucket)}"]


class _Ack(msgspec.Struct):
    seq: int = 0


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _StoredMsg(msgspec.Struct):
    data: str = ""
    seq: int = 0
    subject: str = ""


class _MsgGet(msgspec.Struct):
    message: _StoredMsg | None = None
    error: _ApiError | None = None


class _IngestFrame(msgspec.Struct):
    """What comes back on a fast-ingest batch's inbox: flow frames (`type` ack/gap/err), then
    one terminal frame (`stream` set) with the count stored or the batch's error."""

    type: str = ""
    stream: str = ""
    count: int = 0
    error: _ApiError | None = None


_ack = msgspec.json.Decoder(_Ack)
_msg_get = msgspec.json.Decoder(_MsgGet)
_ingest_frame = msgspec.json.Decoder(_IngestFrame)


def refusal(reply: Msg) -> str:
    """Why JetStream refused a publish or request ("" if it did not): its error reply, or a
    status such as 503 (no stream takes the subject)."""
    if b'"error"' in reply.data or (reply.headers and reply.headers.get("Status")):
        return reply.data[:200].decode(errors="replace") or f"status {(reply.headers or {}).get('Status')}"
    return ""


@dataclass
class _Burst:
    """Requests answered one reply each, on `<reply>.<n>`."""

    replies: list[Msg | None]
    left: int
    done: asyncio.Future


@dataclass
class _Ingest:
    """One fast-ingest batch in flight: its terminal frame, and the first error frame seen."""

    size: int
    done: asyncio.Future
    error: str = ""


@dataclass
class _Batch:
    """A direct get answered by many messages on one reply subject, ended by a status message."""

    done: asyncio.Future
    found: list[Msg] = dataclasses.field(default_factory=list)
    status: str = ""
    description: str = ""
    pending: int = 0  # messages the server had left when it ended the batch (more matches than asked)


class BatchedJetStream:
    """JetStream requests by the batch, over one reply subscription on the bus's connection (made
    on first use); any number of batches may be in flight at once."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._mux: Any = None  # the one reply subscription, made on first use
        self._mux_prefix = ""
        self._tokens = 0
        self._waiting: dict[str, _Burst | _Ingest | _Batch] = {}
        self._batch_base = secrets.token_hex(8)  # + a token: a batch id no other sender uses
        self.fast_ingest = True  # appends go as fast-ingest batches until a stream refuses them

    async def kv_write_many(self, bucket: str, writes: list[tuple[str, bytes, int]],
                            timeout: float) -> tuple[list[int], dict[int, str]]:
        """Revision-checked puts of (key, value, expected revision; 0: the key must not exist,
        as `kv.create` asks), one burst. Returns each write's new revision (0 if refused) and,
        by position, the server's answer to each refused one."""
        prefix, expect = kv_subject(bucket, ""), "Nats-Expected-Last-Subject-Sequence"
        acks = await self.burst([(prefix + key, value, {expect: str(revision)}) for key, value, revision in writes],
                                timeout)
        whys = [refusal(ack) for ack in acks]
        return ([0 if why else _ack.decode(ack.data).seq for why, ack in zip(whys, acks)],
                {n: why for n, why in enumerate(whys) if why})

    async def kv_read_many(self, bucket: str, keys: list[str], value: Callable[[bytes], T],
                           timeout: float, gone: set[str] | None = None) -> dict[str, tuple[T, int]]:
        """Each key's current `value(bytes)` with its revision; a key with none (never written,
        deleted or purged) is left out, and `gone`, if given, gets those deleted or purged. Batched direct gets (`multi_last`, up to 1,024 keys a
        request, answered by any replica of the bucket rather than queued at its leader's
        JetStream API); on a bucket that serves no direct gets, one pipelined read per key."""
        if not keys:
            return {}
        chunks = [keys[i : i + MULTI_LAST_MAX] for i in range(0, len(keys), MULTI_LAST_MAX)]
        batches = await asyncio.gather(*(self._read_batch(bucket, chunk, timeout) for chunk in chunks))
        if any(batch is None for batch in batches):
            return await self._read_each(bucket, keys, value, timeout, gone)
        found = {}
        prefix = len(kv_subject(bucket, ""))
        for batch in batches:
            for msg in batch or ():
                headers = msg.headers or {}
                if msg.data and not headers.get("KV-Operation"):
                    found[headers["Nats-Subject"][prefix:]] = (value(msg.data), int(headers["Nats-Sequence"]))
                elif gone is not None:  # a delete or purge marker: no value
                    gone.add(headers["Nats-Subject"][prefix:])
        return found

    async def _read_batch(self, bucket: str, keys: list[str], timeout: float) -> list[Msg] | None:
        """One `multi_last` direct get: the last message of each key that has one (then a 204
        status; a 404 alone when none has), or None when the bucket serves no direct gets."""
        waiting = _Batch(done=asyncio.get_running_loop().create_future())
        prefix = kv_subject(bucket, "")
        request = encode({"multi_last": [prefix + key for key in keys], "batch": MULTI_LAST_MAX})
        await self._exchange(
            waiting, lambda reply: [(direct_get_subject(kv_stream(bucket)), request, None, f"{reply}.0")],
            timeout, lambda: f"a read of {len(keys)} keys of {bucket} unanswered")
        if waiting.status == "503":  # no responders: the bucket has no allow_direct
            return None
        # A key may be a wildcard (`*.<id>`) matching several: more than a batch's worth (413, or
        # the batch ended with matches left) are read as two halves, down to one key's.
        if (waiting.status == "413" or waiting.status == "204" and waiting.pending) and len(keys) > 1:
            halves = await asyncio.gather(self._read_batch(bucket, keys[: len(keys) // 2], timeout),
                                          self._read_batch(bucket, keys[len(keys) // 2 :], timeout))
            return [msg for half in halves for msg in half or ()]
        if waiting.status not in ("204", "404") or waiting.pending:
            raise errors.ServiceError(ErrorCode.TIMEOUT if int(waiting.status or 0) >= 500 else ErrorCode.INTERNAL,
                                      f"cannot read {bucket}: {waiting.status} {waiting.description}")
        return waiting.found

    async def _read_each(self, bucket: str, keys: list[str], value: Callable[[bytes], T],
                         timeout: float, gone: set[str] | None = None) -> dict[str, tuple[T, int]]:
        """`kv_read_many` on a bucket without direct gets: one pipelined JetStream API read per key."""
        reads = await self.burst([(_msg_get_subject(kv_stream(bucket)),
                                   encode({"last_by_subj": kv_subject(bucket, key)}), None) for key in keys], timeout)
        found = {}
        prefix = len(kv_subject(bucket, ""))
        for asked, msg in zip(keys, reads):
            reply = _msg_get.decode(msg.data)
            if reply.error is not None and reply.error.err_code != _NO_MESSAGE:  # unreadable is not absent
                raise errors.ServiceError(ErrorCode.TIMEOUT if reply.error.code >= 500 else ErrorCode.INTERNAL,
                                          f"cannot read {asked} of {bucket}: {reply.error.description}")
            got = reply.message
            key = got.subject[prefix:] if got is not None and got.subject else asked  # `asked` may be a wildcard
            if got is not None and got.data:
                found[key] = (value(base64.b64decode(got.data)), got.seq)
            elif got is not None and gone is not None:  # a marker's message: it had a value
                gone.add(key)
        return found

    async def append_many(self, messages: list[Message], timeout: float) -> None:
        """Messages appended to their streams; raises if any is refused or unacknowledged.

        Sent as fast-ingest batches (JetStream 2.14+, a stream with `allow_batched`): each
        stored as it arrives, one ack per batch of up to INGEST_CHUNK instead of one per
        message, which the sender would decode one by one. A stream without `allow_batched`
        (made by an older sandfleet, or tuned by an operator) gets publishes that each wait for
        their own ack: one that asked for none is dropped without a word when the stream's
        ingest queue is full. Give each a `Nats-Msg-Id` and a retry is stored once either way."""
        if self.fast_ingest:
            chunks = [messages[i : i + INGEST_CHUNK] for i in range(0, len(messages), INGEST_CHUNK)]
            failed = [f for f in await asyncio.gather(*(self._ingest_batch(c, timeout) for c in chunks)) if f]
            if not failed:
                return
            if not all(f == "disabled" for f in failed):
                raise errors.ServiceError(ErrorCode.CONFLICT,
                                          f"{len(failed)} batch(es) of messages refused: {failed[0]}")
            self.fast_ingest = False  # nothing was stored: send them the old way
        refused = [why for why in map(refusal, await self.burst(messages, timeout)) if why]
        if refused:
            raise errors.ServiceError(ErrorCode.CONFLICT, f"{len(refused)} write(s) refused: {refused[0]}")

    async def _ingest_batch(self, messages: list[Message], timeout: float) -> str:
        """One fast-ingest batch: "" once all are stored, else why not ("disabled": the stream
        takes no batches). The protocol is in the reply subject,
        `<inbox>.<flow>.<gap>.<batch seq>.<op>.$FI`, and the inbox's last token is the batch id:
        op 0 opens, 1 adds, 2 adds and commits; flow is how many messages per flow ack (the
        server answers at most every 500); gap `fail` makes a lost message fail the batch
        instead of leaving a hole. The frames come back on the messages' own reply subjects."""
        waiting = _Ingest(size=len(messages), done=asyncio.get_running_loop().create_future())
        last = len(messages) - 1

        def frames(reply: str) -> list[tuple[str, bytes, dict[str, str] | None, str]]:
            inbox = f"{reply}.{self._batch_base}{reply.rsplit('.', 1)[1]}"  # its last token: the batch id
            return [(subject, payload, headers,
                     f"{inbox}.{len(messages)}.fail.{n + 1}.{2 if n == last else 0 if n == 0 else 1}.$FI")
                    for n, (subject, payload, headers) in enumerate(messages)]

        await self._exchange(waiting, frames, timeout, lambda: f"a batch of {len(messages)} messages unanswered")
        return waiting.error

    async def burst(self, messages: list[Message], timeout: float) -> list[Msg]:
        """Requests sent back to back; their replies, in order."""
        if not messages:
            return []
        waiting = _Burst(replies=[None] * len(messages), left=len(messages),
                         done=asyncio.get_running_loop().create_future())
        await self._exchange(
            waiting, lambda reply: [(subject, payload, headers, f"{reply}.{n}")
                                    for n, (subject, payload, headers) in enumerate(messages)],
            timeout, lambda: f"{waiting.left} of {len(messages)} writes unanswered")
        return waiting.replies  # type: ignore[return-value]

    # -- the reply demultiplexer ------------------------------------------------------------

    async def _exchange(self, waiting: _Burst | _Ingest | _Batch,
                        frames: Callable[[str], list[tuple[str, bytes, dict[str, str] | None, str]]],
                        timeout: float, unanswered: Callable[[], str]) -> None:
        """Send `frames(reply)` (`reply`: `<the reply prefix>.<a token of its own>`, for their
        reply subjects to start with) and wait until `waiting` has all its answers."""
        token = await self._open_reply(waiting)
        try:
            await self.bus.publish_many(frames(f"{self._mux_prefix}.{token}"))
            try:
                await asyncio.wait_for(asyncio.shield(waiting.done), timeout)
            except asyncio.TimeoutError:
                raise errors.ServiceError(ErrorCode.TIMEOUT, unanswered()) from None
        finally:
            self._waiting.pop(token, None)

    async def _open_reply(self, waiting: _Burst | _Ingest | _Batch) -> str:
        """A token for replies on the one reply subscription (made on first use)."""
        if self._mux is None:  # made once, also when exchanges start together
            self._mux_prefix = self.bus.nc.new_inbox()
            self._mux = asyncio.ensure_future(self.bus.subscribe_direct(self._mux_prefix + ".>", self._on_reply))
        mux = self._mux
        try:
            await asyncio.shield(mux)  # one cancelled while it waits must not cancel the others' set-up
        except asyncio.CancelledError:
            if mux.cancelled() and self._mux is mux:
                self._mux = None
            raise
        except Exception:
            if self._mux is mux:  # it failed: the next exchange tries again
                self._mux = None
            raise
        self._tokens += 1
        token = str(self._tokens)
        self._waiting[token] = waiting
        return token

    def _on_reply(self, msg: Msg) -> None:
        # <prefix>.<token>.<n> answers message n of a burst; a fast-ingest batch's frames come
        # on its messages' own reply subjects, <prefix>.<token>.<batch id>.<flow>...$FI
        token, _, rest = msg.subject[len(self._mux_prefix) + 1 :].partition(".")
        waiting = self._waiting.get(token)
        if isinstance(waiting, _Ingest):
            _on_ingest_frame(waiting, msg)
            return
        if isinstance(waiting, _Batch):
            _on_batch_reply(waiting, msg)
            return
        # A burst's reply, the commonest by far: handled here, without a call of its own.
        n = int(rest) if rest.isdigit() else -1
        if waiting is None or not 0 <= n < len(waiting.replies) or waiting.replies[n] is not None:
            return  # an exchange that gave up waiting, or a reply it has
        waiting.replies[n] = msg
        waiting.left -= 1
        if waiting.left == 0 and not waiting.done.done():
            waiting.done.set_result(None)


def _on_batch_reply(waiting: _Batch, msg: Msg) -> None:
    status = (msg.headers or {}).get("Status")
    if not status:
        waiting.found.append(msg)
    elif not waiting.done.done():
        waiting.status, waiting.description = status, (msg.headers or {}).get("Description", "")
        waiting.pending = int((msg.headers or {}).get("Nats-Num-Pending") or 0)
        waiting.done.set_result(None)


def _on_ingest_frame(waiting: _Ingest, msg: Msg) -> None:
    status = (msg.headers or {}).get("Status")
    if status:  # no frame: the server's own answer, e.g. 503 when no stream takes the subjects
        if not waiting.error:
            waiting.error = f"status {status} {(msg.headers or {}).get('Description', '')}".rstrip()
        if not waiting.done.done():
            waiting.done.set_result(None)
        return
    frame = _ingest_frame.decode(msg.data)
    if frame.error is not None and not waiting.error:
        waiting.error = ("disabled" if frame.error.err_code == _BATCH_DISABLED
                         else f"{frame.error.description} ({frame.error.err_code})")
    if frame.stream and not waiting.done.done():  # the terminal frame: the batch ended
        if not waiting.error and frame.count != waiting.size:
            waiting.error = f"the batch ended after {frame.count} of {waiting.size} messages"
        waiting.done.set_result(None)

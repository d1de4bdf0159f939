"""Every use of nats-py's private attributes, in one place, each with why public API does not do.

nats-py (2.16) has no batch publish and no way to take a subscription's messages other than
through its per-subscription queue and task; at tens of thousands of messages a batch both
cost most of the time. Its reader takes 32 KiB off the socket a turn, and it copies a large
payload five times in and twice out. The seams below are what `Bus.publish_many`,
`Bus.subscribe_direct` and the raw (bulk) paths of `Bus.request_raw` and `Endpoint(raw=True)`
stand on. tests/test_natspy_internals.py checks each against a real nats-server, so a nats-py
upgrade that moves them fails there, loudly, and not in a benchmark."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import nats.aio.client
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.protocol.parser import AWAITING_CONTROL_LINE, CRLF_SIZE, MAX_CONTROL_LINE_SIZE, Parser

log = logging.getLogger("sandfleet.bus")


async def write_frames(nc: Client, frames: bytes) -> None:
    """Hand already-built PUB/HPUB frames to the connection's outgoing buffer.

    `Client._send_command` is what nats-py's own `publish` ends with, after validating the
    subject and encoding the headers of one message (~30 µs); frames built in one pass skip
    that per message. It flushes by itself when the buffer exceeds the client's pending size."""
    await nc._send_command(frames)


async def flush_frames(nc: Client) -> None:
    """Wake the connection's flusher for what `write_frames` queued, without waiting for the
    server's PONG as the public `flush()` does (a round trip per batch for nothing: the
    replies say what arrived). `Client._flush_pending` is what `publish` calls for that."""
    await nc._flush_pending()


def hand_directly(sub: Subscription, handler: Callable[[Msg], None]) -> None:
    """Give each message of `sub` (made without a callback, so nats-py runs no task for it) to
    `handler` as the connection's reader parses it.

    nats-py puts every message on `Subscription._pending_queue` (an asyncio.Queue) for a task
    to take off: several µs of queue hop a message. Replacing that queue with `_Handed` is the
    only way in; it also keeps `Subscription._pending_size`, the bytes nats-py counts as
    queued, at 0, since nothing stays queued."""
    if not (hasattr(sub, "_pending_queue") and hasattr(sub, "_pending_size")):  # else set in vain: no message comes
        raise RuntimeError("this nats-py keeps a subscription's queue elsewhere: see sandfleet/natspy_internals.py")
    sub._pending_queue = _Handed(sub, handler)  # type: ignore[assignment]


class _Handed:
    """What nats-py asks of a subscription's message queue: `put_nowait` (the reader delivering),
    `qsize`/`empty` (pending counts, unsubscribe), `task_done`/`join` (draining). The handler
    runs inside the connection's reader: an exception is logged here, never let through to it."""

    def __init__(self, sub: Any, handler: Callable[[Msg], None]) -> None:
        self._sub, self._handler = sub, handler

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size = 0
        try:
            self._handler(msg)
        except Exception:
            log.exception("handling a message on %s failed", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass


def read_per_turn(limit: int) -> None:
    """Let the connection's reader take up to `limit` bytes off the socket per turn of its loop.

    `Client._read_loop` reads `transport.read(DEFAULT_BUFFER_SIZE)`, the module global looked
    up at each read; its 32 KiB is 128 turns and parser passes per 4 MiB raw chunk, a quarter
    of a receiver's CPU. There is no option for it (`Client.connect` takes none)."""
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, limit)


# -- bulk messages: fewer copies of a raw chunk's bytes ------------------------------------------
#
# A 4 MiB chunk received through nats-py is copied five times in Python (the stream reader's
# buffer, its read, the parser's buffer, a slice of it, the bytes of the slice) and sent through
# it, twice more (the frame joined to its payload, the pending list joined). At 1 GiB that is
# most of a receiver's CPU after sha256. Only the raw paths opt in (their subjects are marked):
# a marked message's payload is read into one buffer of its size and handed on as that
# `bytearray`; everything else is parsed as nats-py parses it.

BULK_BYTES = 256 << 10  # a payload this large (of a marked subject) is read into a buffer of its own


class _BulkParser(Parser):
    """nats-py's parser, but a marked subject's large payload never reaches it: while subjects
    are marked, the frames are found here first (each control line, then its payload's size),
    nats-py's parser is handed every other frame whole, and a marked one's payload is copied
    once, from each read into a buffer of its size, handed on as that buffer."""

    bulk_subjects: set[bytes]

    def reset(self) -> None:
        super().reset()
        self._clear()

    def _clear(self) -> None:
        self._scanning = False  # finding frames here (only from a frame's start: see parse)
        self._line = b""  # a control line whose end has not come yet
        self._skip = 0  # bytes of a frame handed to nats-py's parser still to come
        self._body: bytearray | None = None  # the marked payload being filled
        self._filled = 0
        self._arg: tuple = ()

    async def parse(self, data: bytes = b"") -> None:
        if not self._scanning:
            if not (self.bulk_subjects and self.state == AWAITING_CONTROL_LINE and not self.buf):
                return await super().parse(data)  # nothing marked, or mid-frame: as nats-py does
            self._scanning = True
        at, size = 0, len(data)
        while at < size:
            if self._body is not None:
                at = await self._fill(data, at)
            elif self._skip:
                n = min(self._skip, size - at)
                await super().parse(data[at:at + n])
                self._skip, at = self._skip - n, at + n
            else:
                end = data.find(b"\n", at)
                if end < 0:
                    self._line += data[at:]
                    if len(self._line) > MAX_CONTROL_LINE_SIZE:  # nats-py's parser says what is wrong
                        line, self._line, self._scanning = self._line, b"", False
                        await super().parse(line)
                    return
                line, self._line, at = self._line + data[at:end + 1], b"", end + 1
                frame = _frame(line)
                if frame is not None and frame[0] in self.bulk_subjects and frame[4] >= BULK_BYTES:
                    self._arg, self._body, self._filled = frame, bytearray(frame[4] + CRLF_SIZE), 0
                    continue
                await super().parse(line)
                if frame is not None:
                    self._skip = frame[4] + CRLF_SIZE
        if not (self.bulk_subjects or self._line or self._skip or self._body is not None):
            self._scanning = False

    async def _fill(self, data: bytes, at: int) -> int:
        """Copy what of `data` from `at` the payload still needs; once it is whole, hand the message
        on. Returns where in `data` the rest begins."""
        body = self._body
        assert body is not None
        take = min(len(body) - self._filled, len(data) - at)
        memoryview(body)[self._filled:self._filled + take] = memoryview(data)[at:at + take]
        self._filled += take
        if self._filled == len(body):
            subject, sid, reply, header_size, _ = self._arg
            self._body, self._arg = None, ()
            hdr = None
            if header_size:
                hdr = bytes(body[:header_size])
                del body[:header_size]  # a bytearray drops its front without moving the rest
            del body[-CRLF_SIZE:]
            await self.nc._process_msg(sid, subject, reply, body, hdr)
        return at + take


def _frame(line: bytes) -> tuple[bytes, int, bytes, int, int] | None:
    """(subject, sid, reply, header bytes, payload bytes with them) of a MSG or HMSG control line,
    else None (another operation, or one nats-py's parser should judge)."""
    parts = line.split()
    try:
        if parts[0] == b"MSG" and len(parts) in (4, 5):
            return parts[1], int(parts[2]), parts[3] if len(parts) == 5 else b"", 0, int(parts[-1])
        if parts[0] == b"HMSG" and len(parts) in (5, 6):
            return parts[1], int(parts[2]), parts[3] if len(parts) == 6 else b"", int(parts[-2]), int(parts[-1])
    except (IndexError, ValueError):
        pass
    return None


def read_bulk_in_place(nc: Client) -> set[bytes]:
    """Make `nc` read the payloads of the subjects in the returned set (exact subjects, bytes)
    as `_BulkParser` does. `Client._ps` is the parser its reader feeds; it is made once, in
    `Client.__init__`, and only reset on reconnect, so swapping its class lasts."""
    ps = nc._ps
    if not isinstance(ps, _BulkParser):
        if type(ps) is not Parser or not hasattr(ps, "msg_arg"):
            raise RuntimeError("this nats-py parses elsewhere: see sandfleet/natspy_internals.py")
        ps.__class__ = _BulkParser
        ps.bulk_subjects = set()
        ps._clear()
    return ps.bulk_subjects  # type: ignore[union-attr]


def header_block(headers: dict[str, str]) -> bytes:
    return ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


async def publish_bulk(nc: Client, subject: str, reply: str, headers: dict[str, str],
                       payload: bytes | bytearray | memoryview) -> None:
    """Publish without joining the payload to its frame: what nc has pending goes first, then
    the frame's line and headers, the payload and its end, each handed to the socket's writer
    as it is (what the socket takes at once is never copied). Then wait for the writer to
    drain, as nats-py's flusher does. While the connection is not plainly up (reconnecting,
    draining, a websocket) it is nc.publish, with its buffering and refusals."""
    transport = nc._transport
    if not (nc.is_connected and not nc.is_draining_pubs and isinstance(transport, TcpTransport)):
        await nc.publish(subject, bytes(payload), reply=reply, headers=headers)
        return
    if len(payload) > nc.max_payload:
        raise nats.errors.MaxPayloadError
    target = f"{subject} {reply}" if reply else subject
    head = header_block(headers) if headers else b""
    line = (f"HPUB {target} {len(head)} {len(head) + len(payload)}\r\n" if head
            else f"PUB {target} {len(payload)}\r\n").encode()
    if nc._pending:  # in order: a SUB queued before this request (its reply's) must reach the server first
        transport.writelines(nc._pending)
        nc._pending, nc._pending_data_size = [], 0
    transport.write(line + head)
    transport.write(payload)
    transport.write(b"\r\n")
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    await transport.drain()


async def request_bulk(nc: Client, subject: str, headers: dict[str, str], payload: bytes | bytearray | memoryview,
                       timeout: float) -> Msg:
    """nc.request (its new style: one wildcard inbox subscription, a future per request in
    `Client._resp_map`, keyed by the token after `Client._resp_sub_prefix`), sent by
    `publish_bulk`, with the reply's inbox marked bulk while it is awaited."""
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    token = nc._nuid.next()
    token.extend(secrets.token_hex(2).encode())
    inbox = bytes(nc._resp_sub_prefix) + bytes(token)
    key = token.decode()
    future: asyncio.Future = asyncio.get_running_loop().create_future()
    nc._resp_map[key] = future
    bulk = read_bulk_in_place(nc)
    bulk.add(inbox)
    try:
        await publish_bulk(nc, subject, inbox.decode(), headers, payload)
        try:
            msg = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise nats.errors.TimeoutError from None
    finally:
        nc._resp_map.pop(key, None)
        bulk.discard(inbox)
    if msg.headers and msg.headers.get("Status") == "503":
        raise nats.errors.NoRespondersError
    return msg


def reply_to(req: Any) -> str:
    """The reply subject of a nats.micro Request (it keeps its Msg as `_msg`; `respond` publishes
    to that Msg's reply, with nc.publish, so a raw reply goes by `publish_bulk` instead)."""
    reply = req._msg.reply
    if not reply:
        raise ValueError("no reply subject set")
    return reply

"""The bulk (raw) paths' use of nats-py's private attributes, each with why public API does not
do: `Bus.request_raw` and `Endpoint(raw=True)` carry file chunks and process output, megabytes a
message, which nats-py copies five times in and twice out. The rest of the private seams are in
natspy_internals.py; tests/test_natspy_internals.py checks both against a real nats-server."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import secrets
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.transport import TcpTransport
from nats.protocol.parser import AWAITING_CONTROL_LINE, CRLF_SIZE, MAX_CONTROL_LINE_SIZE, Parser

from sandfleet.natspy_sendfile import FileRange, can_sendfile, send_frame

# -- bulk messages: fewer copies of a raw chunk's bytes ------------------------------------------
#
# A 4 MiB chunk received through nats-py is copied five times in Python (the stream reader's
# buffer, its read, the parser's buffer, a slice of it, the bytes of the slice) and sent through
# it, twice more (the frame joined to its payload, the pending list joined). At 1 GiB that is
# most of a receiver's CPU after its hash. Only the raw paths opt in (their subjects are marked).
# A marked message's payload is read from the socket straight into one buffer of its size
# (`_SocketToBody`, once the connection is plain TCP and at a frame's start), or else copied
# into one from the reads (`_BulkParser`); either way it is handed on as that `bytearray`, and
# everything else is parsed as nats-py parses it.

BULK_BYTES = 256 << 10  # a payload this large (of a marked subject) is read into a buffer of its own
_SCRATCH = 256 << 10  # what the socket is read into between marked payloads
_BODIES_HELD = 4  # payloads read ahead of the parser before the socket is paused
_READ = b"B"  # what `_SocketToBody` puts before a frame's line whose payload it read itself


def _unzeroed(size: int) -> bytearray:
    """A bytearray of `size` bytes not zeroed first: a payload's buffer is overwritten whole
    before anyone sees it, and `bytearray(size)`'s memset (and the page faults it takes) cost
    0.4 CPU-s a GiB of fresh 4 MiB buffers here. CPython's C API makes one uninitialised when
    given no bytes to copy; elsewhere it is bytearray(size)."""
    if not _heap_kept:
        _keep_heap()
    return _NEW_BYTEARRAY(None, size) if _NEW_BYTEARRAY is not None else bytearray(size)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_HEAP_KEPT = 64 << 20  # free memory glibc may keep at the top of the heap
_heap_kept = False


def _keep_heap() -> None:
    """Let the payload buffers' memory be used again instead of returned to the kernel at each
    free: by default glibc serves 4 MiB from the heap but trims anything over 8 MiB free at its
    top, so with a window of chunks freed together every new buffer was fresh pages again, each
    page a fault the kernel zeroes (148K faults and ~0.1 CPU-s a GiB in a launcher receiving
    uploads; 5K with this). Done once, in a process that reads bulk payloads; what is kept is
    bounded (`_HEAP_KEPT`); elsewhere than glibc, nothing."""
    global _heap_kept
    _heap_kept = True
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:  # both: setting one alone stops glibc adjusting the other itself
        mallopt(_M_MMAP_THRESHOLD, 16 << 20)
        mallopt(_M_TRIM_THRESHOLD, _HEAP_KEPT)


def _bytearray_maker():
    try:
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:  # not CPython
        return None
    make.restype, make.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
    return make


_NEW_BYTEARRAY = _bytearray_maker()


class _BulkParser(Parser):
    """nats-py's parser, but a marked subject's large payload never reaches it: while subjects
    are marked, the frames are found here first (each control line, then its payload's size),
    nats-py's parser is handed every other frame whole, and a marked one's payload is copied
    once, from each read into a buffer of its size, or taken whole from `_SocketToBody` (its
    line comes marked `_READ`), handed on as that buffer."""

    bulk_subjects: set[bytes]

    def reset(self) -> None:  # nats-py's, at each (re)connect
        super().reset()
        self._clear()
        direct = getattr(self, "_direct", None)
        if direct is not None:
            direct.detached = True  # the old connection's socket feeds nothing more
        self._direct: _SocketToBody | None = None
        self.bodies: collections.deque[bytearray] = collections.deque()

    def _clear(self) -> None:
        self._scanning = False  # finding frames here (only from a frame's start: see parse)
        self._line = b""  # a control line whose end has not come yet
        self._skip = 0  # bytes of a frame handed to nats-py's parser still to come
        self._body: bytearray | None = None  # the marked payload being filled
        self._filled = 0
        self._arg: tuple = ()

    async def parse(self, data: bytes = b"") -> None:
        if not self._scanning:
            if not ((self.bulk_subjects or self._direct) and self.state == AWAITING_CONTROL_LINE and not self.buf):
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
                if line[:1] == _READ and self._direct is not None:
                    await self._deliver(_frame(line[1:]), self._direct.taken(self.bodies))  # type: ignore[arg-type]
                    continue
                frame = _frame(line)
                if frame is not None and frame[0] in self.bulk_subjects and frame[4] >= BULK_BYTES:
                    self._arg, self._body, self._filled = frame, _unzeroed(frame[4] + CRLF_SIZE), 0
                    continue
                await super().parse(line)
                if frame is not None:
                    self._skip = frame[4] + CRLF_SIZE
        if not (self._line or self._skip or self._body is not None):
            if self._direct is None and self.bulk_subjects:
                self._direct = _SocketToBody.install(self)
            if not (self.bulk_subjects or self._direct):
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
            arg, self._body, self._arg = self._arg, None, ()
            await self._deliver(arg, body)
        return at + take

    async def _deliver(self, frame: tuple, body: bytearray) -> None:
        """A marked message whose payload (headers, data, CRLF) is all in `body`."""
        subject, sid, reply, header_size, _ = frame
        hdr = None
        if header_size:
            hdr = bytes(body[:header_size])
            del body[:header_size]  # a bytearray drops its front without moving the rest
        del body[-CRLF_SIZE:]
        await self.nc._process_msg(sid, subject, reply, body, hdr)


class _SocketToBody(asyncio.BufferedProtocol):
    """Between a plain TCP connection's socket and nats-py's stream reader: the frames are found
    as they come off the socket, and a marked subject's large payload is read from the socket
    straight into a buffer of its size (the event loop reads into what `get_buffer` gives: no
    copy in Python at all). Everything else goes on to the stream reader as it came; where a
    payload was taken, its frame's line goes on after it, marked `_READ`, and the payload waits
    in the parser's `bodies` for it, so messages keep their order.

    Installed by the parser (`install`) once nothing of the stream is unread or half parsed
    (so the next byte off the socket starts a frame). nats-py reaches the socket through
    `TcpTransport._io_reader` and `_io_writer` (asyncio streams), the only way to it; a TLS or
    websocket connection is left as it is. A reconnect's `reset` detaches it."""

    def __init__(self, parser: _BulkParser, transport: asyncio.Transport, inner: asyncio.Protocol) -> None:
        self._parser, self._transport, self._inner = parser, transport, inner
        self._scratch = bytearray(_SCRATCH)
        self._line = b""
        self._skip = 0
        self._body: bytearray | None = None
        self._filled = 0
        self._read_line = b""  # the marked line of the payload being read
        self._paused = False
        self.detached = False

    @classmethod
    def install(cls, parser: _BulkParser) -> _SocketToBody | None:
        transport = getattr(parser.nc, "_transport", None)
        if type(transport) is not TcpTransport or transport._io_reader is not transport._bare_io_reader:
            return None  # websocket, TLS: read as before
        reader, socket = transport._io_reader, transport._io_writer.transport  # type: ignore[union-attr]
        inner = socket.get_protocol()
        if reader is None or reader._buffer or not isinstance(inner, asyncio.StreamReaderProtocol):
            return None  # bytes not yet parsed: the socket's next one may not start a frame
        direct = cls(parser, socket, inner)
        socket.set_protocol(direct)
        return direct

    def taken(self, bodies: collections.deque[bytearray]) -> bytearray:
        """The next payload read ahead (the parser met its marked line); reading goes on if it waited."""
        body = bodies.popleft()
        if self._paused and len(bodies) < _BODIES_HELD and not self.detached:
            self._paused = False
            self._transport.resume_reading()
        return body

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._filled:]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self.detached:
            return
        if self._body is not None:
            self._filled += nbytes
            if self._filled == len(self._body):
                self._read_whole()
            return
        self._scan(nbytes)

    def _scan(self, size: int) -> None:
        data, at, passed = self._scratch, 0, 0  # data[passed:at] goes on to the stream reader as it came
        while at < size:
            if self._body is not None:  # a marked payload began in this read: its first bytes
                take = min(len(self._body) - self._filled, size - at)
                memoryview(self._body)[self._filled:self._filled + take] = memoryview(data)[at:at + take]
                self._filled, at = self._filled + take, at + take
                passed = at
                if self._filled == len(self._body):
                    self._read_whole()
            elif self._skip:
                n = min(self._skip, size - at)
                self._skip, at = self._skip - n, at + n
            else:
                end = data.find(b"\n", at, size)
                if end < 0:  # held back until it is whole: it may be a marked frame's
                    self._pass(data, passed, at)
                    self._line += bytes(data[at:size])
                    if len(self._line) > MAX_CONTROL_LINE_SIZE:  # the parser will say what is wrong
                        self._inner.data_received(self._line)
                        self._line = b""
                    return
                line, held = self._line + bytes(data[at:end + 1]), self._line
                self._line = b""
                frame = _frame(line)
                if frame is not None and frame[0] in self._parser.bulk_subjects and frame[4] >= BULK_BYTES:
                    self._pass(data, passed, at)
                    self._read_line, self._body, self._filled = _READ + line, _unzeroed(frame[4] + CRLF_SIZE), 0
                    at = passed = end + 1
                    continue
                if held:
                    self._pass(data, passed, at)
                    self._inner.data_received(held)
                    passed = at
                at = end + 1
                if frame is not None:
                    self._skip = frame[4] + CRLF_SIZE
        self._pass(data, passed, size)

    def _pass(self, data: bytearray, start: int, end: int) -> None:
        if end > start:
            self._inner.data_received(bytes(data[start:end]))

    def _read_whole(self) -> None:
        bodies = self._parser.bodies
        bodies.append(self._body)  # type: ignore[arg-type]
        self._body = None
        self._inner.data_received(self._read_line)
        if len(bodies) >= _BODIES_HELD:  # the parser is behind: hold the socket (again, if the reader let it go)
            self._paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


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
            raise RuntimeError("this nats-py parses elsewhere: see sandfleet/natspy_bulk.py")
        ps.__class__ = _BulkParser
        ps.bulk_subjects = set()
        ps._clear()
        ps._direct, ps.bodies = None, collections.deque()
    return ps.bulk_subjects  # type: ignore[union-attr]


def header_block(headers: dict[str, str]) -> bytes:
    return ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


Payload = bytes | bytearray | memoryview | FileRange | list[bytes]  # a list: its parts, sent as one payload


async def publish_bulk(nc: Client, subject: str, reply: str, headers: dict[str, str], payload: Payload,
                       timeout: float = 60.0) -> None:
    """Publish without joining the payload to its frame: what nc has pending goes first, then
    the frame's line and headers, the payload and its end, each handed to the socket's writer
    as it is (what the socket takes at once is never copied). A list payload's parts go in one
    `writelines`: on uvloop, the services' loop, one writev of the parts as they are, what the
    socket does not take at once kept by reference, not copied (asyncio's own loop joins them:
    one copy, as joining them first would). A `FileRange` goes from its file by sendfile
    (natspy_sendfile.py), within `timeout`. Then wait for the writer to drain, as nats-py's
    flusher does. While the connection is not plainly up (reconnecting, draining, a websocket)
    it is nc.publish, with its buffering and refusals."""
    transport = nc._transport
    if not (nc.is_connected and not nc.is_draining_pubs and isinstance(transport, TcpTransport)):
        if isinstance(payload, FileRange):
            payload = await asyncio.to_thread(payload.read)
        await nc.publish(subject, _joined(payload), reply=reply, headers=headers)
        return
    parts = payload if isinstance(payload, list) else None
    size = sum(map(len, parts)) if parts is not None else len(payload)
    if size > nc.max_payload:
        raise nats.errors.MaxPayloadError
    target = f"{subject} {reply}" if reply else subject
    head = header_block(headers) if headers else b""
    line = (f"HPUB {target} {len(head)} {len(head) + size}\r\n" if head
            else f"PUB {target} {size}\r\n").encode()
    if nc._pending:  # in order: a SUB queued before this request (its reply's) must reach the server first
        transport.writelines(nc._pending)
        nc._pending, nc._pending_data_size = [], 0
    if isinstance(payload, FileRange):
        if can_sendfile(transport):
            return await send_frame(nc, line + head, payload, b"\r\n", timeout)
        payload = await asyncio.to_thread(payload.read)  # TLS: its bytes, through the TLS transport
    if parts is not None:
        transport.writelines([line + head, *parts, b"\r\n"])
    else:  # not writelines: asyncio's would join them, copying what the socket takes at once
        transport.write(line + head)
        transport.write(payload)
        transport.write(b"\r\n")
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    await transport.drain()


def _joined(payload: bytes | bytearray | memoryview | list[bytes]) -> bytes:
    return b"".join(payload) if isinstance(payload, list) else bytes(payload)


async def request_bulk(nc: Client, subject: str, headers: dict[str, str], payload: Payload, timeout: float) -> Msg:
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
        await publish_bulk(nc, subject, inbox.decode(), headers, payload, timeout)
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

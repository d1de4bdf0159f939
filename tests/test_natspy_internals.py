"""The nats-py private attributes sandfleet stands on (sandfleet/natspy_internals.py, natspy_bulk.py) still do what
it relies on, checked against a real nats-server: a nats-py upgrade that moves or changes one
fails here by name, not as a stalled batch or a benchmark gone slow."""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import AsyncIterator, Iterator

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sandfleet import natspy_bulk, natspy_internals
from sandfleet.bus import Bus
from tests.natsd import bare_nats_server


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory) -> Iterator[str]:
    with bare_nats_server(tmp_path_factory.mktemp("natspy") / "js") as url:
        yield url


@pytest.fixture
async def nc(nats_url) -> AsyncIterator[Client]:
    # One connection sends and receives: the server takes its SUB before its later PUBs. (From a
    # second connection, a flush() right after connecting was seen to return before the server
    # had the subscription, now and then.)
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


def test_the_private_names_are_still_there():
    for name in ("_send_command", "_flush_pending"):
        assert inspect.iscoroutinefunction(getattr(Client, name, None)), f"nats-py's Client.{name} is gone"
    assert list(inspect.signature(Client._send_command).parameters)[:2] == ["self", "cmd"]
    sub = Subscription(conn=None, id=1, subject="x")  # type: ignore[arg-type]
    assert isinstance(sub._pending_queue, asyncio.Queue) and sub._pending_size == 0


def test_the_reader_takes_as_much_per_turn_as_the_bus_asks():
    import nats.aio.client

    import sandfleet.bus  # noqa: F401  (it asks at import)

    # _read_loop must still read the module global at each read, or setting it does nothing.
    assert "self._transport.read(DEFAULT_BUFFER_SIZE)" in inspect.getsource(Client._read_loop)
    assert nats.aio.client.DEFAULT_BUFFER_SIZE >= 8 << 20


async def _collect(nc: Client, subject: str, count: int) -> tuple[list[Msg], asyncio.Future]:
    got: list[Msg] = []
    done = asyncio.get_running_loop().create_future()

    async def on(msg: Msg) -> None:
        got.append(msg)
        if len(got) == count:
            done.set_result(None)

    await nc.subscribe(subject, cb=on)
    return got, done


async def test_frames_written_raw_arrive_as_publish_would_send_them(nc):
    got, done = await _collect(nc, "raw.>", 2)
    hdr = b"NATS/1.0\r\nNats-Msg-Id: a:1\r\n\r\n"
    frames = (b"PUB raw.plain reply.1 5\r\nhello\r\n"
              + f"HPUB raw.headed {len(hdr)} {len(hdr) + 2}\r\n".encode() + hdr + b"hi\r\n")
    await natspy_internals.write_frames(nc, frames)
    await natspy_internals.flush_frames(nc)
    await asyncio.wait_for(done, 10)
    assert [(m.subject, m.reply, m.data) for m in got] == [("raw.plain", "reply.1", b"hello"), ("raw.headed", "", b"hi")]
    assert got[1].headers == {"Nats-Msg-Id": "a:1"}


async def test_frames_past_the_clients_pending_size_go_out_without_a_flush(nats_url):
    # Bus.publish_many hands over a 32,000-message batch in pieces relying on this: the buffer
    # never holds much more than the pending size.
    conn = await nats.connect(nats_url, pending_size=1 << 20)
    try:
        frames = [f"PUB big.{n:02} {64 * 1024}\r\n".encode() + b"x" * (64 * 1024) + b"\r\n" for n in range(20)]
        crossing = (1 << 20) // len(frames[0]) + 1  # the frames up to the one that takes the buffer past 1 MiB
        got, past = await _collect(conn, "big.>", crossing)
        for frame in frames:
            await natspy_internals.write_frames(conn, frame)
        await asyncio.wait_for(past, 10)  # went out unasked
        assert [m.subject for m in got[:crossing]] == [f"big.{n:02}" for n in range(crossing)]
        _, marked = await _collect(conn, "marker", 1)
        await natspy_internals.write_frames(conn, b"PUB marker 0\r\n\r\n")
        await natspy_internals.flush_frames(conn)  # and the rest once asked
        await asyncio.wait_for(marked, 10)
        assert [m.subject for m in got] == [f"big.{n:02}" for n in range(len(frames))]
    finally:
        await conn.close()


async def test_a_subscription_handed_directly_gives_every_message_to_its_handler_and_keeps_nothing_queued(nc):
    got: list[bytes] = []
    ended = asyncio.Event()

    def on(msg: Msg) -> None:
        if msg.data == b"boom":
            raise ValueError("a handler's bug")  # logged; the connection's reader goes on
        got.append(msg.data)
        if msg.data == b"end":
            ended.set()

    sub = await nc.subscribe("direct.>", pending_bytes_limit=-1)  # no callback: no task of nats-py's
    natspy_internals.hand_directly(sub, on)
    sent = [str(n).encode() for n in range(2000)] + [b"end"]
    for n, data in enumerate(sent):
        await nc.publish(f"direct.{n}", b"boom" if n == 1000 else data)
    await asyncio.wait_for(ended.wait(), 10)  # one sender's messages come in order
    assert got == sent[:1000] + sent[1001:]
    assert sub.pending_bytes == 0 and sub.pending_msgs == 0
    await sub.unsubscribe()
    _, marked = await _collect(nc, "marker", 1)
    await nc.publish("direct.after", b"late")
    await nc.publish("marker", b"")  # after the late one
    await asyncio.wait_for(marked, 10)
    assert got[-1] == b"end"  # unsubscribed: nothing more


async def test_a_subscription_handed_directly_drains_like_any_other(nats_url):
    # What Bus.close does to a connection with the store's reply subscription on it.
    bus = await Bus.connect(nats_url, "natspy-drain")
    got: list[Msg] = []
    await bus.subscribe_direct("drained.>", got.append)
    await bus.nc.publish("drained.1", b"x")
    await asyncio.wait_for(bus.close(), 10)
    assert bus.nc.is_closed and [m.data for m in got] == [b"x"]


def test_a_nats_py_without_the_queue_attribute_is_refused_loudly():
    class Moved:  # a subscription class of a nats-py that keeps its queue under another name
        pass

    with pytest.raises(RuntimeError, match="natspy_internals"):
        natspy_internals.hand_directly(Moved(), lambda msg: None)  # type: ignore[arg-type]


# -- the bulk paths (Bus.request_raw, Endpoint(raw=True)) -------------------------------------------

async def test_a_marked_subjects_large_payloads_arrive_whole_among_the_others(nc):
    natspy_bulk.read_bulk_in_place(nc).add(b"bulk.big")
    big = [bytes(range(256)) * 3500, b"\x07" * 900_000]  # past BULK_BYTES, under the server's 1 MB
    sent = [("bulk.small", b"a", None), ("bulk.big", big[0], {"K": "v"}), ("bulk.small", b"b", None),
            ("bulk.big", big[1], None), ("bulk.other", big[1], None), ("bulk.big", b"small", None)]
    got, done = await _collect(nc, "bulk.>", len(sent))
    for subject, data, headers in sent:
        await nc.publish(subject, data, headers=headers)
    await asyncio.wait_for(done, 10)
    assert [(m.subject, bytes(m.data), m.headers) for m in got] == sent
    assert [type(m.data) for m in got] == [bytes, bytearray, bytes, bytearray, bytes, bytes]  # only marked, large


async def test_a_bulk_request_is_answered_and_fails_as_nats_py_would(nc):
    async def echo(msg: Msg) -> None:
        await natspy_bulk.publish_bulk(nc, msg.reply, "", {"Sandfleet-Meta": "{}"}, msg.data)

    await nc.subscribe("svc.echo", cb=echo)  # queued: publish_bulk must send the SUB before its frame
    payload = bytes(range(256)) * 3000
    reply = await natspy_bulk.request_bulk(nc, "svc.echo", {"A": "b"}, memoryview(payload), timeout=10)
    assert bytes(reply.data) == payload and isinstance(reply.data, bytearray)
    assert reply.headers == {"Sandfleet-Meta": "{}"}
    small = await natspy_bulk.request_bulk(nc, "svc.echo", {}, b"x", timeout=10)
    assert small.data == b"x"
    with pytest.raises(nats.errors.NoRespondersError):
        await natspy_bulk.request_bulk(nc, "svc.nobody", {}, b"x", timeout=10)
    async def silent(msg: Msg) -> None:
        pass

    await nc.subscribe("svc.silent", cb=silent)
    with pytest.raises(nats.errors.TimeoutError):
        await natspy_bulk.request_bulk(nc, "svc.silent", {}, b"x", timeout=0.2)
    assert not nc._resp_map and len(natspy_bulk.read_bulk_in_place(nc)) == 0  # nothing left marked


def test_a_nats_py_parsing_elsewhere_is_refused_loudly():
    class Elsewhere:
        _ps = object()

    with pytest.raises(RuntimeError, match="natspy_bulk"):
        natspy_bulk.read_bulk_in_place(Elsewhere())  # type: ignore[arg-type]


async def test_a_bulk_publish_goes_after_what_the_connection_had_pending(nc):
    # A request's reply subscription may still be pending when its frame is written: it must
    # reach the server first.
    got, done = await _collect(nc, "order.>", 2)
    await natspy_internals.write_frames(nc, b"PUB order.first 1\r\n1\r\n")  # pending, not flushed
    await natspy_bulk.publish_bulk(nc, "order.second", "", {}, b"2" * 300_000)
    await asyncio.wait_for(done, 10)
    assert [m.subject for m in got] == ["order.first", "order.second"]


async def test_marked_frames_are_found_whether_a_read_holds_them_whole_or_in_pieces():
    from nats.protocol.parser import Parser

    class Conn:  # what the parser calls back: a message, and a ping
        def __init__(self) -> None:
            self._ps = Parser(self)
            self.got: list[tuple] = []
            self.pings = 0

        async def _process_msg(self, sid, subject, reply, data, hdr) -> None:
            self.got.append((subject, sid, reply, type(data), bytes(data), hdr))

        async def _process_ping(self) -> None:
            self.pings += 1

    conn = Conn()
    natspy_bulk.read_bulk_in_place(conn).add(b"big")  # type: ignore[arg-type]
    big, hdr = bytes(range(256)) * 2000, b"NATS/1.0\r\nA: b\r\n\r\n"
    frames = (f"HMSG big 1 _INBOX.x {len(hdr)} {len(hdr) + len(big)}\r\n".encode() + hdr + big + b"\r\n"
              + b"PING\r\nMSG small 2 3\r\nabc\r\n"
              + f"MSG big 1 {len(big)}\r\n".encode() + big + b"\r\n"
              + f"MSG other 4 {len(big)}\r\n".encode() + big + b"\r\n")
    want = [(b"big", 1, b"_INBOX.x", bytearray, big, hdr), (b"small", 2, b"", bytes, b"abc", None),
            (b"big", 1, b"", bytearray, big, None), (b"other", 4, b"", bytes, big, None)]
    await conn._ps.parse(frames)  # every frame in one read
    assert conn.got == want and conn.pings == 1
    for cut in (13, 4096, 600_000):  # and in pieces cut anywhere, control lines too
        conn.got, conn.pings = [], 0
        for at in range(0, len(frames), cut):
            await conn._ps.parse(frames[at:at + cut])
        assert conn.got == want and conn.pings == 1, cut


async def test_once_between_frames_a_marked_payload_is_read_from_the_socket_straight_into_its_buffer(nc):
    natspy_bulk.read_bulk_in_place(nc).add(b"direct.big")
    big = [bytes(range(256)) * 3500, b"\x07" * 900_000]
    sent = [("direct.small", b"a", None), ("direct.big", big[0], {"K": "v"}), ("direct.small", b"b", None),
            ("direct.big", big[1], None), ("direct.other", big[1], None), ("direct.big", b"small", None)]
    got, done = await _collect(nc, "direct.>", 3 * len(sent))
    for _ in range(3):  # the first round may come before the socket is taken over; the rest after
        for subject, data, headers in sent:
            await nc.publish(subject, data, headers=headers)
        await nc.flush()
    await asyncio.wait_for(done, 10)
    assert [(m.subject, bytes(m.data), m.headers) for m in got] == 3 * sent
    assert [type(m.data) for m in got[-len(sent):]] == [bytes, bytearray, bytes, bytearray, bytes, bytes]
    direct = nc._ps._direct  # type: ignore[attr-defined]
    assert isinstance(direct, natspy_bulk._SocketToBody)
    assert nc._transport._io_writer.transport.get_protocol() is direct  # type: ignore[union-attr]
    assert not nc._ps.bodies  # type: ignore[attr-defined]  # nothing held once parsed


class _Socket:
    """What _SocketToBody asks of the event loop's transport: pausing and resuming its reads."""

    def __init__(self) -> None:
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class _Inner(asyncio.Protocol):
    def __init__(self) -> None:
        self.stream = bytearray()

    def data_received(self, data: bytes) -> None:
        self.stream += data


def _feed(direct, data: bytes, cut: int) -> None:
    """`data` as the event loop would deliver it: into get_buffer's buffer, at most `cut` a read."""
    at = 0
    while at < len(data):
        buf = direct.get_buffer(-1)
        n = min(len(buf), cut, len(data) - at)
        buf[:n] = data[at:at + n]
        at += n
        direct.buffer_updated(n)


async def test_payloads_read_from_the_socket_keep_their_place_among_the_frames_however_the_reads_cut():
    from nats.protocol.parser import Parser

    class Conn:
        def __init__(self) -> None:
            self._ps = Parser(self)
            self.got: list[tuple] = []

        async def _process_msg(self, sid, subject, reply, data, hdr) -> None:
            self.got.append((subject, sid, reply, type(data), bytes(data), hdr))

        async def _process_ping(self) -> None:
            self.got.append(("ping",))

    big, hdr = bytes(range(256)) * 2000, b"NATS/1.0\r\nA: b\r\n\r\n"
    frames = (f"HMSG big 1 _INBOX.x {len(hdr)} {len(hdr) + len(big)}\r\n".encode() + hdr + big + b"\r\n"
              + b"PING\r\nMSG small 2 3\r\nabc\r\n"
              + f"MSG big 1 {len(big)}\r\n".encode() + big + b"\r\n"
              + f"MSG other 4 {len(big)}\r\n".encode() + big + b"\r\n")
    want = [(b"big", 1, b"_INBOX.x", bytearray, big, hdr), ("ping",), (b"small", 2, b"", bytes, b"abc", None),
            (b"big", 1, b"", bytearray, big, None), (b"other", 4, b"", bytes, big, None)]
    for cut in (997, 4096, 300_000, len(frames)):  # control lines cut too
        conn = Conn()
        natspy_bulk.read_bulk_in_place(conn).add(b"big")  # type: ignore[arg-type]
        inner = _Inner()
        direct = natspy_bulk._SocketToBody(conn._ps, _Socket(), inner)  # type: ignore[arg-type]
        conn._ps._direct = direct  # type: ignore[attr-defined]
        _feed(direct, frames, cut)
        assert len(inner.stream) < len(big) + 1000, cut  # what reached the stream reader: all but marked payloads
        await conn._ps.parse(bytes(inner.stream))
        assert conn.got == want, cut


def test_payloads_read_ahead_of_the_parser_pause_the_socket_until_it_takes_them():
    class Parser:
        bulk_subjects = {b"big"}
        bodies: collections.deque = collections.deque()

    socket, big = _Socket(), b"\x01" * natspy_bulk.BULK_BYTES
    direct = natspy_bulk._SocketToBody(Parser(), socket, _Inner())  # type: ignore[arg-type]
    frame = f"MSG big 1 {len(big)}\r\n".encode() + big + b"\r\n"
    for held in range(1, natspy_bulk._BODIES_HELD + 1):
        assert socket.reading
        _feed(direct, frame, 1 << 20)
        assert len(Parser.bodies) == held
    assert not socket.reading  # held to _BODIES_HELD payloads however fast the socket is
    direct.taken(Parser.bodies)
    assert socket.reading


async def _parts_arrive_whole(url: str) -> list[bytes]:
    """A payload given as parts (bytes, a memoryview cut from bytes, a tiny one) and the same
    parts empty, published on this loop; what a subscriber got."""
    conn = await nats.connect(url)
    try:
        got, done = await _collect(conn, "parts.>", 2)
        big = bytes(range(256)) * 1500
        await natspy_bulk.publish_bulk(conn, "parts.one", "", {"A": "b"}, [big, memoryview(big)[7:200_007], b"!"])
        await natspy_bulk.publish_bulk(conn, "parts.none", "", {}, [])
        await asyncio.wait_for(done, 10)
        return [bytes(m.data) for m in got]
    finally:
        await conn.close()


def test_a_payload_of_parts_arrives_as_their_bytes_in_order_on_both_loops(nats_url):
    # The services run on uvloop, whose writelines writes the parts by reference; asyncio's joins them.
    import uvloop

    big = bytes(range(256)) * 1500
    want = [big + big[7:200_007] + b"!", b""]
    assert asyncio.run(_parts_arrive_whole(nats_url)) == want
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(_parts_arrive_whole(nats_url)) == want

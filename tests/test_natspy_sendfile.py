"""A bulk payload sent from its file (sandfleet/natspy_sendfile.py), against a real nats-server:
the frames arrive byte for byte while nats-py publishes on the same connection at the same
time, a file that shrank under its range fails the send but leaves the connection usable, and
a connection that cannot sendfile sends the range's bytes the ordinary way."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from sandfleet import natspy_bulk
from sandfleet.natspy_sendfile import FileRange, FileShrank, can_sendfile
from tests.natsd import bare_nats_server

SIZE = 900_000  # past the socket's first take, under the bare server's 1 MB max_payload


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory) -> Iterator[str]:
    with bare_nats_server(tmp_path_factory.mktemp("sendfile") / "js") as url:
        yield url


@pytest.fixture
async def nc(nats_url) -> AsyncIterator[Client]:
    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


@pytest.fixture
def payload_file(tmp_path) -> Iterator[tuple[int, bytes]]:
    data = random.Random(3).randbytes(8 * SIZE)
    path = tmp_path / "payload.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


async def _collect(nc: Client, subject: str, count: int) -> tuple[list[Msg], asyncio.Future]:
    got: list[Msg] = []
    done = asyncio.get_running_loop().create_future()

    async def on(msg: Msg) -> None:
        got.append(msg)
        if len(got) == count and not done.done():
            done.set_result(None)

    await nc.subscribe(subject, cb=on)
    await nc.flush()
    return got, done


async def test_file_ranges_arrive_whole_while_nats_py_publishes_beside_them(nc, payload_file):
    fd, data = payload_file
    assert can_sendfile(nc._transport)  # the path under test, not the fallback
    ranges = [(i * SIZE // 2, SIZE) for i in range(14)]  # overlapping ranges of the file
    small = 400
    got, done = await _collect(nc, "sf.>", 2 * len(ranges) + small)

    async def chatter() -> None:  # nats-py's own writes, while frames are being written beside them
        for i in range(small):
            await nc.publish("sf.small", str(i).encode(), headers={"N": str(i)} if i % 2 else None)
            if i % 20 == 0:
                await asyncio.sleep(0)

    async def bulk() -> None:
        for offset, count in ranges:
            await natspy_bulk.publish_bulk(nc, "sf.big", "", {"Off": str(offset)}, FileRange(fd, offset, count))

    await asyncio.gather(chatter(), bulk(), bulk())
    await asyncio.wait_for(done, 20)
    bigs = [m for m in got if m.subject == "sf.big"]
    assert sorted(int(m.headers["Off"]) for m in bigs) == sorted(offset for offset, _ in ranges * 2)
    for m in bigs:
        offset = int(m.headers["Off"])
        assert bytes(m.data) == data[offset:offset + SIZE]
    assert [m.data for m in got if m.subject == "sf.small"] == [str(i).encode() for i in range(small)]
    assert nc.is_connected


async def test_a_file_that_shrank_under_its_range_fails_the_send_and_the_connection_goes_on(nc, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x01" * 1000)
    got, done = await _collect(nc, "shrank.>", 2)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FileShrank, match="changed while it was sent"):
            await natspy_bulk.publish_bulk(nc, "shrank.big", "", {}, FileRange(fd, 0, 300_000))
    finally:
        os.close(fd)
    await nc.publish("shrank.after", b"still here")
    await asyncio.wait_for(done, 10)
    assert [m.subject for m in got] == ["shrank.big", "shrank.after"]
    assert bytes(got[0].data) == b"\x01" * 1000 + bytes(300_000 - 1000)  # padded, so the frame stayed whole
    assert nc.is_connected


async def test_a_connection_that_cannot_sendfile_sends_the_ranges_bytes(nc, payload_file, monkeypatch):
    fd, data = payload_file
    monkeypatch.setattr(natspy_bulk, "can_sendfile", lambda transport: False)  # as over TLS
    got, done = await _collect(nc, "plain.>", 1)
    await natspy_bulk.publish_bulk(nc, "plain.big", "", {}, FileRange(fd, 7, SIZE))
    await asyncio.wait_for(done, 10)
    assert bytes(got[0].data) == data[7:7 + SIZE]
    with pytest.raises(FileShrank):
        FileRange(fd, len(data) - 10, 20).read()

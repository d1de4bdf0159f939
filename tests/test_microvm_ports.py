"""Port forwards into a `microvm`: `sb.forward(port)` reaches a server on the guest's loopback
through the guest agent (a TCP connection the agent opens inside the guest, carried over its
virtio-serial port; no host listener, no NIC). Then the node's side of those frames against a
guest played by the test: every breach of a connection's books cuts the guest off.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil

import pytest

from sandfleet import errors
from sandfleet._ports import PortRefused
from sandfleet.layers_client import Layers
from linuxnode.vm import frames
from linuxnode.vm.channel import GuestBroken
from linuxnode.vm.guest_image import GuestImage, default_dir
from tests.kernel import require
from tests.layer_trees import BUSYBOX
from tests.leaks import microvm_left
from tests.test_layer_tools import make_python_base
from tests.test_microvm import _answer, _played_guest, _until_broken
from tests.test_ports import http_get
from tests.vm_shapes import create_vm

LAYER = "vm-python"
MEMORY_MB = 512
PORT = 8000
APPLETS = ("sh", "cat", "echo", "sleep", "head", "grep", "sha256sum", "true", "test", "ls")
# Reads to the client's half-close, answers the sha256 of what came and then 3 MiB of a pattern,
# and closes: both directions past several windows, and both half-closes.
ECHO = """
import hashlib, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 9000)); s.listen()
c, _ = s.accept(); h = hashlib.sha256()
while (b := c.recv(1 << 16)): h.update(b)
c.sendall(h.hexdigest().encode() + bytes(range(256)) * (3 << 12)); c.close()
"""


@pytest.fixture(scope="module")
async def python_layer(fleet, platform, tmp_path_factory) -> str:
    require(os.geteuid() == 0, "microVMs need root")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86 is installed")
    require(isinstance(GuestImage.find(default_dir()), GuestImage), "a built guest (make install)")
    tree = tmp_path_factory.mktemp("vm-python")
    make_python_base(tree)  # this host's python3; /bin is a link to usr/bin (merged /usr)
    shutil.copy2(BUSYBOX, tree / "usr/bin/busybox")
    for applet in APPLETS:
        if not (tree / "usr/bin" / applet).exists():
            os.symlink("busybox", tree / "usr/bin" / applet)
    await Layers(fleet.bus).build_dir(LAYER, tree)
    return LAYER


async def _create(fleet, layer: str):
    """The first create boots and saves this layer's machine state (see tests/test_microvm.py)."""
    return await create_vm(fleet, tries=2, isolation="microvm", layers=[layer], memory_mb=MEMORY_MB, timeout_s=300)


async def _listening(sb, port: int) -> None:
    """Until the guest's /proc/net/tcp shows a listener on `port` (a server started in the background)."""
    wait = f"until grep -q ':{port:04X} 00000000:0000 0A' /proc/net/tcp; do sleep 0.1; done"
    r = await sb.exec(["sh", "-c", wait], timeout_s=120)
    assert r.exit_code == 0, r


async def test_a_python_http_server_in_the_guest_answers_through_a_forward(fleet, platform, python_layer):
    sb = await _create(fleet, python_layer)
    try:
        await sb.write_file("/workspace/index.html", b"hello from the guest")
        big = bytes(range(256)) * 12288  # 3 MiB: a dozen windows
        await sb.write_file("/workspace/big", big)
        start = f"python3 -m http.server {PORT} --bind 127.0.0.1 -d /workspace </dev/null >/dev/null 2>&1 &"
        assert (await sb.exec(["sh", "-c", start])).exit_code == 0
        await _listening(sb, PORT)
        async with sb.forward(PORT) as (host, port):
            assert await asyncio.to_thread(http_get, host, port, "/index.html") == (200, b"hello from the guest")
            assert (await asyncio.to_thread(http_get, host, port, "/missing"))[0] == 404
            status, body = await asyncio.to_thread(http_get, host, port, "/big")
            assert status == 200 and body == big
            results = await asyncio.gather(*(asyncio.to_thread(http_get, host, port, "/index.html")
                                             for _ in range(8)))
            assert results == [(200, b"hello from the guest")] * 8
        # Bytes in, the half-close across, an answer and the guest's own close back.
        assert (await sb.exec(["sh", "-c", 'python3 -c "$ECHO" </dev/null >/dev/null 2>&1 &'],
                              env={"ECHO": ECHO})).exit_code == 0
        await _listening(sb, 9000)
        data = os.urandom(2 << 20)
        async with sb.forward(9000) as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(data)
            await writer.drain()
            writer.write_eof()
            back = await asyncio.wait_for(reader.read(-1), 120)
            writer.close()
        assert back[:64].decode() == hashlib.sha256(data).hexdigest()
        assert back[64:] == bytes(range(256)) * (3 << 12)
        # A port nobody listens on: the forward is refused at once (the guest's agent was asked).
        with pytest.raises(PortRefused, match="8999"):
            async with sb.forward(8999):
                pass
        with pytest.raises(errors.Unsupported, match="loopback"):
            async with sb.forward(PORT, host="own"):
                pass
        assert (await sb.exec(["true"])).exit_code == 0  # the agent is still in order
    finally:
        await sb.destroy()
    for _ in range(100):
        if not microvm_left(str(platform.data_dir), sb.id):
            break
        await asyncio.sleep(0.05)
    assert microvm_left(str(platform.data_dir), sb.id) == []


# -- the node's books of a connection, against a guest played by the test -----------------------------

async def _opened(channel, guest_end):
    """A connection the node opened (request 1), the played guest agreeing."""
    opening = asyncio.ensure_future(channel.open_port(False, 80))
    await asyncio.sleep(0.05)
    await asyncio.get_running_loop().sock_sendall(guest_end, _answer("opened", 1))
    return await opening


@pytest.mark.parametrize("sent, why", [
    ([_answer("pdata", 7, b"x")], "not open"),
    ([_answer("pdata", 1, b"y" * frames.CHUNK)] * (frames.PORT_WINDOW // frames.CHUNK + 1), "past its window"),
    ([_answer("packed", 1, 1)], "never sent"),
    ([_answer("peof", 1), _answer("pdata", 1, b"late")], "after its end"),
    ([_answer("peof", 1), _answer("peof", 1)], "ended twice"),
    ([_answer("pclosed", 1)], "did not close"),
    ([_answer("pdata", 1, b"")], "not one"),  # an empty data frame is no data
    ([_answer("opened", 1)], "nobody asked"),
])
async def test_a_guest_that_breaks_a_connections_books_is_cut_off(sent, why):
    channel, guest_end, told = await _played_guest()
    try:
        port = await _opened(channel, guest_end)
        await asyncio.get_running_loop().sock_sendall(guest_end, b"".join(sent))
        assert why in await _until_broken(channel)
        assert told == [channel.broken]
        assert await port.inbound.get() in (None, b"y" * frames.CHUNK, b"late")  # readers are woken
        with pytest.raises(GuestBroken):
            await channel.open_port(False, 80)
    finally:
        channel.close()
        guest_end.close()


async def test_a_refused_connect_is_a_connection_refused_and_a_silent_close_cuts_the_guest_off():
    channel, guest_end, told = await _played_guest(reply_timeout=0.5)
    loop = asyncio.get_running_loop()
    try:
        opening = asyncio.ensure_future(channel.open_port(False, 81))
        await asyncio.sleep(0.05)
        await loop.sock_sendall(guest_end, _answer("failed", 1, 111, "connect"))
        with pytest.raises(ConnectionRefusedError):
            await opening
        opening = asyncio.ensure_future(channel.open_port(False, 80))
        await asyncio.sleep(0.05)
        await loop.sock_sendall(guest_end, _answer("opened", 2))
        port = await opening
        await channel.close_port(port)  # never answered `pclosed`
        assert "did not close connection 2" in channel.broken and told == [channel.broken]
    finally:
        channel.close()
        guest_end.close()
    with pytest.raises(ValueError, match="not a TCP port"):
        frames.port_open_request(1, False, 70000)

"""Port forwarding against the real platform, for `process` (host view, Python's http.server)
and `container` (busybox httpd on a busybox layer): real HTTP through a forward, a large
transfer byte for byte, many connections at once, a closed port refused, nothing but the
sandbox's own ports reachable, and destroy ending the tunnels.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator

import pytest

from sandfleet import errors
from sandfleet._ports import PortRefused
from sandfleet.tunnel import TunnelEnd
from sandfleet.bus import Bus, decode, encode
from sandfleet.layers_client import Layers
from schemas import node, ports
from schemas.errors import ErrorBody
from schemas.ports import Frame, Reset
from sandfleet.config import free_port
from tests.conftest import CLI, ROOT
from tests.kernel import require
from tests.layer_trees import APPLETS, make_busybox_base
from tests.natsd import bare_nats_server

BASE = "pf-base"
PORT = 8000
BIG = 50 * 1024 * 1024
# A Python echo server for the process level: every byte back, then the half-close back.
ECHO = ("import socket,threading\n"
        "s=socket.create_server(('127.0.0.1',9000))\n"
        "def one(c):\n"
        "    while (d:=c.recv(65536)): c.sendall(d)\n"
        "    c.shutdown(socket.SHUT_WR); c.close()\n"
        "while True: threading.Thread(target=one,args=(s.accept()[0],)).start()\n")


@pytest.fixture(scope="module")
async def busybox_layer(fleet, platform, tmp_path_factory):
    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("pf-src") / "base"
    make_busybox_base(src, hostname="pf", applets=(*APPLETS, "httpd", "sha256sum"))
    await Layers(fleet.bus).build_dir(BASE, src)
    return BASE


@contextlib.asynccontextmanager
async def serving(fleet, level: str) -> AsyncIterator:
    """A sandbox of `level` with an HTTP server on PORT serving /workspace (index.html: 'hello')."""
    if level == "container":
        sb = await fleet.create(isolation="container", memory_mb=256, disk_mb=256, layers=[BASE])
        start = "httpd -p 8000 -h /workspace"
    else:
        sb = await fleet.create(memory_mb=256, disk_mb=256, host_view=True)
        start = "python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace </dev/null >/dev/null 2>&1 &"
    try:
        await sb.write_file("/workspace/index.html", b"hello")
        r = await sb.exec(["sh", "-c", start])
        assert r.exit_code == 0, r.stderr
        yield sb
    finally:
        with contextlib.suppress(errors.SandfleetError):
            await sb.destroy()


@contextlib.asynccontextmanager
async def forward_when_listening(sb, port: int = PORT, attempts: int = 100) -> AsyncIterator[tuple[str, int]]:
    """The server was started in the background: it listens soon, not at once."""
    for attempt in range(attempts):
        forward = sb.forward(port)
        try:
            address = await forward.__aenter__()
        except PortRefused:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.1)
            continue
        try:
            yield address
        finally:
            await forward.__aexit__(None, None, None)
        return


def http_get(host: str, port: int, path: str = "/") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(params=["process", "container"])
def level(request) -> str:
    if request.param == "container":  # built once, only when a container test runs
        request.getfixturevalue("busybox_layer")
    return request.param


async def test_an_http_server_in_the_sandbox_answers_through_a_forward(fleet, level):
    async with serving(fleet, level) as sb, forward_when_listening(sb) as (host, port):
        assert host == "127.0.0.1"
        assert await asyncio.to_thread(http_get, host, port, "/index.html") == (200, b"hello")
        status, _ = await asyncio.to_thread(http_get, host, port, "/missing")
        assert status == 404


async def test_a_large_file_served_by_the_sandbox_arrives_byte_for_byte(fleet, level):
    async with serving(fleet, level) as sb:
        r = await sb.exec(["sh", "-c", f"head -c {BIG} /dev/urandom > /workspace/big && sha256sum /workspace/big"])
        assert r.exit_code == 0, r.stderr
        want = r.stdout.split()[0].decode()
        async with forward_when_listening(sb) as (host, port):
            status, body = await asyncio.to_thread(http_get, host, port, "/big")
        assert status == 200 and len(body) == BIG
        assert hashlib.sha256(body).hexdigest() == want


async def test_bytes_sent_into_the_sandbox_come_back_byte_for_byte_with_the_half_close(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True)
    try:
        echo = f"python3 -c \"$ECHO\" </dev/null >/dev/null 2>&1 &"
        assert (await sb.exec(["sh", "-c", echo], env={"ECHO": ECHO})).exit_code == 0
        data = os.urandom(20 * 1024 * 1024)
        async with forward_when_listening(sb, 9000) as (host, port):
            reader, writer = await asyncio.open_connection(host, port)

            async def send() -> None:
                for i in range(0, len(data), 1 << 20):
                    writer.write(data[i:i + (1 << 20)])
                    await writer.drain()
                writer.write_eof()  # the server's recv sees the end only if FIN crossed the tunnel

            sending = asyncio.create_task(send())
            back = await reader.read(-1)  # to EOF: the server's own half-close, back through the tunnel
            await sending
            writer.close()
        assert len(back) == len(data) and back == data
    finally:
        await sb.destroy()


async def test_many_connections_at_once_through_one_forward(fleet, level):
    async with serving(fleet, level) as sb, forward_when_listening(sb) as (host, port):
        results = await asyncio.gather(*(asyncio.to_thread(http_get, host, port, "/index.html") for _ in range(64)))
        assert results == [(200, b"hello")] * 64


async def test_a_forward_to_a_port_nobody_listens_on_is_refused_and_changes_nothing(fleet, level):
    async with serving(fleet, level) as sb:
        with pytest.raises(PortRefused) as refused:
            async with sb.forward(PORT + 1):
                pass
        assert isinstance(refused.value, errors.Conflict) and "connection refused" in refused.value.message
        async with forward_when_listening(sb) as (host, port):  # the sandbox and the node serve on
            assert await asyncio.to_thread(http_get, host, port, "/index.html") == (200, b"hello")


async def test_a_forward_reaches_neither_the_host_nor_another_sandbox(fleet):
    host_listener = socket.create_server(("127.0.0.1", 0))  # on the host's loopback
    host_port = host_listener.getsockname()[1]
    other_ctx = serving(fleet, "process")
    other = await other_ctx.__aenter__()  # another sandbox, listening on PORT
    target = await fleet.create(memory_mb=64, host_view=True)  # listening on nothing
    try:
        async with forward_when_listening(other):
            pass  # the other sandbox's server is up
        for port in (host_port, PORT):
            with pytest.raises(PortRefused):
                async with target.forward(port):
                    pass
        # Naming any address but the sandbox's own is refused by the schema: nothing is connected.
        for host in ("10.0.0.1", "127.0.0.2", "0.0.0.0", "sb-other"):
            raw = {"type": "port_open", "sandbox_id": target.id, "port": host_port, "host": host,
                   "reply_subject": "_INBOX.pf-test.1"}
            msg = await fleet.bus.nc.request(node.subject(target.node, ports.PORT_OPEN), encode(raw), timeout=10)
            assert decode(msg.data, ErrorBody).code.value == "invalid_request"
        # A reply subject that is not the client's own inbox would let a tunnel publish anywhere.
        raw = {"type": "port_open", "sandbox_id": other.id, "port": PORT, "reply_subject": "sandbox.v1.create"}
        msg = await fleet.bus.nc.request(node.subject(target.node, ports.PORT_OPEN), encode(raw), timeout=10)
        assert decode(msg.data, ErrorBody).code.value == "invalid_request"
        with pytest.raises(errors.Unsupported):  # its own egress address: it has none (no egress rules)
            async with target.forward(PORT, host="own"):
                pass
        await other.pause()
        with pytest.raises(errors.Conflict) as frozen:  # frozen: nothing would answer
            async with other.forward(PORT):
                pass
        assert not isinstance(frozen.value, PortRefused) and "frozen" in frozen.value.message
        await other.resume()
        host_listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            host_listener.accept()  # nothing ever connected to the host's listener
    finally:
        host_listener.close()
        await target.destroy()
        await other_ctx.__aexit__(None, None, None)


async def test_entering_a_forward_does_not_spend_a_listener_that_accepts_once(fleet):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        once = ("import socket; s=socket.create_server(('127.0.0.1', 9001)); c=s.accept()[0]; "
                "c.sendall(b'once'); c.close()")
        assert (await sb.exec(["sh", "-c", 'python3 -c "$ONCE" </dev/null >/dev/null 2>&1 &'],
                              env={"ONCE": once})).exit_code == 0
        async with forward_when_listening(sb, 9001) as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            assert await reader.read(-1) == b"once"  # the first connection through is the listener's one
            writer.close()
    finally:
        await sb.destroy()


async def test_own_reaches_a_server_bound_to_the_sandbox_s_egress_address_only(fleet):
    network = (await fleet.security((await fleet.nodes())[0].id)).mechanisms["egress-network"]
    require(network.startswith("on:"), f"sandbox egress is off on this machine: {network}")
    sb = await fleet.create(memory_mb=128, host_view=True, allow=["192.0.2.1:80"])  # egress: an address of its own
    try:
        r = await sb.exec(["ip", "-o", "-4", "addr", "show", "scope", "global"])
        assert r.exit_code == 0, r.stderr
        address = r.stdout.split()[3].split(b"/")[0].decode()
        start = f"python3 -m http.server 8000 --bind {address} -d /workspace </dev/null >/dev/null 2>&1 &"
        await sb.write_file("/workspace/index.html", b"own")
        assert (await sb.exec(["sh", "-c", start])).exit_code == 0
        for _ in range(100):
            try:
                async with sb.forward(PORT, host="own") as (host, port):
                    assert await asyncio.to_thread(http_get, host, port, "/index.html") == (200, b"own")
                break
            except PortRefused:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the server on the sandbox's own address never answered")
        with pytest.raises(PortRefused):  # bound to that address alone: its loopback has nothing
            async with sb.forward(PORT):
                pass
    finally:
        await sb.destroy()


def _sockets_of(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:"):
                found.add(link)
    return found


async def test_destroy_ends_the_sandboxs_tunnels_and_leaves_no_socket_on_the_node(fleet, platform, level):
    launcher = platform.service_pid("launcher")
    async with serving(fleet, level) as sb, forward_when_listening(sb) as (host, port):
        before = _sockets_of(launcher)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /index.html HTTP/1.1\r\nHost: x\r\n")  # a request left open: the tunnel stays up
        await writer.drain()
        held = set()
        for _ in range(200):  # until the node has connected inside the sandbox
            held = _sockets_of(launcher) - before
            if held:
                break
            await asyncio.sleep(0.05)
        assert held, "the tunnel's socket on the node"
        await sb.destroy()
        with contextlib.suppress(ConnectionError):
            assert await reader.read(-1) == b""  # the local connection ends with its sandbox
        writer.close()
        assert not (_sockets_of(launcher) & held)
        with pytest.raises(errors.NotFound):
            async with sb.forward(PORT):
                pass


async def test_the_cli_forwards_a_port_until_ctrl_c_and_ends_quietly(fleet, platform):
    async with serving(fleet, "process") as sb:
        async with forward_when_listening(sb):
            pass  # the server is up
        local = free_port()
        cli = subprocess.Popen([*CLI, "port-forward", sb.id, f"{PORT}:{local}"], cwd=ROOT,
                               env={**platform.env, "SANDFLEET_NATS_URL": platform.url},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = await asyncio.to_thread(cli.stdout.readline)  # printed once it listens
            assert f"127.0.0.1:{local}".encode() in line
            assert await asyncio.to_thread(http_get, "127.0.0.1", local, "/index.html") == (200, b"hello")
        finally:
            cli.send_signal(signal.SIGINT)
            out, err = await asyncio.to_thread(cli.communicate, timeout=30)
        assert cli.returncode == 0 and err == b""
        bad = platform.cli("port-forward", sb.id, "0:70000", check=False)
        assert bad.returncode == 2 and b"Traceback" not in bad.stderr
        refused = platform.cli("port-forward", sb.id, f"{PORT + 1}", check=False)
        assert refused.returncode == 2 and b"PortRefused" in refused.stderr and b"Traceback" not in refused.stderr


# -- the tunnel protocol itself: two real ends over a bare nats-server, sockets for the streams --


@pytest.fixture
async def bare_bus(tmp_path):
    with bare_nats_server(tmp_path) as url:
        bus = await Bus.connect(url, "test-ports")
        try:
            yield bus
        finally:
            await bus.close()


async def _end(bus, inbox: str, peer: str, *, window: int = 64 * 1024, idle_s: float = 30.0):
    """A TunnelEnd on one side of a socket pair, receiving on `inbox`; returns (end, app socket)."""
    app, mine = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=mine)
    end = TunnelEnd(bus.nc, reader, writer, peer, window=window, keepalive_s=idle_s / 3, idle_s=idle_s)
    await bus.subscribe_direct(inbox, lambda msg: end.feed(msg.data))
    return end, app


async def test_a_slow_reader_holds_the_sender_to_one_window_and_loses_nothing(bare_bus):
    node_end, server = await _end(bare_bus, "t.node", "t.client")
    client_end, reader_app = await _end(bare_bus, "t.client", "t.node")
    runs = [asyncio.create_task(node_end.run()), asyncio.create_task(client_end.run())]
    data = os.urandom(8 * 1024 * 1024)  # far more than the window and both sockets' buffers
    sending = asyncio.create_task(asyncio.to_thread(server.sendall, data))
    for _ in range(400):  # until the node end has spent its credit: it stopped reading the server
        if node_end._credit == 0 and client_end.buffered:
            break
        await asyncio.sleep(0.025)
    assert node_end._credit == 0 and not sending.done()  # the sandbox's server is held back, not buffered
    assert client_end.buffered <= client_end.window
    got = bytearray()
    reader_app.setblocking(False)
    while len(got) < len(data):
        try:
            got += reader_app.recv(1 << 20)
        except BlockingIOError:
            await asyncio.sleep(0.005)
    await sending
    assert bytes(got) == data
    server.shutdown(socket.SHUT_WR)  # the server's half-close ends at the reader as EOF
    reader_app.setblocking(True)
    assert await asyncio.to_thread(reader_app.recv, 1) == b""
    reader_app.close()
    assert await asyncio.gather(*runs) == [None, None]  # both directions closed cleanly
    server.close()


@pytest.mark.parametrize("bad", ["past_credit", "out_of_sequence", "undecodable"])
async def test_a_peer_breaking_the_protocol_resets_the_tunnel(bare_bus, bad):
    node_end, server = await _end(bare_bus, "t.node", "t.client", window=1024)
    run = asyncio.create_task(node_end.run())
    if bad == "past_credit":
        frames = [ports.frame(Frame.DATA, 1, body=b"x" * 1025)]
    elif bad == "out_of_sequence":
        frames = [ports.frame(Frame.DATA, 1, body=b"a"), ports.frame(Frame.DATA, 3, body=b"b")]
    else:
        frames = [b"\x09" + bytes(16)]
    for f in frames:
        await bare_bus.nc.publish("t.node", f)
    assert await run == Reset.PROTOCOL
    server.settimeout(10)
    with contextlib.suppress(ConnectionResetError):
        assert server.recv(4096) in (b"", b"a")  # never more than what came in order
    server.close()


async def test_a_vanished_client_s_tunnel_is_torn_down_by_the_node(bare_bus):
    node_end, server = await _end(bare_bus, "t.node", "t.nobody", idle_s=0.6)
    assert await node_end.run() == Reset.IDLE  # nothing heard: its socket is closed, nothing held
    server.settimeout(10)
    with contextlib.suppress(ConnectionResetError):
        assert server.recv(1) == b""
    server.close()


class _PairDriver:
    """Stands in for a sandbox's driver in a unit test of the node's tunnel table: each connect
    is one end of a socket pair, the other end kept as the 'server'."""

    def __init__(self) -> None:
        self.servers: list[socket.socket] = []

    async def connect_port(self, instance, host, port):
        server, node_side = socket.socketpair()
        node_side.setblocking(False)
        self.servers.append(server)
        return node_side


async def test_the_node_holds_at_most_its_tunnel_limit_and_ending_a_sandbox_frees_them(bare_bus):
    from types import SimpleNamespace

    from services.launcher.settings import LauncherSettings
    from services.launcher.tunnels import Tunnels
    from sandfleet.errors import ServiceError

    driver = _PairDriver()
    live = SimpleNamespace(quarantined=False, paused=False, ending=False, driver=driver, instance=None, attached={})
    launcher = SimpleNamespace(node_id="n-unit", settings=LauncherSettings(max_tunnels=2),
                               get_live=lambda sandbox_id: live)
    table = Tunnels(bare_bus, launcher)  # type: ignore[arg-type]
    await table.listen()
    req = ports.PortOpenRequest(sandbox_id="sb-unit", port=PORT, reply_subject="_INBOX.unit.1")
    opened = [await table.open(req), await table.open(req)]
    assert all(isinstance(o, ports.TunnelOpened) for o in opened) and len(table.by_id) == 2
    with pytest.raises(ServiceError) as full:
        await table.open(req)
    assert full.value.code.value == "capacity" and len(driver.servers) == 2  # refused before connecting
    assert list(live.attached) == ["tunnels"]  # what the launcher ends with the sandbox
    await live.attached.popitem()[1].end()
    assert table.by_id == {} and table.by_sandbox == {}
    for server in driver.servers:
        server.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert server.recv(1) == b""  # the node's side is closed
        server.close()
    assert isinstance(await table.open(req), ports.TunnelOpened)  # room again
    await table.close()
    assert table.by_id == {}
    for server in driver.servers:
        server.close()

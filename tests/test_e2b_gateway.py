"""The E2B gateway (services/gateway) judged by the official `e2b` SDK from PyPI, unchanged, pointed
at it with its API and sandbox URL settings, on the real platform: create from a template, commands
in the foreground and the background (output callbacks, stdin, kill, list, connect), files (write,
read, list, make_dir, rename, remove, watch), set_timeout, list and connect, kill, get_host(port)
reached with an HTTP request carrying that Host, E2B's error shapes for bad calls, both flavours
of the SDK. Templates here are a host-view process sandbox (quick; Python's http.server in it).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import time

import pytest
from e2b import (AsyncSandbox, AuthenticationException, CommandExitException, FileNotFoundException, FileType,
                 FilesystemEventType, NotFoundException, PtySize, Sandbox, SandboxException, SandboxNotFoundException,
                 SandboxQuery)

from sandfleet.config import free_port
from tests.conftest import CLI, EVENT_DEADLINE_S, NODE_ID, ROOT, assert_nothing_left, start_platform, stop_platform
from tests.kernel import require
from tests.layer_trees import make_busybox_base
from tests.leaks import Snapshot

KEY, OTHER_KEY = "e2b_test_key_a", "e2b_test_key_b"
HOST_TEMPLATE = {"isolation": "process", "host_view": True, "memory_mb": 256, "disk_mb": 256}


@pytest.fixture(scope="module")
def gateway(platform, tmp_path_factory):
    """`sandfleet gateway` against the session's platform, on a free loopback port."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("gateway") / "gateway.log", "wb")
    proc = subprocess.Popen(
        [*CLI, "gateway", "--nats", platform.url, "--listen", f"127.0.0.1:{port}",
         "--api-key", f"{KEY}=tenant-a", "--api-key", f"{OTHER_KEY}=tenant-b",
         "--templates", json.dumps({"host": HOST_TEMPLATE})],
        env={**platform.env, "SANDFLEET_DATA_DIR": str(platform.data_dir)}, cwd=ROOT, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the gateway exited at start"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            break
        assert time.monotonic() < deadline, "the gateway did not listen within 60s"
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    yield {"url": url, "port": port, "opts": {"api_key": KEY, "api_url": url, "sandbox_url": url}}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    assert proc.returncode == 0, "the gateway did not stop cleanly on SIGTERM"


@pytest.fixture
async def sbx(gateway):
    sandbox = await AsyncSandbox.create(template="host", metadata={"suite": "e2b-gateway"}, **gateway["opts"])
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def eventually(check, what: str, deadline_s: float = EVENT_DEADLINE_S):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + deadline_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} within {deadline_s:g}s"
        await asyncio.sleep(0.1)


def request(port: int, method: str, path: str, *, host: str | None = None, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request to the gateway on 127.0.0.1 (never DNS), with the Host header chosen."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True)
        conn.putheader("Host", host or f"127.0.0.1:{port}")
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body or b"")
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# -- commands -----------------------------------------------------------------------------------

async def test_a_command_runs_in_the_foreground_and_a_failing_one_raises(sbx):
    result = await sbx.commands.run("echo hello; echo oops >&2; pwd")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello\n/workspace\n", "oops\n")
    result = await sbx.commands.run("echo $GREETING from $PWD", envs={"GREETING": "hi"}, cwd="/tmp")
    assert result.stdout == "hi from /tmp\n"
    with pytest.raises(CommandExitException) as failed:
        await sbx.commands.run("echo partial; exit 3")
    assert (failed.value.exit_code, failed.value.stdout) == (3, "partial\n")


async def test_a_background_command_streams_takes_stdin_and_is_killed(sbx):
    seen: list[str] = []
    handle = await sbx.commands.run("cat", background=True, stdin=True, on_stdout=seen.append)
    assert handle.pid in [p.pid for p in await sbx.commands.list()]
    await sbx.commands.send_stdin(handle.pid, "ping\n")
    await eventually(lambda: _async("".join(seen) == "ping\n"), "the echoed stdin came back to on_stdout")
    again = await sbx.commands.connect(handle.pid)  # a second reader of the same process
    await sbx.commands.send_stdin(handle.pid, "pong\n")
    await eventually(lambda: _async("".join(seen) == "ping\npong\n"), "the second line came back too")
    assert await sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as ended:
        await handle.wait()
    assert (ended.value.exit_code, ended.value.stdout) == (-1, "ping\npong\n")  # a signal's end, as envd reports it
    with pytest.raises(CommandExitException):
        await again.wait()
    assert "pong\n" in again.stdout
    assert await sbx.commands.kill(handle.pid) is False  # gone: E2B's answer for a pid it does not have
    assert handle.pid not in [p.pid for p in await sbx.commands.list()]


async def test_a_terminal_takes_keys_resizes_and_is_killed(sbx):
    screen = bytearray()
    term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=screen.extend)
    await sbx.pty.send_stdin(term.pid, b"tty; echo $((6*7))\n")
    await eventually(lambda: _async(b"42" in screen and b"/dev/pts/" in screen), "the terminal answered the keys")
    await sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
    await sbx.pty.send_stdin(term.pid, b"stty size\n")
    await eventually(lambda: _async(b"40 100" in screen), "the new size seen inside")
    assert await sbx.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):
        await term.wait()


async def _async(value):  # type: ignore[no-untyped-def]
    return value


async def test_stdin_closed_ends_a_reader_and_create_envs_reach_commands(gateway):
    sandbox = await AsyncSandbox.create(template="host", envs={"FROM_CREATE": "yes"}, **gateway["opts"])
    try:
        assert (await sandbox.commands.run("echo $FROM_CREATE")).stdout == "yes\n"
        handle = await sandbox.commands.run("wc -c", background=True, stdin=True)
        await sandbox.commands.send_stdin(handle.pid, b"12345")
        await sandbox.commands.close_stdin(handle.pid)
        result = await handle.wait()
        assert (result.exit_code, result.stdout.strip()) == (0, "5")
    finally:
        await sandbox.kill()


async def test_many_commands_at_once_each_get_their_own_output(sbx):
    results = await asyncio.gather(*(sbx.commands.run(f"sleep 0.$((RANDOM % 5)); echo {i}") for i in range(24)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(24)]


async def test_a_background_command_ends_by_itself_with_its_output(sbx):
    lines: list[str] = []
    handle = await sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done", background=True,
                                    on_stdout=lines.append)
    result = await handle.wait()
    assert result.exit_code == 0 and result.stdout == "line1\nline2\nline3\n"
    assert "".join(lines) == "line1\nline2\nline3\n"


# -- files --------------------------------------------------------------------------------------

async def test_files_write_read_list_make_dir_rename_and_remove(gateway, sbx):
    info = await sbx.files.write("/workspace/notes/a.txt", "hello")  # parents made, as envd does
    assert (info.path, info.name) == ("/workspace/notes/a.txt", "a.txt")
    assert await sbx.files.read("/workspace/notes/a.txt") == "hello"
    await sbx.files.write("b.bin", bytes(range(256)) * 8)  # relative: from the home directory
    assert await sbx.files.read("/workspace/b.bin", format="bytes") == bytearray(bytes(range(256)) * 8)
    big = os.urandom(3 * 1024 * 1024 + 17)  # past one request: a chunked download
    await sbx.files.write("/workspace/big.bin", big)
    assert bytes(await sbx.files.read("/workspace/big.bin", format="bytes")) == big
    assert (await sbx.commands.run("sha256sum /workspace/big.bin")).stdout.split()[0] == __import__(
        "hashlib").sha256(big).hexdigest()
    await sbx.files.write("/workspace/stream.bin", io.BytesIO(b"streamed" * 1000))  # the octet-stream upload
    await sbx.files.write("/workspace/zipped.txt", "compressed on the way", gzip=True)
    assert await sbx.files.read("/workspace/stream.bin", format="bytes") == bytearray(b"streamed" * 1000)
    assert await sbx.files.read("/workspace/zipped.txt") == "compressed on the way"
    many = await sbx.files.write_files([{"path": "/workspace/m/one", "data": "1"}, {"path": "m/two", "data": b"2"}])
    assert sorted(w.path for w in many) == ["/workspace/m/one", "/workspace/m/two"]
    assert [await sbx.files.read(p) for p in ("/workspace/m/one", "/workspace/m/two")] == ["1", "2"]
    info = await sbx.files.get_info("/workspace/m/one")
    assert (info.name, info.type, info.size, info.permissions) == ("one", FileType.FILE, 1, "rw-r--r--")
    envd = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
            "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}
    status, body = await asyncio.to_thread(request, gateway["port"], "POST", "/files?path=/workspace/bomb",
                                           body=b"not gzip at all", headers=envd)
    assert status == 400 and "gzip" in json.loads(body)["message"]
    assert await sbx.files.exists("/workspace/bomb") is False
    assert await sbx.files.make_dir("/workspace/d/e") is True
    assert await sbx.files.make_dir("/workspace/d/e") is False  # it exists
    entries = {e.name: e for e in await sbx.files.list("/workspace")}
    assert {"notes", "b.bin", "big.bin", "d"} <= set(entries)
    assert entries["d"].type == FileType.DIR and entries["b.bin"].type == FileType.FILE
    assert entries["b.bin"].size == 2048 and entries["b.bin"].path == "/workspace/b.bin"
    moved = await sbx.files.rename("/workspace/b.bin", "/workspace/d/c.bin")
    assert moved.path == "/workspace/d/c.bin"
    assert await sbx.files.exists("/workspace/b.bin") is False
    assert await sbx.files.exists("/workspace/d/c.bin") is True
    await sbx.files.remove("/workspace/d")  # a directory and all in it
    assert await sbx.files.exists("/workspace/d") is False
    with pytest.raises(FileNotFoundException):
        await sbx.files.read("/workspace/missing.txt")
    with pytest.raises(NotFoundException):
        await sbx.files.list("/workspace/missing")


async def test_a_watch_sees_files_made_and_removed(sbx):
    await sbx.files.make_dir("/workspace/w")
    events: list = []
    handle = await sbx.files.watch_dir("/workspace/w", on_event=events.append, include_entry=True)
    try:
        await sbx.files.write("/workspace/w/new.txt", "x")
        await eventually(lambda: _async(any(e.name == "new.txt" and e.type in (
            FilesystemEventType.CREATE, FilesystemEventType.WRITE) for e in events)), "a create event")
        made = next(e for e in events if e.name == "new.txt")
        assert made.entry is not None and made.entry.path == "/workspace/w/new.txt"
        await sbx.files.remove("/workspace/w/new.txt")
        await eventually(lambda: _async(any(e.name == "new.txt" and e.type == FilesystemEventType.REMOVE
                                            for e in events)), "a remove event")
    finally:
        await handle.stop()


# -- the control plane --------------------------------------------------------------------------

async def test_set_timeout_list_connect_and_kill(gateway, sbx):
    before = await sbx.get_info()
    assert before.sandbox_id == sbx.sandbox_id and before.metadata == {"suite": "e2b-gateway"}
    assert before.template_id == "host"
    await sbx.set_timeout(3600)
    after = await sbx.get_info()
    assert after.end_at > before.end_at
    listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "e2b-gateway"}),
                                     **gateway["opts"]).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in listed]
    usage = (await sbx.get_metrics())[-1]
    assert usage.mem_total == 256 << 20 and usage.mem_used > 0 and usage.disk_total == 256 << 20
    assert await sbx.pause() is True
    assert (await sbx.get_info()).state.value == "paused"
    again = await AsyncSandbox.connect(sbx.sandbox_id, **gateway["opts"])  # connect resumes it, as E2B's does
    assert (await again.get_info()).state.value == "running"
    assert (await again.commands.run("echo again")).stdout == "again\n"
    assert await again.is_running() is True
    other = {**gateway["opts"], "api_key": OTHER_KEY}  # another tenant sees nothing of it
    assert sbx.sandbox_id not in [s.sandbox_id for s in await AsyncSandbox.list(**other).next_items()]
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(sbx.sandbox_id, **other)
    assert await AsyncSandbox.kill(sbx.sandbox_id, **other) is False
    assert await sbx.kill() is True
    assert await sbx.is_running() is False
    assert await AsyncSandbox.kill(sbx.sandbox_id, **gateway["opts"]) is False  # already gone
    with pytest.raises(SandboxException):
        await sbx.commands.run("echo too late")


async def test_a_create_retried_with_its_idempotency_key_gets_the_same_sandbox(gateway):
    first = await AsyncSandbox.create(template="host", idempotency_key="job-7-try", **gateway["opts"])
    try:
        again = await AsyncSandbox.create(template="host", idempotency_key="job-7-try", **gateway["opts"])
        assert again.sandbox_id == first.sandbox_id
        with pytest.raises(SandboxException) as reused:  # the same key with another request
            await AsyncSandbox.create(template="host", metadata={"k": "v"}, idempotency_key="job-7-try",
                                      **gateway["opts"])
        assert "422" in str(reused.value)
    finally:
        await first.kill()


async def test_a_layer_template_is_a_container_even_without_bash(gateway, fleet, tmp_path):
    """A template that is only a layer name runs at the gateway's isolation (container): here a
    busybox layer, which has no bash, so the SDK's `/bin/bash -l -c` runs with its sh."""
    import shutil

    from sandfleet.layers_client import Layers

    require(os.geteuid() == 0 and shutil.which("crun") is not None, "containers need root and crun")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")
    make_busybox_base(tmp_path / "root", hostname="e2b-bb")
    await Layers(fleet.bus).build_dir("e2b-busybox", tmp_path / "root")
    sandbox = await AsyncSandbox.create(template="e2b-busybox", **gateway["opts"])
    try:
        assert (await sandbox.get_info()).template_id == "e2b-busybox"
        result = await sandbox.commands.run("echo in $(cat /etc/hostname); test -e /bin/bash || echo no bash")
        assert result.stdout == "in e2b-bb\nno bash\n"
        handle = await sandbox.commands.run("sleep 30", background=True)
        listed = {p.pid: p for p in await sandbox.commands.list()}
        assert (listed[handle.pid].cmd, listed[handle.pid].args) == ("/bin/bash", ["-l", "-c", "sleep 30"])
        await handle.kill()
        await sandbox.files.write("/workspace/x.txt", "in a container")
        assert await sandbox.files.read("/workspace/x.txt") == "in a container"
    finally:
        await sandbox.kill()


def test_the_sync_sdk_flavour(gateway):
    sandbox = Sandbox.create(template="host", **gateway["opts"])
    try:
        assert sandbox.commands.run("echo sync").stdout == "sync\n"
        sandbox.files.write("/workspace/s.txt", "sync file")
        assert sandbox.files.read("/workspace/s.txt") == "sync file"
        watcher = sandbox.files.watch_dir("/workspace")  # the polled flavour of watches
        sandbox.files.write("/workspace/t.txt", "t")
        deadline = time.monotonic() + EVENT_DEADLINE_S
        names: list[str] = []
        while "t.txt" not in names:
            assert time.monotonic() < deadline, "the sync watcher saw t.txt within the deadline"
            names += [e.name for e in watcher.get_new_events()]
            time.sleep(0.1)
        watcher.stop()
        handle = sandbox.commands.run("sleep 60", background=True)
        assert handle.kill() is True
    finally:
        sandbox.kill()


# -- get_host(port) -------------------------------------------------------------------------------

async def test_get_host_reaches_an_http_server_in_the_sandbox(gateway, sbx):
    await sbx.files.write("/workspace/site/index.html", "hello from the sandbox")
    server = await sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace/site",
                                    background=True)
    host = sbx.get_host(8000)
    assert host == f"8000-{sbx.sandbox_id}.sandfleet.localhost:{gateway['port']}"

    async def answered():  # type: ignore[no-untyped-def]
        status, body = await asyncio.to_thread(request, gateway["port"], "GET", "/index.html", host=host)
        return (status, body) if status == 200 else None

    assert await eventually(answered, "the server answered through the gateway") == (200, b"hello from the sandbox")
    status, _ = await asyncio.to_thread(request, gateway["port"], "GET", "/missing", host=host)
    assert status == 404  # the sandbox's server's answer, passed through
    status, body = await asyncio.to_thread(request, gateway["port"], "GET", "/", host=sbx.get_host(8001))
    assert status == 502 and "port is not open" in json.loads(body)["message"]
    await server.kill()


# A websocket echo server on the standard library only (the sandbox sees the host's Python, not the
# venv): the handshake, then each frame back prefixed "echo:" (short frames: this test's only).
WS_ECHO = """
import base64, hashlib, socket, threading
s = socket.create_server(("127.0.0.1", 8765))
def recv(c, n):
    b = b""
    while len(b) < n:
        b += c.recv(n - len(b)) or exit()
    return b
def one(c):
    req = b""
    while b"\\r\\n\\r\\n" not in req:
        req += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in req.split(b"\\r\\n") if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n"
              b"Sec-WebSocket-Accept: " + accept + b"\\r\\n\\r\\n")
    while True:
        head = recv(c, 2)
        op, n = head[0] & 15, head[1] & 127
        mask = recv(c, 4)
        data = bytes(x ^ mask[i % 4] for i, x in enumerate(recv(c, n)))
        if op == 8:
            c.sendall(b"\\x88\\x00")
            return c.close()
        out = b"echo:" + data
        c.sendall(bytes([0x80 | op, len(out)]) + out)
while True:
    threading.Thread(target=one, args=(s.accept()[0],), daemon=True).start()
"""


async def test_get_host_carries_a_websocket(gateway, sbx):
    from websockets.asyncio.client import connect

    await sbx.files.write("/workspace/ws.py", WS_ECHO)
    server = await sbx.commands.run("python3 /workspace/ws.py", background=True)
    url = f"ws://{sbx.get_host(8765)}/chat"  # dialled at 127.0.0.1: the name is only the Host header

    async def opened():  # type: ignore[no-untyped-def]
        try:
            return await connect(url, host="127.0.0.1", port=gateway["port"], proxy=None, open_timeout=10)
        except OSError:
            return None
        except Exception as exc:  # the server is not up yet: the gateway refuses the upgrade
            return None if "1011" in str(exc) or "HTTP" in str(exc) else exc

    ws = await eventually(opened, "the websocket opened through the gateway")
    assert not isinstance(ws, Exception), ws
    async with ws:
        await ws.send("hello")
        assert await ws.recv() == "echo:hello"
        await ws.send(b"\x00\x01")
        assert await ws.recv() == b"echo:\x00\x01"
    await server.kill()


# -- bad calls get E2B's error shapes ------------------------------------------------------------

async def test_bad_calls_get_e2b_error_shapes(gateway, sbx):
    port = gateway["port"]
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(template="host", **{**gateway["opts"], "api_key": "not-a-key"})
    with pytest.raises(SandboxException) as unknown:
        await AsyncSandbox.create(template="no-such-layer-here", **gateway["opts"])
    assert "no-such-layer-here" in str(unknown.value)
    status, body = await asyncio.to_thread(request, port, "POST", "/v2/sandboxes", body=b"{not json",
                                           headers={"X-API-KEY": KEY, "Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["code"] == 400 and json.loads(body)["message"]
    status, body = await asyncio.to_thread(request, port, "POST", "/v2/sandboxes", body=b'{"timeout": -1}',
                                           headers={"X-API-KEY": KEY})
    assert status == 400 and "templateID" in json.loads(body)["message"]
    status, body = await asyncio.to_thread(request, port, "GET", "/no/such/path", headers={"X-API-KEY": KEY})
    assert status == 404 and json.loads(body) == {"code": 404, "message": "GET /no/such/path: no such path in "
                                                  "the E2B API"}
    status, body = await asyncio.to_thread(request, port, "GET", "/sandboxes", headers={})
    assert status == 401 and json.loads(body)["code"] == 401
    status, body = await asyncio.to_thread(request, port, "PUT", "/sandboxes", headers={"X-API-KEY": KEY})
    assert status == 405 and json.loads(body)["code"] == 405
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.connect("sb-does-not-exist", **gateway["opts"])
    # envd's Connect RPC: a wrong access token and an unknown sandbox get Connect error codes.
    rpc = {"Content-Type": "application/json", "Connect-Protocol-Version": "1", "E2b-Sandbox-Id": "sb-nope"}
    status, body = await asyncio.to_thread(request, port, "POST", "/process.Process/List", body=b"{}",
                                           headers={**rpc, "X-Access-Token": "wrong"})
    assert status == 401 and json.loads(body)["code"] == "unauthenticated"
    status, body = await asyncio.to_thread(request, port, "POST", "/process.Process/NoSuchMethod", body=b"{}",
                                           headers=rpc)
    assert status == 404
    mine = {**rpc, "E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    status, body = await asyncio.to_thread(request, port, "POST", "/filesystem.Filesystem/Stat", body=b"{not json",
                                           headers=mine)
    assert status == 400 and json.loads(body)["code"] == "invalid_argument", body
    status, body = await asyncio.to_thread(request, port, "POST", "/process.Process/SendSignal", headers=mine,
                                           body=b'{"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}')
    assert status == 404 and json.loads(body)["code"] == "not_found"
    gone = await AsyncSandbox.create(template="host", **gateway["opts"])
    await gone.kill()
    with pytest.raises(SandboxException) as ended:  # envd calls to a killed sandbox: E2B's "not running"
        await gone.files.read("/workspace/anything")
    assert "was not found" in str(ended.value)


def test_up_starts_the_gateway_when_asked(tmp_path):
    """`sandfleet up --detach --gateway` returns once the gateway answers, over its own bus; `down`
    stops it with the rest. No sandbox: the session's platform already runs on this egress subnet."""
    before = Snapshot.take()
    node, port = f"{NODE_ID}-gw", free_port()
    p = start_platform(tmp_path / "data", node, extra=("--gateway", f"127.0.0.1:{port}"),
                       env={"SANDFLEET_GATEWAY_API_KEYS": f"{KEY}=tenant-a"})
    try:
        assert p.state()["services"]["gateway"] > 0
        status, body = request(port, "GET", "/v2/sandboxes", headers={"X-API-KEY": KEY})
        assert (status, json.loads(body)) == (200, [])  # answered through the platform's bus
        status, _ = request(port, "GET", "/v2/sandboxes", headers={"X-API-KEY": "wrong"})
        assert status == 401
    finally:
        stop_platform(p)
    assert_nothing_left(before, tmp_path / "data", [node])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


# -- the translation, without a platform ---------------------------------------------------------

def test_port_hosts_paths_and_create_bodies_translate():
    from services.gateway import shapes

    domain = "sandfleet.localhost:3000"
    assert shapes.port_host("8000-sb-abc12.sandfleet.localhost:3000", domain) == (8000, "sb-abc12")
    assert shapes.port_host("8000-sb-abc12.sandfleet.localhost", domain) == (8000, "sb-abc12")
    assert shapes.port_host("8000-sb-abc12.elsewhere.example", domain) is None
    assert shapes.port_host("127.0.0.1:3000", domain) is None
    assert shapes.port_host("99999-sb-abc12.sandfleet.localhost", domain) is None
    assert shapes.sandbox_path("a/b") == "/workspace/a/b"
    assert shapes.sandbox_path("/x/../y//z") == "/y/z"
    with pytest.raises(shapes.BadRequest):
        shapes.sandbox_path("bad\x00path")
    templates = {"host": HOST_TEMPLATE}
    spec = shapes.create_spec({"templateID": "host", "timeout": 30, "metadata": {"k": "v"}, "envVars": {"A": "1"}},
                              tenant="t", templates=templates, isolation="container")
    assert spec["host_view"] is True and spec["timeout_s"] == 30
    assert spec["labels"] == {"tenant": "t", "e2b.template": "host", "e2b.meta/k": "v", "e2b.env/A": "1"}
    layer = shapes.create_spec({"templateID": "debian"}, tenant="t", templates=templates, isolation="container")
    assert (layer["isolation"], layer["layers"], layer["timeout_s"]) == ("container", ["debian"], 300)
    for bad in ({}, {"templateID": ""}, {"templateID": "x", "timeout": 0}, {"templateID": "x", "timeout": "1"},
                {"templateID": "x", "metadata": {"no spaces": "v"}}, {"templateID": "x", "envVars": {"1A": "v"}},
                {"templateID": "x", "metadata": {"k": 1}}, [1]):
        with pytest.raises(shapes.BadRequest):
            shapes.create_spec(bad, tenant="t", templates=templates, isolation="container")
    from services.gateway.envd_process import command_argv, sdk_config

    argv = command_argv("/bin/bash", ["-l", "-c", "echo 'a b'"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3] == "echo 'a b'"
    assert (sdk_config(argv).cmd, list(sdk_config(argv).args)) == ("/bin/bash", ["-l", "-c", "echo 'a b'"])
    assert command_argv("python3", ["-c", "1"]) == ["python3", "-c", "1"]
    token = shapes.access_token(b"secret", "sb-1")
    assert shapes.token_matches(b"secret", "sb-1", token) and not shapes.token_matches(b"secret", "sb-2", token)
    assert not shapes.token_matches(b"other", "sb-1", token)


def test_gateway_settings_refuse_what_they_cannot_use():
    from services.gateway.settings import GatewaySettings, SettingsError

    s = GatewaySettings.from_env({"SANDFLEET_GATEWAY_LISTEN": "127.0.0.1:4100", "SANDFLEET_GATEWAY_API_KEYS": "k=a,j=b"})
    assert (s.port, s.api_keys, s.sandbox_domain) == (4100, {"k": "a", "j": "b"}, "sandfleet.localhost:4100")
    for env in ({"SANDFLEET_GATEWAY_LISTEN": "nowhere"}, {"SANDFLEET_GATEWAY_API_KEYS": "k"},
                {"SANDFLEET_GATEWAY_TEMPLATES": "{"}, {"SANDFLEET_GATEWAY_TEMPLATES": '{"t": {"gpu": 1}}'}):
        with pytest.raises(SettingsError):
            GatewaySettings.from_env(env)

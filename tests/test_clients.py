"""The platform from outside Python's SDK: the `sandfleet` CLI, and a Node.js client with only `nats` from npm."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from sandfleet.credentials import find_creds
from tests.kernel import active_lsms, require

NODE_DIR = Path(__file__).parent / "node"


def test_node_client_creates_execs_and_sees_events(platform):
    require(shutil.which("node") is not None and (NODE_DIR / "node_modules" / "nats").exists(), "node + nats npm")
    out = subprocess.run(
        ["node", str(NODE_DIR / "client.mjs"), platform.url, str(find_creds(platform.url))], capture_output=True,
        text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["exit_code"] == 0 and result["stdout"] == "hello from node\n"
    assert result["events"][-1] == "sandbox.stopped" and "sandbox.stopping" in result["events"]


def test_cli_create_exec_ps_rm_events_status(platform):
    created = json.loads(platform.cli("create", "--memory-mb", "64", "--label", "task=cli", "--host-view", "--json").stdout)
    sid = created["id"]
    out = platform.cli("exec", sid, "--", "sh", "-c", "echo from-cli; exit 4", check=False)
    assert out.returncode == 4 and out.stdout == b"from-cli\n"
    assert sid in platform.cli("ps").stdout.decode()
    status = platform.cli("status").stdout.decode()
    assert status.count(" up") == 6 and "DOWN" not in status
    mechanisms = platform.mechanisms(status)
    assert mechanisms["egress-ebpf"] == "on"
    # Whether Landlock is on is the kernel's to say; what the node reports must agree.
    assert mechanisms["landlock"].startswith("on: ABI " if "landlock" in active_lsms() else "off: not in this kernel")
    assert b"stopped" in platform.cli("rm", sid).stdout
    events = [json.loads(line) for line in platform.cli("events", "--id", sid).stdout.splitlines()]
    assert [e["type"] for e in events][-1] == "sandbox.stopped"
    missing = platform.cli("rm", sid, check=False)
    assert missing.returncode == 1 and b"NotFound" in missing.stderr


async def test_publish_many_delivers_plain_replied_and_headed_messages_as_publish_would(platform):
    import asyncio

    from sandfleet.bus import Bus

    bus = await Bus.connect(platform.url, "publish-many-test")
    got: list = []
    done = asyncio.Event()

    async def seen(msg) -> None:
        got.append((msg.subject, msg.reply, dict(msg.headers or {}), msg.data))
        if len(got) == 4:
            done.set()

    try:
        await bus.nc.subscribe("sftest.many.>", cb=seen)
        await bus.nc.flush()
        await bus.publish_many([
            ("sftest.many.plain", b"one", None, ""),
            ("sftest.many.reply", b"two", None, "sftest.inbox.2"),
            ("sftest.many.headed", b"three", {"Nats-Msg-Id": "x:1"}, ""),
            ("sftest.many.both", b"", {"K": "v"}, "sftest.inbox.4"),
        ])
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await bus.close()
    assert got == [
        ("sftest.many.plain", "", {}, b"one"),
        ("sftest.many.reply", "sftest.inbox.2", {}, b"two"),
        ("sftest.many.headed", "", {"Nats-Msg-Id": "x:1"}, b"three"),
        ("sftest.many.both", "sftest.inbox.4", {"K": "v"}, b""),
    ]

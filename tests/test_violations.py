"""A sandbox's refused network attempts fail (EPERM: refused, not left to time out) and arrive on
the bus as violation events (how soon: loadtest/violation_latency)."""

from __future__ import annotations

import asyncio

from tests.conftest import EVENT_DEADLINE_S

CONNECT = "import socket; s = socket.socket(); s.connect(('10.1.2.3', 80))"
SENDTO = "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('192.0.2.7', 53))"


async def _next_violation(fleet, sandbox_id, started: asyncio.Event):
    stream = fleet.violations(sandbox_id)
    started.set()
    async for v in stream:
        return v


async def _attempt(fleet, code: str):
    sb = await fleet.create(memory_mb=64, labels={"task": "cheat-test"}, host_view=True)
    try:
        started = asyncio.Event()
        waiter = asyncio.create_task(_next_violation(fleet, sb.id, started))
        await started.wait()
        await asyncio.sleep(0.2)  # let the consumer attach
        r = await sb.exec(["python3", "-c", code], timeout_s=10)
        violation = await asyncio.wait_for(waiter, EVENT_DEADLINE_S)
        return sb, r, violation
    finally:
        await sb.destroy()


async def test_connect_to_a_host_not_allowed_is_refused_and_reported(fleet, platform):
    sb, r, v = await _attempt(fleet, CONNECT)
    assert r.exit_code != 0 and b"PermissionError" in r.stderr  # refused, not hanging on a timeout
    assert (v.sandbox_id, v.kind, v.address, v.port) == (sb.id, "network.connect", "10.1.2.3", 80)
    assert v.labels == {"task": "cheat-test"} and v.command == "python3"
    stored = platform.cli("events", "--violations", "--task", "cheat-test").stdout.decode()
    assert f'"sandbox_id":"{sb.id}"' in stored and '"kind":"network.connect"' in stored


async def test_udp_sendto_a_host_not_allowed_is_refused_and_reported(fleet):
    sb, r, v = await _attempt(fleet, SENDTO)
    assert b"PermissionError" in r.stderr
    assert (v.kind, v.address, v.port) == ("network.sendmsg", "192.0.2.7", 53)


async def test_a_restarted_agent_keeps_policing_and_reporting_sandboxes_that_outlived_it(fleet, platform):
    import os
    import signal

    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        old = platform.service_pid("agent")
        os.kill(old, signal.SIGKILL)
        await platform.restarted(fleet, "agent", old)
        started = asyncio.Event()
        waiter = asyncio.create_task(_next_violation(fleet, sb.id, started))
        await started.wait()
        await asyncio.sleep(0.2)
        r = await sb.exec(["python3", "-c", CONNECT], timeout_s=10)
        assert b"PermissionError" in r.stderr
        v = await asyncio.wait_for(waiter, EVENT_DEADLINE_S)
        assert v.address == "10.1.2.3"
    finally:
        await sb.destroy()

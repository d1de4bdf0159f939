"""A tenant follows its own sandboxes' lifecycle events and violations, and never another's, on
a real platform with real credentials: the server hands a tenant's account the events of
`events.v3.sandbox.<tenant>.>` (and the monitor's copies of its violations and actions) and
refuses a subscription to anyone else's. And a tenant forwards its own sandboxes' ports (the
frames come to it under `tunnels.v1.<tenant>.`), never another's.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats
import pytest

import sandfleet
from sandfleet import errors
from sandfleet.credentials import read_seed
from schemas import events, ports, security, violations
from schemas.security import SecurityAction
from schemas.violations import Violation
from tests.security.test_bus_auth import _issue
from tests.test_ports import PORT, forward_when_listening, http_get, serving

pytestmark = pytest.mark.timeout(300)

CHEAT = ("import socket\nfor _ in range(3):\n"
         "    try: socket.socket().connect(('10.1.2.3', 80))\n    except PermissionError: pass")


@pytest.fixture(scope="module")
def creds(platform, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("creds")
    return {name: _issue(platform, "add", name, tmp=tmp) for name in ("carol", "dave")}


class Watch:
    """Collects what one iterator of a fleet yields, from now on."""

    def __init__(self, stream) -> None:
        self.seen: list = []
        self.stream = stream.__aiter__()
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for event in self.stream:
            self.seen.append(event)

    async def until(self, done, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done(self.seen) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> list:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return self.seen


async def test_a_tenant_sees_its_own_events_and_violations_only(platform, creds, fleet):
    async with sandfleet.connect(platform.url, creds=creds["carol"]) as carol, \
            sandfleet.connect(platform.url, creds=creds["dave"]) as dave:
        assert (await carol.tenant(), await dave.tenant(), await fleet.tenant()) == ("carol", "dave", None)
        carol_events, dave_events = Watch(carol.events()), Watch(dave.events())
        carol_bad, dave_bad = Watch(carol.violations()), Watch(dave.violations())
        admin_events = Watch(fleet.events())
        await asyncio.sleep(0.5)  # every watch's subscription is in before anything happens
        mine = await carol.create(memory_mb=64, host_view=True)
        theirs = await dave.create(memory_mb=64, host_view=True)
        try:
            for sb in (mine, theirs):
                assert (await sb.exec(["python3", "-c", CHEAT], timeout_s=20)).exit_code == 0
            def started(ids):
                return lambda seen: {e.sandbox_id for e in seen if e.name == "started"} >= ids
            await carol_events.until(started({mine.id}))
            await dave_events.until(started({theirs.id}))
            await admin_events.until(started({mine.id, theirs.id}))
            await carol_bad.until(lambda seen: len(seen) >= 3)
            await dave_bad.until(lambda seen: len(seen) >= 3)
        finally:
            await mine.destroy()
            await theirs.destroy()
        seen = {name: await w.stop() for name, w in
                (("carol", carol_events), ("dave", dave_events), ("admin", admin_events))}
        bad = {"carol": await carol_bad.stop(), "dave": await dave_bad.stop()}
    # Each tenant: its own sandbox's events, in order, and nothing of the other's.
    assert {e.sandbox_id for e in seen["carol"]} == {mine.id}
    assert {e.sandbox_id for e in seen["dave"]} == {theirs.id}
    names, seqs = [e.name for e in seen["carol"]], [e.seq for e in seen["carol"]]
    assert names[0] == "scheduled" and "started" in names and seqs == sorted(set(seqs))
    assert all(e.tenant == "carol" for e in seen["carol"])
    assert {mine.id, theirs.id} <= {e.sandbox_id for e in seen["admin"]}  # the operator sees both
    # The monitor's copies of each one's violations, to that tenant only.
    assert bad["carol"] and {v.sandbox_id for v in bad["carol"]} == {mine.id}
    assert bad["dave"] and {v.sandbox_id for v in bad["dave"]} == {theirs.id}
    assert all(isinstance(v, Violation) and v.kind == "network.connect" for v in bad["carol"] + bad["dave"])


async def test_a_tenant_cannot_subscribe_to_another_tenants_events(platform, creds, fleet):
    refusals: list[str] = []

    async def error_cb(exc: Exception) -> None:
        refusals.append(str(exc))

    dave = await nats.connect(platform.url, allow_reconnect=False, error_cb=error_cb,
                              nkeys_seed_str=read_seed(creds["dave"]))
    forbidden = [events.tenant_filter("carol"), events.sandbox_filter("*"), events.tenant_filter(events.NO_TENANT),
                 violations.tenant_filter("carol"), security.tenant_actions_filter("carol"), "events.v2.>",
                 "events.v3.>",
                 ports.tenant_frames_filter("carol"), ports.tenant_frames_filter("*")]
    try:
        for subject in forbidden:
            await dave.subscribe(subject)
        await dave.flush()
        for _ in range(100):  # the -ERRs come before the flush's answer; their callbacks soon after
            if len(refusals) >= len(forbidden):
                break
            await asyncio.sleep(0.05)
        assert len(refusals) == len(forbidden)
        assert all("permissions violation for subscription" in r.lower() for r in refusals)
        async with sandfleet.connect(platform.url, creds=creds["carol"]) as carol:
            sb = await carol.create(memory_mb=64, host_view=True)
            await sb.destroy()
        await dave.flush()
        assert dave.stats["in_msgs"] == 0  # none of carol's events reached him
    finally:
        await dave.close()


async def test_a_tenants_view_is_live_only(platform, creds):
    async with sandfleet.connect(platform.url, creds=creds["carol"]) as carol:
        with pytest.raises(errors.Unsupported):
            await carol.events(replay=True).__anext__()
        with pytest.raises(errors.Unsupported):
            await carol.violations(replay=True).__anext__()
        with pytest.raises(errors.Unsupported):
            await carol.history()


async def test_a_tenants_gang_batch_follows_its_own_events(platform, creds):
    # create_many waits on `started`/`failed` events: a tenant's wait hears its own (before, its
    # subscription to every sandbox's was refused and the batch waited for the quiet timeout).
    async with sandfleet.connect(platform.url, creds=creds["dave"]) as dave:
        heard = []
        on_event = dave._on_batch_event
        dave._on_batch_event = lambda msg: (heard.append(msg.subject), on_event(msg))  # type: ignore[method-assign]
        boxes = await dave.create_many(3, memory_mb=64, host_view=True)
        try:
            assert len(boxes) == 3
            assert {events.sandbox_id_of(s) for s in heard if s.endswith(".started")} == {sb.id for sb in boxes}
            assert all(s.split(".")[3] == "dave" for s in heard)
        finally:
            for sb in boxes:
                await sb.destroy()


async def test_a_tenant_forwards_its_own_sandboxs_port_and_not_anothers(platform, creds):
    async with sandfleet.connect(platform.url, creds=creds["carol"]) as carol, \
            sandfleet.connect(platform.url, creds=creds["dave"]) as dave:
        async with serving(carol, "process") as sb, forward_when_listening(sb) as (host, port):
            assert await asyncio.to_thread(http_get, host, port, "/index.html") == (200, b"hello")
            status, _ = await asyncio.to_thread(http_get, host, port, "/missing")
            assert status == 404
            with pytest.raises(errors.NotFound):  # her sandbox, asked by him: no sandbox at all
                async with _handle(dave, sb).forward(PORT):
                    pass
            assert await asyncio.to_thread(http_get, host, port, "/index.html") == (200, b"hello")  # unharmed


def _handle(fleet, sb):
    """A handle on another's sandbox, as if its id and node had leaked (`fleet.sandbox` would refuse)."""
    return sandfleet.Sandbox(fleet, sb.id, sb.node)


async def test_a_tenant_sees_what_the_monitor_did_to_its_sandbox(platform, creds, fleet):
    await fleet.set_policy(task="tenant-kill", action="kill", thresholds={"network": 1})  # the operator's
    async with sandfleet.connect(platform.url, creds=creds["carol"]) as carol:
        watch = Watch(carol.violations(actions=True))
        await asyncio.sleep(0.5)
        sb = await carol.create(memory_mb=64, host_view=True, labels={"task": "tenant-kill"})
        try:
            with contextlib.suppress(errors.SandfleetError):  # killed under the command, maybe
                await sb.exec(["python3", "-c", CHEAT], timeout_s=20)
            await watch.until(lambda seen: any(isinstance(e, SecurityAction) for e in seen))
        finally:
            with contextlib.suppress(errors.SandfleetError):
                await sb.destroy()
        seen = await watch.stop()
    actions = [e for e in seen if isinstance(e, SecurityAction)]
    assert [(a.sandbox_id, a.action) for a in actions] == [(sb.id, "kill")]
    assert any(isinstance(e, Violation) and e.sandbox_id == sb.id for e in seen)

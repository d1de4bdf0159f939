"""Who may say what about a sandbox's life, on a real nats-server with the accounts and the node,
placement and tenant credentials `sandfleet up` and `tenant add` make (sandfleet/bus_accounts.py).

Lifecycle events v3 carry the sandbox's node (`events.v3.sandbox.<tenant>.<node>.<id>.<event>`):
node A publishing an event of node B's sandbox, or one under placement's reserved token, is
refused by the server and nothing of it reaches the stream; A's own sandboxes' events go through;
placement publishes under any node's token and its own. What the server cannot refuse (A saying
something about B's sandbox id under A's own name) the consumers do not believe: the SDK's event
streams of one sandbox, a gang batch's wait and placement's quota release each go by the node.
A tenant still hears its own sandboxes' events only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from sandfleet.buckets import ensure_state
from sandfleet.bus import Bus, encode
from sandfleet.bus_accounts import AuthDir, node_permissions
from sandfleet.client import Fleet
from sandfleet.credentials import CredentialsError, read_seed
from schemas import events, sandbox
from schemas.sandbox import Quota, State
from services.placement.quotas import CONSUMER, Quotas
from tests.conftest import NODE_ID
from tests.natsd import authed_nats_server, refused_publishes

pytestmark = pytest.mark.timeout(120)
A, B = f"{NODE_ID}-a", f"{NODE_ID}-b"
TENANTS = ("carol", "dave")


@pytest.fixture(scope="module")
def bus_url(tmp_path_factory) -> Iterator[tuple[str, AuthDir]]:
    data = tmp_path_factory.mktemp("events-auth")
    for name in TENANTS:  # made before the server's accounts are written, as `tenant add` would
        AuthDir.of(data).tenant(name)
    with authed_nats_server(data, [A, B]) as found:
        yield found


@pytest.fixture
async def buses(bus_url) -> AsyncIterator[dict[str, Bus]]:
    url, auth = bus_url
    found = {"placement": await Bus.connect(url, "placement", creds=auth.service("placement")),
             "admin": await Bus.connect(url, "admin", creds=auth.admin())}
    await ensure_state(found["placement"])
    for node_id in (A, B):
        found[node_id] = await Bus.connect(url, node_id, creds=auth.node(node_id))
    for name in TENANTS:
        found[name] = await Bus.connect(url, name, creds=auth.tenant(name))
    yield found
    for bus in found.values():
        await bus.close()


_n = iter(range(1, 1 << 30))


def _id() -> str:
    return f"sb-{next(_n):08x}{int(time.time() * 1000) % 0x10000:04x}"


def _event(kind: type[events.SandboxEvent], sandbox_id: str, node_id: str, tenant: str = "carol",
           state: State = State.RUNNING, seq: int = 3) -> events.SandboxEvent:
    return kind(sandbox_id=sandbox_id, node=node_id, tenant=tenant, state=state, seq=seq, at=time.time())


async def _stored(bus: Bus, subject: str) -> int:
    """How many messages of the events stream are on subjects matching `subject`."""
    info = await bus.js.stream_info(events.STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_a_node_publishes_only_its_own_sandboxes_lifecycle_events(bus_url, buses):
    url, auth = bus_url
    placement = buses["placement"]
    theirs, mine = _id(), _id()
    # under B's name, under placement's token
    forged = [_event(events.Started, theirs, B), _event(events.Failed, theirs, "", state=State.FAILED)]
    attempts = [(e.subject, encode(e)) for e in forged]
    attempts.append((f"events.v2.sandbox.carol.{theirs}.stopped", b"{}"))  # the old version's subject: no node at all
    before = (await placement.js.stream_info(events.STREAM)).state
    assert await refused_publishes(url, auth.node(A), attempts) == {s.lower() for s, _ in attempts}
    after = (await placement.js.stream_info(events.STREAM)).state
    assert (after.messages, after.last_seq) == (before.messages, before.last_seq)  # nothing of them stored
    assert await _stored(placement, events.sandbox_filter(theirs)) == 0

    # Its own sandbox's events go through (acked by the stream), and B's of its own, and placement's
    # under any node's name and its own token.
    own = _event(events.Started, mine, A)
    await buses[A].js.publish(own.subject, encode(own))
    for event in (_event(events.Started, theirs, B), _event(events.Stopped, theirs, B, state=State.STOPPED, seq=4)):
        await buses[B].js.publish(event.subject, encode(event))
    for event in (_event(events.Failed, _id(), "", state=State.FAILED), _event(events.Failed, mine, A, seq=4,
                                                                                state=State.FAILED)):
        await placement.js.publish(event.subject, encode(event))
    assert await _stored(placement, events.sandbox_filter(mine, node=A)) == 2
    assert await _stored(placement, events.sandbox_filter(theirs, node=B)) == 2
    assert await _stored(placement, events.sandbox_filter("*", node=events.PLACEMENT_NODE)) >= 1


@pytest.mark.parametrize("name", [events.PLACEMENT_NODE, sandbox.BATCH_KEY_NODE, "*", ">", "n.1", "-n", ""])
def test_no_node_gets_credentials_under_a_reserved_name_or_a_wildcard(tmp_path, name):
    """`_` is placement's token; a wildcard or separator would widen every permission built from the id."""
    with pytest.raises(CredentialsError):
        AuthDir.of(tmp_path).node(name)
    with pytest.raises(CredentialsError):
        node_permissions(name)


async def _first(stream: AsyncIterator[events.SandboxEvent], cause: Callable[[], Awaitable[None]]
                 ) -> events.SandboxEvent:
    """The first event `stream` yields while `cause()` publishes, again each time nothing came
    (the stream may not have been listening yet): what it yields first is what counts."""
    task = asyncio.ensure_future(stream.__anext__())
    try:
        while True:
            await cause()
            done, _ = await asyncio.wait([task], timeout=2)
            if done:
                return task.result()
    finally:
        if task.done():
            await stream.aclose()  # type: ignore[attr-defined]
        else:
            task.cancel()


async def test_a_sandboxs_events_are_its_nodes_word_only(bus_url, buses):
    """What the server lets through (A's own name on B's sandbox id; a body naming B on A's
    subject) never reaches a consumer of that sandbox: the tenant's live view, the platform's
    stream, the history."""
    url, auth = bus_url
    theirs = _id()
    forgeries = [_event(events.Failed, theirs, A, state=State.FAILED)]  # A's own name: the server carries it
    lying = _event(events.Failed, theirs, B, state=State.FAILED)  # B in the body, on A's subject
    genuine = _event(events.Started, theirs, B, seq=3)

    async def cause() -> None:
        for event in forgeries:
            await buses[A].js.publish(event.subject, encode(event))
        await buses[A].js.publish(forgeries[0].subject, encode(lying))
        await buses[B].js.publish(genuine.subject, encode(genuine))

    carol = Fleet(buses["carol"])
    assert await carol.tenant() == "carol"
    heard = await _first(carol.events(theirs, node=B), cause)
    assert (heard.node, heard.state, heard.seq) == (B, State.RUNNING, 3)

    platform = Fleet(buses["admin"])  # the operator's view: the stored stream
    assert {(e.node, e.state) for e in await platform.history(theirs, node=B)} == {(B, State.RUNNING)}
    # Without the node (no record, no placement to ask): every node's word, each under the node its
    # subject vouches for, and never the lie (B's name in A's message).
    told = {(e.node, e.state) for e in await platform.history(theirs)}
    assert told == {(A, State.FAILED), (B, State.RUNNING)}


async def test_a_tenant_still_hears_its_own_sandboxes_only(bus_url, buses):
    url, auth = bus_url
    carols, daves = _id(), _id()
    dave = Fleet(buses["dave"])
    seen: list[str] = []

    async def cause() -> None:
        for sandbox_id, tenant in ((carols, "carol"), (daves, "dave")):  # in this order, on one connection
            event = _event(events.Started, sandbox_id, B, tenant=tenant)
            await buses[B].js.publish(event.subject, encode(event))

    heard = await _first(dave.events(), cause)
    seen.append(heard.sandbox_id)
    assert seen == [daves]  # carol's came first and never reached dave
    refusals: list[str] = []

    async def error_cb(exc: Exception) -> None:
        refusals.append(str(exc))

    conn = await nats.connect(url, allow_reconnect=False, error_cb=error_cb,
                              nkeys_seed_str=read_seed(auth.tenant("dave")))
    try:
        for subject in (events.tenant_filter("carol"), events.node_filter(B), events.ALL_SANDBOX):
            await conn.subscribe(subject)
        await conn.flush()
        for _ in range(100):
            if len(refusals) >= 3:
                break
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    assert len(refusals) == 3 and all("permissions violation for subscription" in r.lower() for r in refusals)


async def _acked(bus: Bus, seq: int) -> None:
    """Until placement's quota consumer has acked the events stream up to `seq`."""
    while (await bus.js.consumer_info(events.STREAM, CONSUMER)).ack_floor.stream_seq < seq:
        await asyncio.sleep(0.05)


async def test_a_forged_end_gives_no_quota_slot_back(bus_url, buses):
    """Placement's quota release finds a sandbox's member key by the node its end event's subject
    names: node A's `stopped` of B's sandbox gives nothing back, B's does. An older placement's
    consumer (v2 subjects) is moved to v3 as placement starts."""
    placement = buses["placement"]
    old = ConsumerConfig(durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW,
                         filter_subjects=["events.v2.sandbox.*.*.stopped", "events.v2.sandbox.*.*.failed"])
    with contextlib.suppress(Exception):
        await placement.js.delete_consumer(events.STREAM, CONSUMER)
    await placement.js.add_consumer(events.STREAM, old)
    quotas = await Quotas.open(placement)
    task = f"forged-{_id()}"
    await quotas.set(Quota(scope="task", name=task, max_concurrent=1))
    spec = sandbox.SandboxSpec(labels={"task": task})
    keys = await quotas.admit(spec, 1, time.time())
    theirs = _id()
    await quotas.remember([(theirs, B)], keys)
    release = asyncio.create_task(quotas.release_ended())
    try:
        while (await placement.js.consumer_info(events.STREAM, CONSUMER)).config.filter_subjects != [
                events.sandbox_subject("*", "stopped"), events.sandbox_subject("*", "failed")]:
            await asyncio.sleep(0.05)
        forged = _event(events.Stopped, theirs, A, state=State.STOPPED)
        ack = await buses[A].js.publish(forged.subject, encode(forged))
        await _acked(placement, ack.seq)
        assert (await quotas.get(sandbox.QuotaGetRequest(scope="task", name=task))).active == 1  # still taken
        genuine = _event(events.Failed, theirs, B, state=State.FAILED)
        ack = await buses[B].js.publish(genuine.subject, encode(genuine))
        await _acked(placement, ack.seq)
        assert (await quotas.get(sandbox.QuotaGetRequest(scope="task", name=task))).active == 0  # given back
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await quotas.kv.get(f"m.{B}.{theirs}")  # its member key gone
    finally:
        release.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await release

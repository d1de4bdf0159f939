"""The bus lets each role do only its own work, on a real platform with real credentials.

Every forbidden action is tried and shown refused with nothing changed: another tenant's exec,
files, destroy and records; a tenant subscribing to events, publishing a launch, a violation, a
lifecycle event or a KV write; a node answering or asking another node's subjects; no
credentials at all; a request-info header forged by a tenant. And a tenant's own work succeeds.

A publish the server refuses is dropped and reported to the sender only (`-ERR`); to show one
never reached anyone, the operator watches its subject, and after the sender's round trip (the
server has handled the publish by then) a marker of the operator's own shows the watch got nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from pathlib import Path

import nats
import nats.errors
import pytest

import sandfleet
from sandfleet import errors
from sandfleet.bus import Bus
from sandfleet.bus_accounts import public_key
from sandfleet.credentials import connect_options, read_seed
from schemas import events, node, sandbox, violations
from tests.conftest import CLI, NODE_ID, ROOT, assert_nothing_left
from tests.leaks import Snapshot

pytestmark = pytest.mark.timeout(300)


def _issue(platform, *args: str, tmp: Path) -> Path:
    out = tmp / f"{'-'.join(args)}.creds"
    done = platform.cli("tenant", *args, "--data-dir", str(platform.data_dir), "--out", str(out))
    assert "BEGIN USER NKEY SEED" in done.stdout.decode()
    assert out.stat().st_mode & 0o077 == 0  # nobody else reads it
    return out


@pytest.fixture(scope="module")
def tenants(platform, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("creds")
    return {name: _issue(platform, "add", name, tmp=tmp) for name in ("alice", "bob")}


@pytest.fixture(scope="module")
def other_node_creds(platform, tmp_path_factory):
    return _issue(platform, "node-creds", f"{platform.node_id}-other", tmp=tmp_path_factory.mktemp("node"))


async def _raw(url: str, creds: Path | None, refusals: list[str] | None = None) -> nats.NATS:
    """A plain nats-py connection with these credentials; `refusals` collects the server's -ERRs."""
    async def error_cb(exc: Exception) -> None:
        if refusals is not None:
            refusals.append(str(exc))

    options = {"nkeys_seed_str": read_seed(creds)} if creds else {}
    return await nats.connect(url, allow_reconnect=False, error_cb=error_cb, **options)


async def _admin(url: str) -> nats.NATS:
    return await nats.connect(url, **connect_options(url))  # the operator's, found by the URL


async def _never_arrives(admin: nats.NATS, forbidden, subject: str) -> None:
    """`forbidden()` publishes to `subject` and returns once its connection has round-tripped
    (the server has handled the publish by then). The operator subscribes to `subject` first and
    after it sends itself a marker on an inbox of its own (nothing is ever published to
    `subject` but the forbidden message: it may be a KV key or a JetStream API subject): the
    connection reads in order, so once the marker is in, the forbidden message would be too."""
    watch = await admin.subscribe(subject)
    inbox = admin.new_inbox()
    marker = await admin.subscribe(inbox)
    await admin.flush()
    await forbidden()
    await admin.publish(inbox, b"marker")
    await marker.next_msg(timeout=10)
    assert watch.pending_msgs == 0, f"a forbidden publish to {subject} got through"
    await watch.unsubscribe()
    await marker.unsubscribe()


@pytest.fixture
async def alice(platform, tenants):
    async with sandfleet.connect(platform.url, creds=tenants["alice"]) as fleet:
        yield fleet


@pytest.fixture
async def bob(platform, tenants):
    async with sandfleet.connect(platform.url, creds=tenants["bob"]) as fleet:
        yield fleet


async def test_a_tenant_does_its_own_work(alice, fleet):
    sb = await alice.create(memory_mb=64, host_view=True, labels={"tenant": "bob"})  # a label cannot make it bob's
    try:
        ran = await sb.exec(["sh", "-c", "echo hello; id -u"])
        assert ran.exit_code == 0 and ran.stdout.startswith(b"hello\n")
        await sb.write_file("/tmp/mine", b"alice's")
        assert await sb.read_file("/tmp/mine") == b"alice's"
        record = await alice.get(sb.id)
        assert record.tenant == "alice" and record.state is sandbox.State.RUNNING  # recorded from her account
        assert record.spec.labels["tenant"] == "alice"  # what a quota by tenant counts
        assert [r.id for r in await alice.list()] == [sb.id]  # only hers, though others run
        assert (await fleet.get(sb.id)).tenant == "alice"  # the operator sees every one
    finally:
        await sb.destroy()
    with pytest.raises(errors.NotFound):  # destroyed by her: its record is gone
        await fleet.get(sb.id)


async def test_another_tenants_sandbox_is_out_of_reach_and_unchanged(alice, bob, fleet):
    sb = await alice.create(memory_mb=64, host_view=True)
    try:
        await sb.write_file("/tmp/secret", b"alice's only")
        theirs = sandfleet.Sandbox(bob, sb.id, sb.node)  # bob knows the id and the node
        with pytest.raises(errors.NotFound):
            await theirs.exec(["sh", "-c", "echo pwned > /tmp/secret"])
        with pytest.raises(errors.NotFound):
            await theirs.read_file("/tmp/secret")
        with pytest.raises(errors.NotFound):
            await theirs.write_file("/tmp/secret", b"bob was here")
        with pytest.raises(errors.NotFound):
            await theirs.destroy()
        with pytest.raises(errors.NotFound):
            await bob.get(sb.id)
        assert sb.id not in [r.id for r in await bob.list()]
        # Nothing changed: still running, the file still hers, and she still reaches it.
        assert (await fleet.get(sb.id)).state is sandbox.State.RUNNING
        assert await sb.read_file("/tmp/secret") == b"alice's only"
        assert (await sb.exec(["true"])).exit_code == 0
    finally:
        await sb.destroy()


async def test_the_operators_sandboxes_are_no_tenants(bob, fleet):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        with pytest.raises(errors.NotFound):
            await sandfleet.Sandbox(bob, sb.id, sb.node).exec(["true"])
        assert (await sb.exec(["true"])).exit_code == 0
    finally:
        await sb.destroy()


async def test_a_forged_request_info_header_is_replaced_by_the_server(platform, tenants, alice):
    sb = await alice.create(memory_mb=64, host_view=True)
    try:
        conn = await _raw(platform.url, tenants["bob"])
        try:
            forged = json.dumps({"acc": "tenant-alice", "user": "alice"})
            request = json.dumps({"sandbox_id": sb.id, "argv": ["true"]}).encode()
            reply = await conn.request(node.subject(sb.node, node.EXEC), request, timeout=10,
                                       headers={"Nats-Request-Info": forged})
            assert json.loads(reply.data)["code"] == "not_found"
        finally:
            await conn.close()
    finally:
        await sb.destroy()


async def test_no_credentials_no_bus(platform):
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(platform.url, allow_reconnect=False, max_reconnect_attempts=0)
    bad = Path(platform.data_dir) / "none.creds"
    with pytest.raises(errors.NoResponders, match="refused"):  # a key the bus does not know
        bad.write_text("SUAGMJH5XLGZKQQWAWKRZJIGMOU4HPFUYLXJMXOO5NLFEO2OOQJ5LPRDPM\n")
        await sandfleet.connect(platform.url, creds=bad)


async def test_a_tenant_cannot_launch_or_forge_events_or_records(platform, tenants, alice, fleet):
    sb = await alice.create(memory_mb=64, host_view=True)
    admin = await _admin(platform.url)
    refusals: list[str] = []
    conn = await _raw(platform.url, tenants["alice"], refusals)
    try:
        record_before = await fleet.get(sb.id)
        forged = {
            node.subject(sb.node, node.LAUNCH): json.dumps({"sandboxes": [{"id": "forged-launch", "spec": {}}]}),
            violations.subject(sb.node, sb.id, "network.connect"): json.dumps({"type": "violation"}),
            events.sandbox_subject(sb.id, "stopped", "alice", sb.node): json.dumps({"type": "stopped",
                                                                                    "sandbox_id": sb.id}),
            violations.tenant_subject("alice", sb.node, sb.id, "network.connect"): json.dumps({"type": "violation"}),
            f"$KV.{sandbox.KV_BUCKET}.{sandbox.record_key(sb.node, sb.id)}": json.dumps({"id": sb.id, "tenant": "bob"}),
            f"$JS.API.STREAM.PURGE.KV_{sandbox.KV_BUCKET}": "{}",
            node.subject(sb.node, node.QUARANTINE): json.dumps({"sandbox_id": sb.id}),
        }
        for subject, body in forged.items():
            async def forbidden(subject=subject, body=body) -> None:
                await conn.publish(subject, body.encode(), reply=conn.new_inbox())
                await conn.flush()
            await _never_arrives(admin, forbidden, subject)
        # Each refused by the server, but the JetStream API: a tenant's `$JS.API` is its own
        # account's, which has no JetStream (the purge reached no stream: the record is there below).
        refused = {r.split('"')[1].lower() for r in refusals if "permissions violation" in r.lower()}
        assert refused == {s.lower() for s in forged if not s.startswith("$JS.API.")}
        # Nothing changed: no such launch, her record as it was, her sandbox still running.
        with pytest.raises(errors.NotFound):
            await fleet.get("forged-launch")
        after = await fleet.get(sb.id)
        assert (after.state, after.tenant, after.seq) == (sandbox.State.RUNNING, "alice", record_before.seq)
        assert (await sb.exec(["true"])).exit_code == 0
    finally:
        await conn.close()
        await admin.close()
        await sb.destroy()


async def test_a_tenant_cannot_subscribe_to_events_or_others_replies(platform, tenants, alice):
    refusals: list[str] = []
    conn = await _raw(platform.url, tenants["bob"], refusals)
    try:
        for subject in (events.ALL, events.sandbox_filter("*"), violations.ALL, node.subject("*", node.EXEC), ">"):
            await conn.subscribe(subject)
        await conn.flush()
        for _ in range(100):  # the server's -ERRs come before its answer to the flush; their callbacks, soon after
            if len(refusals) >= 5:
                break
            await asyncio.sleep(0.05)
        assert len(refusals) == 5 and all("permissions violation for subscription" in r.lower() for r in refusals)
        # Nothing reaches those subscriptions: a lifecycle event of alice's goes by unseen.
        sb = await alice.create(memory_mb=64, host_view=True)
        await sb.destroy()
        assert conn.stats["in_msgs"] == 0
    finally:
        await conn.close()


async def test_a_node_answers_and_asks_only_its_own_subjects(platform, other_node_creds, fleet):
    refusals: list[str] = []
    impostor = await _raw(platform.url, other_node_creds, refusals)
    admin = await _admin(platform.url)
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        theirs = node.subject(platform.node_id, node.EXEC)
        async def answer(msg) -> None:
            await msg.respond(b'{"exit_code": 0, "stdout": "ZmFrZQ=="}')

        await impostor.subscribe(theirs, cb=answer)
        await impostor.flush()

        async def ask_theirs() -> None:  # and asking the other node's launcher to launch or destroy
            for verb in (node.LAUNCH, node.DESTROY):
                await impostor.publish(node.subject(platform.node_id, verb), json.dumps({"sandbox_id": sb.id}).encode())
            await impostor.flush()

        await _never_arrives(admin, ask_theirs, node.subject(platform.node_id, node.DESTROY))
        # Every exec is answered by the real node, never by the impostor.
        for _ in range(20):
            ran = await sb.exec(["echo", "real"])
            assert ran.stdout == b"real\n"
        assert any("subscription" in r.lower() for r in refusals) and any("publish" in r.lower() for r in refusals)
        # Its own subjects it may serve (so a real node with these credentials works).
        own = node.subject(f"{platform.node_id}-other", node.EXEC)
        async def mine(msg) -> None:
            await msg.respond(b"mine")

        await impostor.subscribe(own, cb=mine)
        await impostor.flush()
        for _ in range(50):  # the subscription's interest reaches the admin's account a moment later
            try:
                answer = await admin.request(own, b"", timeout=10)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.1)
        assert answer.data == b"mine"
        assert (await fleet.get(sb.id)).state is sandbox.State.RUNNING
    finally:
        await sb.destroy()
        await impostor.close()
        await admin.close()


async def test_a_node_cannot_speak_for_another_nodes_sandbox(platform, tenants, alice, fleet, other_node_creds):
    """Lifecycle events v3: another node's `failed` of alice's sandbox is refused under the
    sandbox's node's name and under placement's token; under its own name (which the server
    cannot refuse) it is stored but believed by no view of that sandbox: alice's live events and
    the operator's history follow the sandbox's own node, to the end of its trail."""
    sb = await alice.create(memory_mb=64, host_view=True)
    impostor_id = f"{platform.node_id}-other"
    refusals: list[str] = []
    impostor = await _raw(platform.url, other_node_creds, refusals)
    as_node = await Bus.connect(platform.url, impostor_id, creds=other_node_creds)
    admin = await _admin(platform.url)
    body = json.dumps({"type": "sandbox.failed", "sandbox_id": sb.id, "node": impostor_id, "tenant": "alice",
                       "state": "failed", "seq": 99, "at": 1.0, "reason": "launch_failed"}).encode()

    async def stored() -> set[str]:  # the node tokens of this sandbox's stored events
        info = await fleet.bus.js.stream_info(events.STREAM, subjects_filter=events.sandbox_filter(sb.id))
        return {events.node_of(subject) for subject in info.state.subjects or {}}

    stream = alice.events(sb.id)  # its node's word only (the node found from its record)
    first = asyncio.ensure_future(stream.__anext__())
    try:
        for token in (sb.node, events.PLACEMENT_NODE):
            subject = events.sandbox_subject(sb.id, "failed", "alice", token)

            async def forbidden(subject=subject) -> None:
                await impostor.publish(subject, body, reply=impostor.new_inbox())
                await impostor.flush()
            await _never_arrives(admin, forbidden, subject)
        assert sum("permissions violation for publish" in r.lower() for r in refusals) == 2
        assert await stored() == {sb.node}  # nothing of either reached the stream
        await as_node.js.publish(events.sandbox_subject(sb.id, "failed", "alice", impostor_id), body)  # acked
        assert await stored() == {sb.node, impostor_id}
        assert all(e.node == sb.node and e.seq != 99 for e in await fleet.history(sb.id))
        assert (await fleet.get(sb.id)).state is sandbox.State.RUNNING
        await sb.destroy()
        heard = [await asyncio.wait_for(first, 30)]
        while heard[-1].state is not sandbox.State.STOPPED:
            heard.append(await asyncio.wait_for(stream.__anext__(), 30))
        assert {(e.node, e.seq == 99) for e in heard} == {(sb.node, False)}
    finally:
        if first.done():
            await stream.aclose()
        else:
            first.cancel()
        await impostor.close()
        await as_node.close()
        await admin.close()
        with contextlib.suppress(errors.SandfleetError):  # destroyed above, unless a check failed first
            await sb.destroy()


async def test_a_node_joins_with_its_own_credentials_only(platform, fleet, tmp_path):
    """`sandfleet node --creds FILE`, with no operator's credentials to find (as on another
    machine): every service of the node works with the node's own permissions."""
    joined = f"{NODE_ID}-j"
    creds = _issue(platform, "node-creds", joined, tmp=tmp_path)
    env = {**platform.env, "SANDFLEET_LOCAL_CREDS_DIR": str(tmp_path / "no-notes")}  # nothing to fall back on
    before = Snapshot.take()
    data = tmp_path / "node"
    out = subprocess.run([*CLI, "node", "--detach", "--nats", platform.url, "--node-id", joined, "--data-dir",
                          str(data), "--egress-subnet", "10.231.240.0/20", "--creds", str(creds)],
                         env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    try:
        placed = await fleet.bus.request(sandbox.CREATE, sandbox.CreateRequest(memory_mb=64, host_view=True,
                                                                               node=joined),
                                         sandbox.CreateReply, timeout=60)
        sb = sandfleet.Sandbox(fleet, placed.id, placed.node)
        assert (await sb.exec(["echo", "joined"])).stdout == b"joined\n"
        await sb.write_file("/tmp/f", b"x")
        assert await sb.read_file("/tmp/f") == b"x"
        await sb.destroy()
    finally:
        state = json.loads((data / "supervisor.json").read_text())
        subprocess.run([*CLI, "down", "--data-dir", str(data)], env=env, timeout=150, check=True, cwd=ROOT)
        try:
            os.waitpid(state["pid"], 0)
        except ChildProcessError:
            pass
    key = public_key(read_seed(creds))
    violations_seen = [line for log in (platform.data_dir / "logs").glob("nats*.log")
                       for line in log.read_text().splitlines() if "Violation" in line and key in line]
    assert not violations_seen  # none of its services was refused anything it needs
    assert_nothing_left(before, data, [joined])


def test_the_accounts_are_a_valid_server_config_and_keep_their_keys(tmp_path):
    """What `up` and `tenant add` write is a config nats-server accepts; keys are made once and
    kept (a restarted platform, and every node holding a copy, keep theirs), files root-only."""
    from sandfleet.bus_accounts import AuthDir, node_permissions, write_accounts
    from sandfleet.supervisor import nats_server_binary, write_nats_config

    auth = AuthDir.of(tmp_path)
    first = auth.admin().read_text()
    auth.service("placement"), auth.node("n1"), auth.tenant("team-a")
    write_accounts(tmp_path, auth)
    conf = write_nats_config(tmp_path, 4222, auth=auth)
    checked = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert AuthDir.of(tmp_path).admin().read_text() == first
    assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / "auth").rglob("*.creds"))
    assert (tmp_path / "accounts.conf").stat().st_mode & 0o077 == 0
    accounts = auth.accounts()
    assert set(accounts) == {"PLATFORM", "tenant-team-a"} and "jetstream" not in accounts["tenant-team-a"]
    # A node's subjects are its own: nothing of another node's, and only its own heartbeat key.
    perms = node_permissions("n1")
    assert not [s for s in perms.publish + perms.subscribe if s.startswith("node.v1.") and ".n1." not in s]
    assert "$KV.nodes.n1" in perms.publish and not [s for s in perms.publish if s.startswith("$KV.nodes.") and
                                                    s != "$KV.nodes.n1"]
    with pytest.raises(ValueError):
        auth.tenant("Not A Name")


async def test_what_the_bus_will_not_carry_for_a_tenant_is_forbidden(alice, fleet):
    # The platform's own work asked with a tenant's credentials: the server refuses the publish
    # (its -ERR), and the SDK says Forbidden, not that nobody answered in time.
    with pytest.raises(errors.Forbidden, match="quota"):
        await alice.set_quota(tenant="alice", max_concurrent=1000)
    with pytest.raises(errors.Forbidden):
        await alice.set_policy(task="anything", action="kill")
    sb = await alice.create(memory_mb=64, host_view=True)
    try:
        with pytest.raises(errors.Forbidden):  # a node's by-label verb reaches every sandbox of it
            await alice.bus.request(node.subject(sb.node, node.PAUSE_SELECTED), {"labels": {}}, node.Empty, timeout=1)
        assert (await fleet.get(sb.id)).state is sandbox.State.RUNNING
    finally:
        await sb.destroy()


async def test_a_refused_request_is_forbidden_as_soon_as_the_server_says_so(alice):
    """The server's -ERR comes at once; the request would wait out its own timeout. Asked with a
    timeout of 120 s, the refusal must arrive well inside 60 (a broken cut-short would time out
    here, not at 120), and the connection goes on serving what it may ask."""
    asked = alice.bus.request(node.subject("any-node", node.PAUSE_SELECTED), {"labels": {}}, node.Empty, timeout=120)
    with pytest.raises(errors.Forbidden, match="pause"):
        await asyncio.wait_for(asked, 60)
    assert await alice.list() is not None  # its own requests still answered
    tasks = [alice.bus.request(node.subject("any-node", node.RESUME_SELECTED), {"labels": {}}, node.Empty,
                               timeout=120) for _ in range(5)]  # several waiting at once: each told
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    assert all(isinstance(r, errors.Forbidden) for r in results), results

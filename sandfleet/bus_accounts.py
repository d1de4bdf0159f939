"""Who may do what on the bus: the accounts, nkey users and per-subject permissions that
`sandfleet up` writes into nats-server's config, and the credentials files they come with.

Static accounts in the server's config, each user an nkey (not JWTs with a resolver): the one
who runs the servers writes every account, import and permission in one file the servers
reload on SIGHUP; no signing chain, no resolver to run or push to, and nothing outside NATS
itself. The cost: adding a tenant rewrites the config and reloads each server (`sandfleet
tenant add`), which a platform of a few teams does rarely.

- Account `PLATFORM` (JetStream on): the operator (`admin`: everything), each cluster service
  (only what it serves and calls), each node (its own `node.v1.<id>.>`, its heartbeat key, its
  own event subjects). Permissions are allow lists; JetStream is reached per stream.
- Account `tenant-<name>` per tenant: no JetStream, nothing of its own but its inbox; it imports
  the platform's sandbox requests with `share: true`, so every request it makes reaches the
  platform carrying the server's `Nats-Request-Info` (its account), which placement records as
  the sandbox's tenant and the node checks on every request about a sandbox. It also imports,
  as streams, the events of its own sandboxes only (lifecycle events, and the security monitor's
  copies of their violations and actions: subjects that carry the tenant), each exported by the
  platform to that one account, so subscribing to another tenant's is refused by the server.
"""


from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nkeys

from sandfleet import jetstream
from sandfleet.credentials import (TENANT_ACCOUNT_PREFIX, USER_INFO, CredentialsError, api_key_digest,
                                   check_tenant_name, creds_text, inbox_prefix, read_seed, write_private)
from schemas import (desktop, events, files, health, layers, node, pools, ports, process, pty, reclaim, sandbox,
                     security, violations)

ACCOUNTS_CONF = "accounts.conf"  # in the data dir, beside the servers' configs, which include it
PLATFORM = "PLATFORM"
ADMIN = "admin"
# Cluster services that connect with a user of their own (node services use their node's).
SERVICE_USERS = ("placement", "security-monitor", "gateway", "fusion")
INBOX = "_INBOX.>"
MICRO = "$SRV.>"  # nats.micro's PING/INFO/STATS: every service answers them

# What a tenant may ask of a node about a sandbox, each checked against the sandbox's tenant by
# the launcher. Not here: launch, quarantine, the by-label rollout verbs (they reach every
# sandbox of a node), the agent's and layer-cache's verbs.
TENANT_NODE_VERBS = (
    ports.PORT_OPEN,
    node.EXEC, node.WRITE_FILE, node.READ_FILE, node.DESTROY, node.PAUSE, node.RESUME, node.HINT, node.CHECKPOINT,
    health.SET_TIMEOUT, health.METRICS,
    process.SPAWN, process.READ, process.WRITE, process.SIGNAL, process.WAIT, process.LIST,
    pty.PTY_SPAWN, pty.PTY_RESIZE,
    files.UPLOAD, files.UPLOAD_CHUNK, files.UPLOAD_END, files.DOWNLOAD, files.DOWNLOAD_CHUNK, files.CLOSE,
    files.LIST, files.STAT, files.MKDIR, files.REMOVE, files.RENAME, files.WATCH, files.WATCH_NEXT,
    files.WATCH_CLOSE,
    desktop.SCREEN_INFO, desktop.SCREENSHOT, desktop.MOUSE, desktop.KEYS_PRESS, desktop.TYPE_TEXT,
)
# Placement answers these for a tenant with its own sandboxes only.
TENANT_SANDBOX_SUBJECTS = (sandbox.CREATE, sandbox.CREATE_MANY, sandbox.GET, sandbox.LIST)
LAYER_BUCKETS = (layers.KV_BUCKET, layers.DIFF_BUCKET)  # KV buckets of the layer store (the catalogue, diff ids)


# Names no node may have: its records' keys would be placement's batch records (`batch.<token>`),
# its lifecycle events placement's own (`events.PLACEMENT_NODE`, also no valid NodeId).
RESERVED_NODE_IDS = (sandbox.BATCH_KEY_NODE, events.PLACEMENT_NODE)


def check_node_id(node_id: str) -> str:
    """`node_id` if a node may be called so: a `NodeId` (a letter or digit first, then letters,
    digits, `_`, `-`: never a subject wildcard or separator, which would widen every permission
    built from it) and none of the reserved names. CredentialsError otherwise."""
    try:
        msgspec.convert(node_id, sandbox.NodeId)
    except msgspec.ValidationError:
        raise CredentialsError(f"{node_id!r}: a node id is a letter or digit, then letters, digits, '_' and '-' "
                               "(at most 64)") from None
    if node_id in RESERVED_NODE_IDS:
        raise CredentialsError(f"no node may be called {node_id!r}: the name is the platform's own")
    return node_id


def tenant_subjects() -> list[str]:
    """What a tenant's account imports as services: requests, and its tunnels' frames to nodes
    (a tunnel id is a secret told only to the tenant whose port_open the launcher checked)."""
    return [*TENANT_SANDBOX_SUBJECTS, *(node.subject("*", verb) for verb in TENANT_NODE_VERBS),
            ports.tunnel_subject("*", "*")]


def tenant_stream_subjects(name: str) -> list[str]:
    """What the platform sends to one tenant alone, exported to its account only: its sandboxes'
    events (lifecycle, the monitor's copies of violations and actions) and its tunnels' frames."""
    return [events.tenant_filter(name), violations.tenant_filter(name), security.tenant_actions_filter(name),
            ports.tenant_frames_filter(name)]


@dataclass
class Permissions:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)

    def add(self, other: Permissions) -> Permissions:
        return Permissions(self.publish + other.publish, self.subscribe + other.subscribe)

    def as_config(self) -> dict:
        # allow_responses: a responder may answer whatever reply subject a request named
        # (an inbox, or the `_R_` subject of a request from a tenant's account).
        return {"publish": {"allow": sorted(set(self.publish))}, "subscribe": {"allow": sorted(set(self.subscribe))},
                "allow_responses": True}


def kv(bucket: str, *, write: bool = False, keys: str = ">") -> Permissions:
    """A KV bucket: reads (and watches) of every key; with `write`, puts of `keys`."""
    return Permissions([*jetstream.stream_api_subjects(jetstream.kv_stream(bucket), write=write),
                        *([jetstream.kv_subject(bucket, keys)] if write else [])])


def objects(bucket: str, *, write: bool = False) -> Permissions:
    return Permissions([*jetstream.stream_api_subjects(jetstream.object_stream(bucket), write=write),
                        *(jetstream.object_write_subjects(bucket) if write else [])])


def event_stream(*subjects: str) -> Permissions:
    """The EVENTS stream (read, consumed, and created by whichever service starts first) and
    publishes to `subjects` of it."""
    return Permissions([*jetstream.stream_api_subjects(events.STREAM, write=True), *subjects])


def _common() -> Permissions:
    # USER_INFO: the server tells a user its own account (the SDK asks, to know whose events it sees)
    return Permissions([USER_INFO], [MICRO])  # and its own inboxes (`accounts`: they are named after its key)


def _state() -> Permissions:
    """What `ensure_state` touches at every service's start: the sandbox records, the events, and
    the layer catalogue's buckets (made, or switched to refuse rollups, by whichever service starts).
    No lifecycle event: placement publishes them (every one), nodes their own sandboxes'."""
    layer_buckets = [s for b in LAYER_BUCKETS for s in jetstream.stream_api_subjects(jetstream.kv_stream(b), write=True)]
    return kv(sandbox.KV_BUCKET, write=True).add(event_stream()).add(
        Permissions([jetstream.stream_create_subject(jetstream.kv_stream(node.KV_BUCKET)),  # nodes write their own
                     *layer_buckets]))


def _node_reads(stream: str) -> list[str]:
    """A stream a node reads, and consumes as nats-py does by itself: ephemeral consumers the
    server names (each KV watch, each ordered consumer of an object's chunks), their info, flow
    control. Not another user's consumers: no delete, pause, pull (`MSG.NEXT`: placement's quota
    consumer and the security monitor's durable on EVENTS hand each message to one puller), no
    ack, no named or durable consumer (a name sent in the body of the unnamed create is refused
    by the server). Nothing a node runs deletes a consumer: its ephemerals go when their
    subscription does (inactive threshold)."""
    return jetstream.stream_reader_subjects(stream)


def _node_kv(bucket: str, keys: str | None = None) -> Permissions:
    """A bucket as a node has it: read; with `keys`, its stream created (never updated: its limits
    could drop every key) and those keys put."""
    stream = jetstream.kv_stream(bucket)
    writes = [jetstream.stream_create_subject(stream), jetstream.kv_subject(bucket, keys)] if keys else []
    return Permissions([*_node_reads(stream), *writes])


def _node_objects(bucket: str) -> Permissions:
    """An object store a node builds into: created, never updated; objects put and removed (the
    filtered purges nats-py's put and delete make, which the server cannot tell from a whole one)."""
    stream = jetstream.object_stream(bucket)
    return Permissions([*_node_reads(stream), jetstream.stream_create_subject(stream),
                        *jetstream.object_write_subjects(bucket)])


def _node_state(node_id: str) -> Permissions:
    """`_state` for a node: the sandbox records read, but written only under the node's own name
    (`<node>.<id>`: never another node's, nor placement's batch records); the events stream
    published to (lifecycle events of its own sandboxes only: `events.v3.sandbox.*.<node>.>`) but
    never updated, purged or deleted (it is the audit trail); each bucket created
    but never updated (a node could otherwise change its limits and so drop every record)."""
    return _node_kv(sandbox.KV_BUCKET, sandbox.record_key(node_id, ">")).add(Permissions([
        jetstream.stream_create_subject(jetstream.kv_stream(node.KV_BUCKET)), *_node_reads(events.STREAM),
        jetstream.stream_create_subject(events.STREAM), events.node_filter(node_id)]))


def service_permissions(name: str) -> Permissions:
    """One cluster service: what it serves (subscribe) and what it calls and writes (publish)."""
    base = _common().add(_state())
    if name == "placement":
        return base.add(Permissions(
            # every lifecycle event: of sandboxes on any node (one whose node is lost, a launch
            # unanswered) and under `events.PLACEMENT_NODE`, the one publisher of that token
            [node.subject("*", node.LAUNCH), node.subject("*", node.DESTROY), node.subject("*", pools.CLAIM),
             events.ALL_SANDBOX],
            [sandbox.ALL]
        )).add(kv(node.KV_BUCKET)).add(kv(node.BOOKINGS_BUCKET, write=True)).add(kv(sandbox.QUOTA_BUCKET, write=True)).add(
            kv(pools.KV_BUCKET, write=True))
    if name == "security-monitor":
        return base.add(Permissions(
            [node.subject("*", node.DESTROY), node.subject("*", node.QUARANTINE), security.ALL_ACTIONS,
             violations.tenant_filter("*"), security.tenant_actions_filter("*")],  # tenants' copies
            [security.ALL],
        )).add(kv(security.POLICY_BUCKET, write=True)).add(kv(security.SANDBOX_BUCKET, write=True))
    if name in ("gateway", "fusion"):  # front doors: a platform client of every node's sandbox verbs
        verbs = [node.subject("*", verb) for verb in (*TENANT_NODE_VERBS, node.PAUSE_SELECTED, node.RESUME_SELECTED)
                 ] + [ports.tunnel_subject("*", "*")]
        return base.add(Permissions([*TENANT_SANDBOX_SUBJECTS, *verbs, layers.ALL, MICRO], [])).add(
            kv(node.KV_BUCKET)).add(kv(layers.KV_BUCKET)).add(objects(layers.UPLOAD_BUCKET, write=True))
    raise ValueError(f"no such service user: {name}")


def node_permissions(node_id: str) -> Permissions:
    """Every service of one node (agent, layer-cache, reclaimer, launcher): its own subjects
    only, its own heartbeat key, events and violations under its own id (lifecycle events of its
    own sandboxes: `events.v3.sandbox.*.<id>.>`), the layer store it builds into and reads from."""
    check_node_id(node_id)
    own = node.subject(node_id, ">")
    return _common().add(_node_state(node_id)).add(Permissions(
        # INBOX: a port tunnel's frames go to the inbox its client named (a tenant's: under its
        # prefix, schemas/ports.py); MICRO: `sandfleet node --detach` waits until every service answers a ping
        [own, INBOX, ports.tenant_frames_filter("*"), MICRO, violations.subject(node_id, "*", "*"),
         layers.fetch_failed_subject(node_id),
         reclaim.node_filter(node_id), layers.ALL],
        [own, layers.ALL],
    )).add(_node_kv(node.KV_BUCKET, node_id)).add(_node_kv(node.BOOKINGS_BUCKET)).add(_node_kv(pools.KV_BUCKET)).add(
        # any name of the catalogue: nodes build and publish layers for every node (README, Security model)
        _node_kv(layers.KV_BUCKET, ">")).add(_node_kv(layers.DIFF_BUCKET, ">")).add(
        _node_objects(layers.OBJECT_BUCKET)).add(_node_objects(layers.UPLOAD_BUCKET))


def _inboxes(public: str) -> Permissions:
    return Permissions([], [f"{inbox_prefix(public)}.>"])


def _tenant_user(name: str, public: str) -> dict:
    # `$JS.API.>` of its own account, which has no JetStream: the SDK's stream lookups get "no
    # responders" at once instead of a refused publish left to time out. Nothing of the platform's.
    publish = [*tenant_subjects(), jetstream.JS_API_ALL, USER_INFO]
    return {"nkey": public, "permissions": {"publish": {"allow": publish},
                                            "subscribe": {"allow": [INBOX, *tenant_stream_subjects(name)]}}}


# -- the credentials directory -----------------------------------------------------------


def new_seed() -> str:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def public_key(seed: str) -> str:
    return nkeys.from_seed(bytearray(seed.encode())).public_key.decode()


@dataclass(frozen=True)
class AuthDir:
    """`<data dir>/auth/`, root-only: one credentials file per user, made on first need and
    kept, so a restarted platform (and every node holding a copy) keeps its keys."""

    root: Path

    @classmethod
    def of(cls, data_dir: Path) -> AuthDir:
        return cls(data_dir / "auth")

    def platform(self, node_ids: list[str]) -> None:
        """Everyone `sandfleet up` starts: the operator, each cluster service, each of its nodes."""
        self.admin()
        for name in SERVICE_USERS:
            self.service(name)
        for node_id in node_ids:
            self.node(node_id)

    def admin(self) -> Path:
        return self._ensure(self.root / "admin.creds", "the operator (admin: everything)")

    def service(self, name: str) -> Path:
        return self._ensure(self.root / "services" / f"{name}.creds", f"service {name}")

    def node(self, node_id: str) -> Path:
        check_node_id(node_id)
        return self._ensure(self.root / "nodes" / f"{node_id}.creds", f"node {node_id}")

    def tenant(self, name: str) -> Path:
        check_tenant_name(name)
        return self._ensure(self.root / "tenants" / f"{name}.creds", f"tenant {name}")

    def tenant_creds(self, name: str) -> Path | None:
        """A tenant's credentials file if `tenant add` made one (never made here)."""
        path = self.root / "tenants" / f"{name}.creds"
        return path if path.exists() else None

    # E2B API keys (`tenant add NAME --e2b-key`): the gateway answers a key with its tenant's own
    # bus credentials. Only each key's digest is kept, so the file names no usable key.
    @property
    def e2b_keys_file(self) -> Path:
        return self.root / "e2b-keys.json"

    def e2b_keys(self) -> dict[str, str]:
        """Key digest → tenant name."""
        try:
            table = json.loads(self.e2b_keys_file.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in table.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(
            table, dict) else {}

    def add_e2b_key(self, name: str, key: str) -> None:
        check_tenant_name(name)
        table = self.e2b_keys()
        digest = api_key_digest(key)
        if table.get(digest, name) != name:
            raise CredentialsError("that E2B API key is another tenant's")
        write_private(self.e2b_keys_file, json.dumps({**table, digest: name}, indent=1, sort_keys=True))

    def _ensure(self, path: Path, what: str) -> Path:
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, creds_text(new_seed(), what))
        return path

    def _users(self, kind: str) -> dict[str, str]:
        return {p.stem: public_key(read_seed(p)) for p in sorted((self.root / kind).glob("*.creds"))}

    def accounts(self) -> dict:
        """The server's `accounts` block for every user this directory holds."""
        users = [{"nkey": public_key(read_seed(self.admin()))}]
        users += [{"nkey": key, "permissions": service_permissions(name).add(_inboxes(key)).as_config()}
                  for name, key in self._users("services").items()]
        users += [{"nkey": key, "permissions": node_permissions(name).add(_inboxes(key)).as_config()}
                  for name, key in self._users("nodes").items()]
        exports = [{"service": subject} for subject in tenant_subjects()]
        found: dict = {PLATFORM: {"jetstream": "enabled", "users": users, "exports": exports}}
        for name, key in self._users("tenants").items():
            account = f"{TENANT_ACCOUNT_PREFIX}{name}"
            exports += [{"stream": subject, "accounts": [account]} for subject in tenant_stream_subjects(name)]
            found[account] = {
                "users": [_tenant_user(name, key)],
                "imports": [
                    *({"service": {"account": PLATFORM, "subject": s}, "share": True} for s in tenant_subjects()),
                    *({"stream": {"account": PLATFORM, "subject": s}} for s in tenant_stream_subjects(name))],
            }
        return found

    def server_config(self) -> str:
        """Lines for a nats-server config (its format reads JSON values)."""
        return f"accounts: {json.dumps(self.accounts(), indent=1)}\n"


def write_accounts(data_dir: Path, auth: AuthDir) -> Path:
    """The accounts block every server of the bus includes (root-only: it names every user's key)."""
    path = data_dir / ACCOUNTS_CONF
    write_private(path, auth.server_config())
    return path


def reload_servers(state: dict) -> int:
    """Ask every nats-server of a running platform (its supervisor's state) to reread its config
    (SIGHUP): new accounts and users take effect without a restart. Returns how many were asked."""
    asked = 0
    for server in state.get("nats", []):
        pid = state.get("services", {}).get(server["name"])
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)
                asked += 1
    return asked

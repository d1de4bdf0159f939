"""Landlock (and AppArmor) denials, read from the kernel's audit log and published as
violation events (`file.landlock`, ...; schemas/violations.py).

The agent reads the audit netlink multicast group AUDIT_NLGRP_READLOG: a read-only copy of
every record, which needs no audit daemon and takes nothing from one that runs. Records
exist only while audit is enabled; the agent turns it on if it is off, with task rules that
spare the host's processes the cost, and gives it back on shutdown (agents/node/audit_rules.py).

A denial of a process with a syscall audit context (sandbox processes made by a tagged
parent) is several records with one serial: LANDLOCK_ACCESS (what was refused, e.g.
`blockers=fs.write_file path="/usr/bin/bash"`), LANDLOCK_DOMAIN once per domain, SYSCALL
(pid, comm, exe and `auid`), PROCTITLE and EOE. The sandbox is found from `auid`: every
sandbox process carries an audit login uid derived from its cgroups (linuxnode.
landlock.audit_tag), so a process that has exited since is still attributed.

A process without a context (a container's first process, made by the runtime before the
exec shim tags it) gives a lone LANDLOCK_ACCESS record naming its Landlock domain, followed
the first time by that domain's LANDLOCK_DOMAIN record with the pid of the process that made
it (the one whose exec started it). The agent resolves that pid to its sandbox (login uid,
else cgroup) the moment the record arrives, while it still runs, and remembers the domain:
such events carry the domain maker's pid and command. Denials of processes that belong to
no sandbox of this node are dropped.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agents.node.audit_rules import AuditLog, AuditUnavailable
from agents.node.violations import ViolationPublisher
from linuxnode import cgroups, landlock
from linuxnode.audit import HEADER as _HEADER

log = logging.getLogger("sandfleet.agent")

SYSCALL, PROCTITLE, EOE, AVC = 1300, 1327, 1320, 1400
LANDLOCK_ACCESS, LANDLOCK_DOMAIN = 1423, 1424
_STAMP = re.compile(rb"^audit\((\d+)\.(\d+):(\d+)\): ?")
_FIELD = re.compile(rb'([a-z_-]+)=("[^"]*"|\S*)')
_UNTRUSTED = {"path", "comm", "exe", "name", "profile", "operation", "requested_mask", "denied_mask"}
_TITLE_MAX = 256
_FLUSH_S = 0.1  # a denial without a syscall context has no SYSCALL/EOE record to end it
_DOMAINS_KEPT = 4096  # Landlock domains remembered (newest), for denials after their first


def _value(key: str, raw: bytes) -> str:
    """A field as text: quoted strings unquoted, hex-encoded untrusted strings decoded."""
    if raw.startswith(b'"'):
        return raw[1:-1].decode(errors="replace")
    if key in _UNTRUSTED and raw and len(raw) % 2 == 0 and re.fullmatch(rb"[0-9A-F]+", raw):
        return bytes.fromhex(raw.decode()).decode(errors="replace")
    return raw.decode(errors="replace")


def parse(payload: bytes) -> tuple[str, dict[str, str]] | None:
    """('<seconds>.<ms>:<serial>', fields) of one audit record's text, or None."""
    stamp = _STAMP.match(payload)
    if stamp is None:
        return None
    fields: dict[str, str] = {}
    for key, raw in _FIELD.findall(payload[stamp.end():]):
        k = key.decode()
        fields.setdefault(k, _value(k, raw))
    return f"{stamp[1].decode()}.{stamp[2].decode()}:{stamp[3].decode()}", fields


@dataclass
class Denial:
    """One refused access, from the records that share an audit serial."""

    stamp: str
    kind: str  # file.landlock, process.landlock, network.landlock, ipc.landlock, file.apparmor...
    attempted: str
    pid: int = 0
    command: str = ""
    auid: int = -1
    domain: str = ""  # the Landlock domain that refused it
    at: float = field(default_factory=time.time)


def _landlock_denial(stamp: str, f: dict[str, str]) -> Denial:
    blockers = f.get("blockers", "")
    layer = blockers.split(".", 1)[0].split(",", 1)[0]
    kind = {"fs": "file", "net": "network", "scope": "ipc"}.get(layer, "process")
    what = " ".join(f"{k}={f[k]}" for k in ("path", "dev", "ino", "opid", "ocomm", "daddr", "dest", "sport")
                    if k in f)
    return Denial(stamp, f"{kind}.landlock", f"{blockers} {what}".strip(), domain=f.get("domain", ""))


def _apparmor_denial(stamp: str, f: dict[str, str]) -> Denial | None:
    if f.get("apparmor") != "DENIED":
        return None
    cls = f.get("class", "file")
    kind = {"net": "network", "cap": "capability"}.get(cls, cls)
    what = " ".join(f"{k}={f[k]}" for k in ("operation", "name", "requested_mask", "denied_mask", "capname",
                                             "family", "sock_type", "profile") if k in f)
    # An AVC record names its process itself (with or without a syscall context).
    return Denial(stamp, f"{kind}.apparmor", what, pid=_int(f.get("pid"), 0), command=f.get("comm", ""))


class DenialReader:
    """Groups the multicast records by serial into Denials and hands each to `deliver`."""

    def __init__(self, audit: AuditLog | None, deliver: Callable[[Denial], Awaitable[None]],
                 on_domain: Callable[[str, int, str], None] = lambda domain, pid, comm: None) -> None:
        self.audit = audit
        self.deliver = deliver
        self.on_domain = on_domain  # (domain, pid, comm) of its maker, as its first record names it
        self.pending: dict[str, Denial] = {}
        self.tasks: set[asyncio.Task] = set()
        self.lost = 0

    def start(self) -> None:
        assert self.audit is not None and self.audit.sock is not None
        asyncio.get_running_loop().add_reader(self.audit.sock.fileno(), self._readable)

    async def stop(self) -> None:
        """Stop reading and wait for the deliveries under way (before the socket closes)."""
        if self.audit is not None and self.audit.sock is not None:
            asyncio.get_running_loop().remove_reader(self.audit.sock.fileno())
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _readable(self) -> None:
        assert self.audit is not None and self.audit.sock is not None
        while True:
            try:
                data = self.audit.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    log.warning("audit netlink read failed: %s", exc)
                    return
                self.lost += 1  # the kernel dropped records while we were slow; the socket goes on
                log.warning("audit records lost: %s", exc)
                continue
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, rtype = _HEADER.unpack_from(data, offset)[:2]
                self.record(rtype, data[offset + _HEADER.size:offset + max(length, _HEADER.size)].rstrip(b"\0"))
                offset += (max(length, _HEADER.size) + 3) & ~3

    def record(self, rtype: int, payload: bytes) -> None:
        """Feed one record; complete denials are delivered."""
        if rtype not in (LANDLOCK_ACCESS, LANDLOCK_DOMAIN, AVC, SYSCALL, PROCTITLE, EOE):
            return
        parsed = parse(payload)
        if parsed is None:
            return
        stamp, f = parsed
        if rtype == LANDLOCK_DOMAIN:
            if f.get("status") == "allocated" and f.get("domain"):
                self.on_domain(f["domain"], _int(f.get("pid"), 0), f.get("comm", ""))
            return
        if rtype in (LANDLOCK_ACCESS, AVC):
            denial = _landlock_denial(stamp, f) if rtype == LANDLOCK_ACCESS else _apparmor_denial(stamp, f)
            if denial is not None and stamp not in self.pending:
                self.pending[stamp] = denial
                asyncio.get_running_loop().call_later(_FLUSH_S, self._flush, stamp)
            return
        denial = self.pending.get(stamp)
        if denial is None:
            return
        if rtype == SYSCALL:
            denial.pid = int(f.get("pid", "0") or 0)
            denial.command = f.get("comm", "")
            denial.auid = _int(f.get("auid"), -1)
        elif rtype == PROCTITLE:  # the command line: the record names a directory, not the file made in it
            title = f.get("proctitle", "")
            if re.fullmatch(r"(?:[0-9A-F]{2})+", title):
                title = bytes.fromhex(title).replace(b"\0", b" ").decode(errors="replace")
            # The kernel keeps a process's first title for its life, across exec: a container
            # command's is that of the exec shim it was (which set its audit tag). Not its own.
            if not title.startswith(landlock.SHIM_PATH):
                denial.attempted += f" by: {title.strip()[:_TITLE_MAX]}"
        else:
            self._flush(stamp)

    def _flush(self, stamp: str) -> None:
        denial = self.pending.pop(stamp, None)
        if denial is not None:
            task = asyncio.get_running_loop().create_task(self.deliver(denial))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


@dataclass(frozen=True)
class _Domain:
    sandbox_id: str
    pid: int  # of the process that made it (whose exec started it)
    command: str


@dataclass
class SandboxFinder:
    """Which sandbox of this node a denial's process belongs to."""

    layout: cgroups.CgroupLayout
    node_id: str
    tags: dict[int, str] = field(default_factory=dict)
    domains: dict[str, _Domain] = field(default_factory=dict)  # Landlock domain -> its sandbox, newest last

    def _held(self) -> list[str]:
        held = cgroups.list_sandboxes(self.layout, self.node_id)
        self.tags = {landlock.audit_tag(cgroups.SandboxCgroups(self.layout, self.node_id, s).procs_files): s
                     for s in held}
        return held

    def _by_tag(self, auid: int) -> str | None:
        if auid not in self.tags:
            self._held()
        return self.tags.get(auid)

    def find(self, denial: Denial) -> str | None:
        """The denial's sandbox; a denial without a syscall context also gets its pid and
        command from its domain's maker."""
        found = self.tags.get(denial.auid)
        if found is None and denial.domain in self.domains:
            domain = self.domains[denial.domain]
            if not denial.pid:
                denial.pid, denial.command = domain.pid, denial.command or domain.command
            found = domain.sandbox_id
        if found is None and denial.auid != -1:
            found = self._by_tag(denial.auid)
        if found is None and denial.pid:
            found = self._by_cgroup(denial.pid, self._held())
        return found

    def learn(self, domain: str, pid: int, comm: str) -> None:
        """A domain's first record names its maker: resolve it now, while it likely still runs."""
        if not pid or domain in self.domains:
            return
        found = self._by_tag(_int(_read(f"/proc/{pid}/loginuid"), -1)) or self._by_cgroup(pid, self._held())
        if found is None:
            return  # not a sandbox of this node, or already gone
        self.domains[domain] = _Domain(found, pid, _read(f"/proc/{pid}/comm") or comm)
        while len(self.domains) > _DOMAINS_KEPT:
            del self.domains[next(iter(self.domains))]

    @staticmethod
    def _by_cgroup(pid: int, held: list[str]) -> str | None:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        names = {part for line in lines for part in line.split(":", 2)[-1].split("/")}
        return next((s for s in held if s in names), None)


class LsmViolations:
    """The node agent's side: audit on, denials read, each published as a violation event."""

    def __init__(self, node_id: str, layout: cgroups.CgroupLayout, publisher: ViolationPublisher) -> None:
        self.node_id = node_id
        self.publisher = publisher
        self.finder = SandboxFinder(layout, node_id)
        self.audit = AuditLog(node_id)
        self.why_not = ""
        self.reader: DenialReader | None = None
        try:
            self.audit.open()
        except AuditUnavailable as exc:
            self.why_not = str(exc)
            log.warning("Landlock/AppArmor denials will not be reported: %s", exc)

    @property
    def status(self) -> str:
        if self.why_not:
            return f"off: {self.why_not}"
        turned = (" (audit turned on by the agent: off again when the last agent stops)"
                  if self.audit.enabled_by_us else "")
        return f"on: audit netlink, task rules spare non-sandbox processes a syscall audit context{turned}"

    def start(self) -> None:
        """Read the denials (the publisher must be bound to the bus)."""
        if self.audit.sock is None:
            return
        self.reader = DenialReader(self.audit, self._publish, on_domain=self.finder.learn)
        self.reader.start()

    async def _publish(self, denial: Denial) -> None:
        sandbox_id = self.finder.find(denial)
        if sandbox_id is None:
            return  # not a sandbox of this node (another Landlock user of the host)
        await self.publisher.publish(sandbox_id, denial.kind, denial.attempted, pid=denial.pid,
                                     command=denial.command, at=float(denial.stamp.split(":", 1)[0]),
                                     msg_id=f"{sandbox_id}:audit:{denial.stamp}")

    async def close(self) -> None:
        if self.reader is not None:
            await self.reader.stop()
        self.audit.close()


def landlock_status(abi: int, denials: LsmViolations) -> str:
    """What the agent reports for Landlock: which sandboxes run under it, and where denials go."""
    if not abi:
        return "off: not in this kernel"
    import shutil

    containers = ("container sandboxes through the exec shim" if shutil.which("cc") or shutil.which("gcc")
                  else "not container sandboxes (no C compiler to build the exec shim)")
    logged = "" if abi >= 7 else " (denials are logged from ABI 7 on)"
    return f"on: ABI {abi}, process sandboxes and {containers}; denials {denials.status}{logged}"

"""The node agent's hold on kernel audit: on for Landlock (and AppArmor) denials, at the
least cost to the host, and given back as it was found.

Cost. With audit on, every task created afterwards gets a syscall audit context unless a
task rule says `never`, and every syscall of a task with a context takes the slow path
through the audit hooks (loadtest/audit_cost.py measures it). So before it turns audit on,
the agent adds `-a task,never` rules, for every task whose login uid is not a sandbox's
audit tag (linuxnode.landlock.audit_tag): the host's own processes get no context.
Sandbox processes made by a tagged parent keep theirs, because the record of their
syscall is what names the process, command line and sandbox of a denial; a Landlock
denial is recorded with or without a context, and the agent attributes one without
(a container's first process) through its LANDLOCK_DOMAIN record (agents/node/audit.py).

Ownership. The rules carry a key naming the agent (`sandfleet-agent node=… pid=…
was-enabled=…`); an agent deletes its own rules when it stops and the rules of agents
whose process is gone (crashed), never anyone else's. `was-enabled` is audit's state
before the first sandfleet agent touched it, passed on from key to key, so the last
agent to stop restores it: a host that had audit off gets it off again, unless another
agent still runs (its rules say so), an audit daemon registered meanwhile (it depends on
audit) or audit was locked. Agents of several platforms start and stop on one host at
once (and a crashed one is restarted), so each reads and changes the rules and audit's
state under one host-wide lock (`flock`, which the kernel drops with a crashed holder):
without it an agent stopping could see no other agent while one starting had read
audit as on and not yet added its rules, and turn audit off under it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
from collections.abc import Iterator

from linuxnode import audit

log = logging.getLogger("sandfleet.agent")

KEY_PREFIX = "sandfleet-agent "
LOCK_PATH = "/run/sandfleet-audit.lock"
_KEY = re.compile(r"^sandfleet-agent node=(\S+) pid=(\d+) was-enabled=(\d)$")


class AuditUnavailable(RuntimeError):
    pass


def agent_key(node_id: str, pid: int, was_enabled: int) -> str:
    return f"{KEY_PREFIX}node={node_id} pid={pid} was-enabled={was_enabled}"


def parse_key(key: str) -> tuple[str, int, int] | None:
    """(node, pid, was-enabled) of a sandfleet agent's rule key, else None."""
    m = _KEY.match(key)
    return (m[1], int(m[2]), int(m[3])) if m else None


def task_rules(key: str) -> tuple[audit.Rule, ...]:
    """`-a task,never` for every login uid outside the sandbox tag range (unset included: -1 is above it)."""
    return tuple(audit.Rule(audit.AUDIT_FILTER_TASK, audit.AUDIT_NEVER, ((audit.AUDIT_LOGINUID, op, bound),), key=key)
                 for op, bound in ((audit.LESS_THAN, audit.TAG_MIN), (audit.GREATER_THAN, audit.TAG_MAX)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _quietly(call, rule: audit.Rule, ignore: int) -> None:
    try:
        call(rule)
    except OSError as exc:
        if exc.errno != ignore:
            raise


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Held while an agent reads and changes the audit rules and state (see the docstring)."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last fd of the open file drops the lock


class AuditLog:
    """Audit on with the agent's task rules, and the multicast socket of its records."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.enabled_by_us = False
        self.was_enabled = 1  # audit's state before the first sandfleet agent
        self.rules: tuple[audit.Rule, ...] = ()
        self.sock: socket.socket | None = None

    def open(self) -> None:
        """Rules first (no task made meanwhile gets a context), then audit on, then the socket."""
        try:
            with _host_lock():
                self._take()
            self.sock = audit.readlog_socket()
        except OSError as exc:
            self.close()  # nothing of ours stays behind (the rules, if they were added)
            raise AuditUnavailable(f"audit netlink: {exc.strerror or exc}") from None

    def _take(self) -> None:
        status = audit.status()
        agents = [(r, parse_key(r.key)) for r in audit.rules() if r.key.startswith(KEY_PREFIX)]
        self.was_enabled = min([status.enabled, *(info[2] for _, info in agents if info)])
        self.rules = task_rules(agent_key(self.node_id, os.getpid(), self.was_enabled))
        for rule in self.rules:
            _quietly(audit.add_rule, rule, errno.EEXIST)
        for rule, info in agents:  # a crashed agent's (ours were added just now: no gap)
            if info is None or not _alive(info[1]):
                _quietly(audit.delete_rule, rule, errno.ENOENT)
        if status.enabled == 0:
            audit.set_enabled(1)
            self.enabled_by_us = True
            log.info("kernel audit was off: turned it on (AUDIT_SET enabled=1) to receive Landlock denials; "
                     "task rules spare the host's processes a syscall audit context")

    def others(self) -> list[str]:
        """Keys of the other live sandfleet agents' rules."""
        mine = os.getpid()
        found = []
        for rule in audit.rules():
            info = parse_key(rule.key)
            if info is not None and info[1] != mine and _alive(info[1]) and rule.key not in found:
                found.append(rule.key)
        return found

    def close(self) -> None:
        """Drop the socket and this agent's rules; the last agent gives audit's state back."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        rules, self.rules = self.rules, ()
        if not rules:
            return
        try:
            with _host_lock():
                self._give_back(rules)
        except OSError as exc:
            log.warning("giving kernel audit back failed: %s", exc)

    def _give_back(self, rules: tuple[audit.Rule, ...]) -> None:
        for rule in rules:
            _quietly(audit.delete_rule, rule, errno.ENOENT)
        if self.was_enabled == 0 and not self.others():
            status = audit.status()
            if status.enabled == 1 and status.daemon_pid == 0:
                audit.set_enabled(0)
                log.info("kernel audit turned off again, as the agent found it")

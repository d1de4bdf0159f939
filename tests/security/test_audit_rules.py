"""The node agent's audit task rules on the real kernel: with them, a host process gets no
syscall audit context (no SYSCALL record joins its Landlock denial) while a process carrying
a sandbox's audit tag keeps one; Landlock denial records arrive either way; and the agent
removes exactly its own rules when it stops."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest

from agents.node.audit import LANDLOCK_ACCESS, SYSCALL, parse
from agents.node.audit_rules import LOCK_PATH, AuditLog, parse_key
from linuxnode import audit, landlock
from tests.kernel import require

# Restricted to reading, the child tries to make a file in DIR: refused, and logged (same exec).
CHILD = r"""
import os, sys
from linuxnode import landlock, syscalls
directory, tag = sys.argv[1], sys.argv[2]
if tag != "-":  # a sandbox's tag first, so the process that is refused is made with it
    with open("/proc/self/loginuid", "w") as f:
        f.write(tag)
    pid = os.fork()
    if pid:
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
landlock.restrict_self([("/", landlock.READ)], landlock.abi())
try:
    open(os.path.join(directory, "answer"), "w")
except PermissionError:
    sys.exit(0)
sys.exit(3)
"""


def _require_audit() -> None:
    require(os.geteuid() == 0, "audit control needs root")
    try:
        audit.status()
        reachable = True
    except OSError:
        reachable = False
    require(reachable, "the kernel's audit netlink answers (CONFIG_AUDIT, CAP_AUDIT_CONTROL)")
    require(landlock.abi() >= 7, f"Landlock ABI 7 logs denials to audit (this kernel: ABI {landlock.abi()})")


def _denial_records(sock, directory: str, within: float = 3.0) -> dict[str, set[int]]:
    """serial -> record types seen, for the serials of LANDLOCK_ACCESS records naming `directory`."""
    by_serial: dict[str, set[int]] = {}
    ours: set[str] = set()
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not select.select([sock], [], [], 0.1)[0]:
            if ours:
                break
            continue
        data = sock.recv(1 << 16)
        offset = 0
        while offset + audit.HEADER.size <= len(data):
            length, rtype = audit.HEADER.unpack_from(data, offset)[:2]
            parsed = parse(data[offset + audit.HEADER.size:offset + length].rstrip(b"\0"))
            offset += (length + 3) & ~3
            if parsed is None:
                continue
            serial = parsed[0].split(":", 1)[1]
            by_serial.setdefault(serial, set()).add(rtype)
            if rtype == LANDLOCK_ACCESS and directory in parsed[1].get("path", ""):
                ours.add(serial)
    return {s: by_serial[s] for s in ours}


@pytest.fixture
def agent_audit():
    _require_audit()
    log = AuditLog(f"e3test-{uuid.uuid4().hex[:6]}")
    log.open()
    yield log
    log.close()


def _refused(directory: str, tag: int | None) -> None:
    done = subprocess.run([sys.executable, "-S", "-c", CHILD, directory, "-" if tag is None else str(tag)],
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": "."})
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("tagged", [False, True], ids=["host-process", "sandbox-tagged"])
def test_a_host_process_gets_no_audit_context_and_a_sandbox_one_does_and_both_denials_arrive(
        agent_audit, tmp_path, tagged):
    sock = audit.readlog_socket()
    try:
        directory = str(tmp_path / f"dir-{uuid.uuid4().hex[:8]}")
        os.mkdir(directory)
        _refused(directory, landlock.audit_tag([directory]) if tagged else None)
        records = _denial_records(sock, directory)
    finally:
        sock.close()
    assert records, "no LANDLOCK_ACCESS record for the refused create"
    with_syscall = any(SYSCALL in types for types in records.values())
    assert with_syscall == tagged, records


def test_the_agent_removes_exactly_its_own_rules_and_those_of_dead_agents():
    _require_audit()
    foreign = audit.Rule(audit.AUDIT_FILTER_TASK, audit.AUDIT_NEVER, ((audit.AUDIT_LOGINUID, audit.LESS_THAN, 0),),
                         key=f"not-sandfleet-{uuid.uuid4().hex[:6]}")
    dead = audit.Rule(audit.AUDIT_FILTER_TASK, audit.AUDIT_NEVER, ((audit.AUDIT_LOGINUID, audit.LESS_THAN, 0),),
                      key=f"sandfleet-agent node=e3gone pid={2 ** 22 + 7} was-enabled=1")  # above pid_max: gone
    audit.add_rule(foreign)
    audit.add_rule(dead)
    log = AuditLog("e3test-own")
    try:
        log.open()
        keys = [r.key for r in audit.rules()]
        mine = [k for k in keys if (parse_key(k) or ("", 0, 0))[:2] == ("e3test-own", os.getpid())]
        assert len(mine) == 2 and re.search(r"was-enabled=[012]$", mine[0])
        assert foreign.key in keys and dead.key not in keys  # a crashed agent's rules are taken back
        log.close()
        keys = [r.key for r in audit.rules()]
        assert foreign.key in keys and not any(k.startswith("sandfleet-agent node=e3test-own ") for k in keys)
    finally:
        log.close()
        for rule in (foreign, dead):
            try:
                audit.delete_rule(rule)
            except FileNotFoundError:
                pass


def test_an_agent_reads_and_changes_audit_only_while_no_other_agent_does():
    """The host-wide lock: an agent starting while another holds it (stopping, say, and about to
    turn audit off as the last one) neither reads the rules nor adds its own until it is let go."""
    _require_audit()
    log = AuditLog("e3test-lock")
    held = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    opening = threading.Thread(target=log.open, daemon=True)
    opening.start()
    try:
        opening.join(0.5)
        assert opening.is_alive()
        assert not any(r.key.startswith("sandfleet-agent node=e3test-lock ") for r in audit.rules())
    finally:
        os.close(held)
    try:
        opening.join(30)
        assert not opening.is_alive()
        assert sum(r.key.startswith("sandfleet-agent node=e3test-lock ") for r in audit.rules()) == 2
    finally:
        log.close()


def test_the_audit_cost_benchmark_runs_and_leaves_no_rule_behind(tmp_path):
    _require_audit()
    require(shutil.which("cc") is not None, "a C compiler for the benchmark's syscall loop")
    out = tmp_path / "audit_cost.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "loadtest.audit_cost", "--n", "20000", "--rounds", "1",
                           "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert {"sandbox_tagged", "host_never"} <= set(results["ns_per_getppid"])
    assert not any(r.key.startswith("sandfleet-bench-audit-cost") for r in audit.rules())

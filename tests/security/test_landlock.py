"""Red team: file attacks from inside real sandboxes, refused by namespaces, mount masks and
Landlock; each Landlock refusal arrives on the bus as a `file.landlock` violation.

Most paths a cheating agent tries (the platform's data dir, another sandbox's workspace, the
host's /proc) do not exist in a sandbox's mount and pid namespaces at all, so the attempt
fails with ENOENT and nothing is denied: there is no event to expect, and these tests do not
pretend there is. Landlock is the layer that holds if such a path ever becomes reachable (a
leaked descriptor, a bind mount, a namespace escape): the `..._even_where_it_is_reachable`
tests run a process under the exact policy and audit tag of a live sandbox on the host,
where those paths do exist, and show the refusal and its event.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from linuxnode import cgroups, landlock
from tests.conftest import EVENT_DEADLINE_S
from tests.kernel import active_lsms, only_where, require
from tests.test_layered_sandboxes import LAYERS, layers  # noqa: F401  (fixture)

ANSWER = b"sandfleet-leftover-answer-7f3c9e: 42\n"


def _require_landlock_log() -> None:
    require(landlock.abi() >= 7, f"Landlock ABI 7 logs denials to audit (this kernel: ABI {landlock.abi()})")


async def _violations(fleet, sandbox_id: str, kind: str = "file.landlock") -> tuple[asyncio.Task, list]:
    """Start collecting `kind` violations of a sandbox; returns the task and the list it fills."""
    seen: list = []
    ready = asyncio.Event()

    async def collect() -> None:
        stream = fleet.violations(sandbox_id)
        ready.set()
        async for v in stream:
            if v.kind == kind:
                seen.append(v)

    task = asyncio.create_task(collect())
    await ready.wait()
    await asyncio.sleep(0.2)  # the consumer is attached
    return task, seen


async def _first(seen: list, what: bytes | str, within: float = EVENT_DEADLINE_S) -> object:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for v in seen:
            if str(what if isinstance(what, str) else what.decode()) in v.attempted:
                return v
        await asyncio.sleep(0.02)
    raise AssertionError(f"no violation naming {what!r} within {within} s; got {[v.attempted for v in seen]}")


def _as_sandbox(node_id: str, sandbox_id: str, root: str, path: str, held: str | None = None) -> int:
    """In a forked child: take the sandbox's audit tag and its Landlock policy for `root` (its
    root, seen from the host), then open `path`, relative to the directory `held` if given (a
    descriptor the process held before it was confined, as a leaked one would be). Returns
    the errno (0: it was read). Paths go through no /proc/<pid>/root link after confinement:
    Landlock refuses those magic links to a process of another domain anyway. The process that
    tries is forked by one that already carries the tag, as a sandbox's processes are: the
    kernel gives a task its syscall audit context (which names the process in the denial) when
    it is made, and the agent's task rules give none to a task made untagged, like this test's
    first child; its denial could be told apart only while it still runs."""
    procs = cgroups.SandboxCgroups(cgroups.CgroupLayout.detect(), node_id, sandbox_id).procs_files
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 255
        try:
            os.close(r)
            held_fd = os.open(held, os.O_PATH | os.O_DIRECTORY) if held else None
            landlock.set_audit_tag(landlock.audit_tag(procs))
            tries = os.fork()
            if tries:
                os.waitpid(tries, 0)
                os._exit(0)
            landlock.restrict_self(landlock.sandbox_rules(root), landlock.abi())
            try:
                with open(os.open(path, os.O_RDONLY, dir_fd=held_fd), "rb") as f:
                    f.read()
                code = 0
            except OSError as exc:
                code = exc.errno
        finally:  # the grandchild's answer (or the first child's, if it failed before the fork)
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    try:
        return os.read(r, 1)[0]
    finally:
        os.close(r)
        os.waitpid(pid, 0)


# -- system content ------------------------------------------------------------------------------

BASH = b"#!/bin/sh\necho the real bash\n"


@pytest.fixture(scope="module")
async def bash_layer(layers, tmp_path_factory):  # noqa: F811
    """A layer with a /bin/bash of its own (a script: the test needs no real bash)."""
    src = tmp_path_factory.mktemp("bash-layer")
    (src / "bin").mkdir()
    (src / "bin" / "bash").write_bytes(BASH)
    (src / "bin" / "bash").chmod(0o755)
    await layers.build_dir("ll-bash", src, on="lsb-base")
    return [*LAYERS, "ll-bash"]


async def test_overwriting_bin_bash_is_refused_reported_and_leaves_the_layer_alone(fleet, layers, bash_layer,
                                                                                    platform):
    _require_landlock_log()
    sb = await fleet.create(memory_mb=64, layers=bash_layer, labels={"task": "landlock-bin"})
    task, seen = await _violations(fleet, sb.id)
    try:
        r = await sb.exec(["sh", "-c", "echo 'echo pwned' > /bin/bash"])
        assert r.exit_code != 0 and b"Permission denied" in r.stderr
        # Opened with O_CREAT, so the record may name the directory it would be made in; the
        # command line comes with it.
        v = await _first(seen, "> /bin/bash")
        assert "fs.write_file" in v.attempted or "fs.make_reg path=/bin " in v.attempted
        assert v.labels == {"task": "landlock-bin"} and v.command == "sh"
        assert v.pid > 0

        r = await sb.exec(["rm", "/bin/sh"])
        assert r.exit_code != 0
        v = await _first(seen, "fs.remove_file")
        assert "path=/bin" in v.attempted

        assert (await sb.exec(["/bin/bash"])).stdout == b"the real bash\n"
        roots = {x.sandbox_id: x for x in (await layers.cache(platform.node_id)).rootfs}
        assert not (platform.roots_path(roots[sb.id].upper) / "bin").exists()  # nothing was copied up
        digest = (await layers.get("ll-bash")).digest.removeprefix("sha256:")
        assert platform.roots_path(platform.data_dir / "layer-cache" / "mnt" / digest / "bin" / "bash").read_bytes() == BASH
        # What the sandbox may write, it writes.
        r = await sb.exec(["sh", "-c", "echo ok > /workspace/out && echo ok > /tmp/out && cat /workspace/out /tmp/out"])
        assert r.stdout == b"ok\nok\n"
    finally:
        task.cancel()
        await sb.destroy()


async def test_a_container_sandbox_runs_under_the_same_policy(fleet, layers, bash_layer, platform):
    _require_landlock_log()
    require(shutil.which("crun") is not None, "crun is installed")
    sb = await fleet.create(isolation="container", memory_mb=64, layers=bash_layer, labels={"task": "landlock-ct"})
    task, seen = await _violations(fleet, sb.id)
    try:
        # The process stays a moment: a container's denial is tied to its sandbox through the
        # process (containers carry no audit tag), and one that is gone before the agent reads
        # the record cannot be attributed (a known gap, see agents/node/audit.py).
        r = await sb.exec(["sh", "-c", "echo 'echo pwned' > /bin/bash || { sleep 1; exit 1; }"])
        assert r.exit_code != 0 and b"Permission denied" in r.stderr
        v = await _first(seen, "path=/bin")
        assert v.labels == {"task": "landlock-ct"} and v.command == "sh" and v.pid > 0
        assert (await sb.exec(["/bin/bash"])).stdout == b"the real bash\n"
        r = await sb.exec(["sh", "-c", "echo ok > /workspace/out && echo ok > /tmp/out && cat /workspace/out /tmp/out"])
        assert r.stdout == b"ok\nok\n"
        # The init runs under it too (the exec shim sits in front of catatonit).
        init = (await fleet.get(sb.id)).init_pid
        with open(f"/proc/{init}/status") as f:
            assert "NoNewPrivs:\t1" in f.read()
        assert (await sb.exec(["no-such-command"])).exit_code == 127
    finally:
        task.cancel()
        await sb.destroy()


async def test_a_new_top_level_directory_cannot_be_made(fleet, layers):
    _require_landlock_log()
    sb = await fleet.create(memory_mb=64, layers=LAYERS)
    task, seen = await _violations(fleet, sb.id)
    try:
        r = await sb.exec(["sh", "-c", "echo x > /answers"])
        assert r.exit_code != 0 and b"Permission denied" in r.stderr
        v = await _first(seen, "fs.make_reg")
        assert "path=/ " in v.attempted
    finally:
        task.cancel()
        await sb.destroy()


@pytest.fixture(scope="module")
async def python_layer(layers, tmp_path_factory):  # noqa: F811
    """This host's python3 and standard library, without the compiled .pyc files, so an import
    would write them into /usr if the sandbox environment let it."""
    from tests.test_layer_tools import make_python_base

    tree = tmp_path_factory.mktemp("python-no-pyc")
    make_python_base(tree)
    for cache in list(tree.rglob("__pycache__")):
        shutil.rmtree(cache)
    await layers.build_dir("ll-python", tree)
    return ["ll-python"]


async def test_python_imports_in_a_layered_sandbox_without_a_landlock_violation(fleet, python_layer):
    _require_landlock_log()
    sb = await fleet.create(memory_mb=256, layers=python_layer)
    task, seen = await _violations(fleet, sb.id)
    try:
        r = await sb.exec(["python3", "-c", "import json; print(json.dumps([1]))"], timeout_s=60)
        assert (r.exit_code, r.stdout) == (0, b"[1]\n"), r.stderr
        await asyncio.sleep(1.0)  # a violation would be on the bus well within this
        assert seen == []
        # The same import writing bytecode is refused under /usr and reported: what the
        # default environment (PYTHONDONTWRITEBYTECODE=1) spares every Python sandbox.
        r = await sb.exec(["python3", "-c", "import json"], env={"PYTHONDONTWRITEBYTECODE": ""}, timeout_s=60)
        assert r.exit_code == 0, r.stderr
        v = await _first(seen, "path=/usr/lib/python3")
        assert v.kind == "file.landlock"
    finally:
        task.cancel()
        await sb.destroy()


# -- the platform's data dir and its logs ---------------------------------------------------------

async def test_the_platform_data_dir_and_logs_are_out_of_reach_from_a_sandbox(fleet, platform):
    answer = platform.data_dir / "leftover-answer.txt"
    answer.write_bytes(ANSWER)
    logs = sorted((platform.data_dir / "logs").glob("*.log"))
    assert logs
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        tries = [str(answer), f"/proc/1/root{answer}", f"/proc/self/root{answer}", f"/../../..{answer}",
                 str(logs[0]), f"/proc/1/cwd{logs[0]}"]
        for path in tries:
            r = await sb.exec(["cat", path])
            # ENOENT: not in its mount namespace; EACCES for /proc/1/...: Landlock refuses the
            # magic link to a process of another Landlock domain (the init's).
            assert r.exit_code != 0 and ANSWER not in r.stdout, path
            assert b"No such file" in r.stderr or (path.startswith("/proc/1/") and b"Permission denied" in r.stderr)
        r = await sb.exec(["sh", "-c", f"ls -d {platform.data_dir.parent} {platform.data_dir}/logs 2>&1; true"])
        assert b"No such file" in r.stdout
    finally:
        await sb.destroy()
        answer.unlink()


async def test_the_sandbox_policy_refuses_the_platform_data_dir_even_where_it_is_reachable(fleet, platform):
    _require_landlock_log()
    answer = platform.data_dir / "leftover-answer.txt"
    answer.write_bytes(ANSWER)
    log_file = sorted((platform.data_dir / "logs").glob("*.log"))[0]
    sb = await fleet.create(memory_mb=64, labels={"task": "landlock-data"}, host_view=True)
    task, seen = await _violations(fleet, sb.id)
    try:
        root = f"/proc/{(await fleet.get(sb.id)).init_pid}/root"
        assert _as_sandbox(platform.node_id, sb.id, root, "etc/passwd", held=root) == 0  # its own root: yes
        for path in (answer, log_file):
            assert _as_sandbox(platform.node_id, sb.id, root, str(path)) == 13  # EACCES
            v = await _first(seen, str(path))
            assert "fs.read_file" in v.attempted and v.labels == {"task": "landlock-data"}
    finally:
        task.cancel()
        await sb.destroy()
        answer.unlink()


# -- another sandbox's workspace ---------------------------------------------------------------

async def test_another_sandboxs_workspace_is_out_of_reach(fleet):
    a, b = await asyncio.gather(fleet.create(memory_mb=64, host_view=True), fleet.create(memory_mb=64, host_view=True))
    try:
        await a.write_file("/workspace/answer.txt", ANSWER)
        init_a = (await fleet.get(a.id)).init_pid
        for path in ("/workspace/answer.txt", f"/proc/{init_a}/root/workspace/answer.txt",
                     "/proc/1/root/workspace/answer.txt"):
            r = await b.exec(["cat", path])
            assert ANSWER not in r.stdout, path
        search = "grep -rls --exclude-dir=proc sandfleet-leftover-answer-7f3c9e /; true"
        r = await b.exec(["sh", "-c", search], timeout_s=60)
        assert r.stdout == b""
    finally:
        await asyncio.gather(a.destroy(), b.destroy())


async def test_the_sandbox_policy_refuses_another_sandboxs_workspace_even_where_it_is_reachable(fleet, platform):
    _require_landlock_log()
    a, b = await asyncio.gather(fleet.create(memory_mb=64, host_view=True), fleet.create(memory_mb=64, host_view=True))
    task, seen = await _violations(fleet, b.id)
    try:
        await a.write_file("/workspace/answer.txt", ANSWER)
        root_a = f"/proc/{(await fleet.get(a.id)).init_pid}/root"
        root_b = f"/proc/{(await fleet.get(b.id)).init_pid}/root"
        assert _as_sandbox(platform.node_id, b.id, root_b, "workspace/answer.txt", held=root_a) == 13
        v = await _first(seen, "/workspace/answer.txt")
        assert v.sandbox_id == b.id and "fs.read_file" in v.attempted
    finally:
        task.cancel()
        await asyncio.gather(a.destroy(), b.destroy())


# -- the host's /proc -------------------------------------------------------------------------------

async def test_the_hosts_processes_are_not_in_a_sandboxs_proc(fleet, platform):
    sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        launcher = platform.service_pid("launcher")
        r = await sb.exec(["cat", f"/proc/{launcher}/environ", f"/proc/{launcher}/cmdline"])
        assert r.exit_code != 0 and b"No such file" in r.stderr
        pids = [int(p) for p in (await sb.exec(["ls", "/proc"])).stdout.split() if p.isdigit()]
        assert 1 in pids and all(p < 100 for p in pids)  # its own pid namespace, nothing else
        assert (await sb.exec(["cat", "/proc/1/cmdline"])).stdout == b"catatonit\0-P\0"
    finally:
        await sb.destroy()


@pytest.mark.parametrize("root", ["host view", "layers"])
async def test_kpagecgroup_reads_nothing_in_a_sandbox(fleet, layers, root):  # noqa: F811
    require(os.path.exists("/proc/kpagecgroup"), "the kernel has /proc/kpagecgroup")
    with open("/proc/kpagecgroup", "rb") as f:
        assert f.read(8)  # the host's file has data: the mask is what empties it
    if root == "layers":
        sb = await fleet.create(memory_mb=64, layers=LAYERS)
    else:
        sb = await fleet.create(memory_mb=64, host_view=True)
    try:
        for name in ("kpagecgroup", "kpageflags", "kpagecount"):
            r = await sb.exec(["sh", "-c", f"head -c 64 /proc/{name} | od -An -tx1"])
            assert r.exit_code == 0 and r.stdout.strip() == b"", (name, r)
    finally:
        await sb.destroy()


# -- the agent's reading of audit records ---------------------------------------------------------

async def test_the_records_of_one_denial_become_one_event_with_its_process_and_command_line():
    from agents.node.audit import EOE, LANDLOCK_ACCESS, LANDLOCK_DOMAIN, PROCTITLE, SYSCALL, DenialReader

    got = []

    async def deliver(denial):
        got.append(denial)

    reader = DenialReader(audit=None, deliver=deliver)
    title = b"sh\0-c\0cat /x y".hex().upper().encode()
    for rtype, text in (
        (LANDLOCK_ACCESS, b'audit(1795949517.936:3): domain=19387c68e blockers=fs.read_file path=2F782079 '
                          b'dev="vda" ino=7'),
        (LANDLOCK_DOMAIN, b"audit(1795949517.936:3): domain=19387c68e status=allocated mode=enforcing pid=9"),
        (SYSCALL, b'audit(1795949517.936:3): arch=c000003e syscall=257 success=no exit=-13 ppid=1 pid=4242 '
                  b'auid=1073741825 uid=0 ses=1 comm="cat" exe="/usr/bin/cat" key=(null)'),
        (SYSCALL, b'audit(1795949517.999:4): arch=c000003e syscall=1 pid=1 auid=7 comm="other"'),  # no denial
        (PROCTITLE, b"audit(1795949517.936:3): proctitle=" + title),
        (EOE, b"audit(1795949517.936:3): "),
    ):
        reader.record(rtype, text)
    await asyncio.sleep(0.05)
    assert len(got) == 1
    d = got[0]
    assert (d.kind, d.pid, d.command, d.auid) == ("file.landlock", 4242, "cat", 1073741825)
    assert d.attempted == 'fs.read_file path=/x y dev=vda ino=7 by: sh -c cat /x y'


async def test_a_denial_without_a_syscall_context_names_its_domain_and_the_domain_its_maker():
    from agents.node.audit import LANDLOCK_ACCESS, LANDLOCK_DOMAIN, DenialReader

    got, makers = [], []

    async def deliver(denial):
        got.append(denial)

    reader = DenialReader(audit=None, deliver=deliver, on_domain=lambda *maker: makers.append(maker))
    # Lone records, one serial each: no SYSCALL, PROCTITLE or EOE follows.
    reader.record(LANDLOCK_ACCESS, b'audit(1795952841.100:14150): domain=19388b36b blockers=fs.make_reg '
                                   b'path="/bin" dev="vda" ino=21')
    reader.record(LANDLOCK_DOMAIN, b'audit(1795952841.100:14151): domain=19388b36b status=allocated '
                                   b'mode=enforcing pid=17408 uid=0 exe="/usr/bin/python3.11" comm="python"')
    reader.record(LANDLOCK_DOMAIN, b"audit(1795952841.180:14152): domain=19388b36b status=deallocated denials=1")
    assert makers == [("19388b36b", 17408, "python")]
    await asyncio.sleep(0.3)  # no EOE: delivered when the flush delay is over
    assert [(d.kind, d.domain, d.pid, d.auid) for d in got] == [("file.landlock", "19388b36b", 0, -1)]


def test_the_audit_tag_of_a_sandbox_is_stable_and_never_a_real_or_unset_uid():
    a = landlock.audit_tag(["/sys/fs/cgroup/memory/sandfleet/n/sb-1/cgroup.procs"])
    assert a == landlock.audit_tag(["/sys/fs/cgroup/memory/sandfleet/n/sb-1/cgroup.procs"])
    assert a != landlock.audit_tag(["/sys/fs/cgroup/memory/sandfleet/n/sb-2/cgroup.procs"])
    assert 0x40000000 <= a < 0x80000000
    from linuxnode import audit

    assert audit.TAG_MIN <= a <= audit.TAG_MAX  # the agent's audit task rules spare exactly this range


def test_the_node_reports_landlock_and_apparmor_as_the_kernel_runs_them(platform):
    require("landlock" in active_lsms(), f"the kernel runs Landlock (its LSMs: {sorted(active_lsms())})")
    mechanisms = platform.mechanisms()
    abi = re.fullmatch(r"on: ABI (\d+), .*", mechanisms["landlock"])
    assert abi, mechanisms["landlock"]
    logged = "" if int(abi[1]) >= 7 else re.escape(" (denials are logged from ABI 7 on)")
    # Denials go to audit; "turned on by the agent" depends on whether another agent of this
    # machine had turned audit on first.
    assert re.fullmatch(
        rf"on: ABI {abi[1]}, process sandboxes and container sandboxes through the exec shim; "
        r"denials on: audit netlink, task rules spare non-sandbox processes a syscall audit context"
        r"( \(audit turned on by the agent: off again when the last agent stops\))?" + logged,
        mechanisms["landlock"]), mechanisms["landlock"]


def test_the_node_reports_apparmor_off_where_the_kernel_runs_none(platform):
    only_where("apparmor" not in active_lsms(), "the kernel runs AppArmor (test_apparmor_profile.py covers it)")
    assert platform.mechanisms()["apparmor"] == ("off: not in this kernel (profiles are generated and validated "
                                                 "offline with apparmor_parser)")

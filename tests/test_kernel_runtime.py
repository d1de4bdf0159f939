"""The kernel layer on the real kernel: cgroups, network namespaces and the `process` runtime.

No mocks: every test starts real sandboxes (a few ms each) and looks at them from both sides.
The module fixture makes this process a child subreaper, and its teardown proves that
nothing is left: no cgroup directory, no /run/netns entry, no mount, no process, no zombie.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import re
import subprocess
import time
from dataclasses import dataclass

import pytest

from linuxnode import cgroups, netns
from linuxnode import syscalls as linux
from linuxnode import process as runtime
from tests.kernel import active_lsms, only_where, require

NODE = f"krt{os.getpid()}"
PREFIX = f"krt{os.getpid()}-"
PR_SET_CHILD_SUBREAPER = 36


def _kernel_gaps() -> list[str]:
    gaps = []
    if os.geteuid() != 0:
        gaps.append("not root")
    try:
        cgroups.CgroupLayout.detect()
    except cgroups.CgroupError as exc:
        gaps.append(str(exc))
    if not os.access(runtime.CATATONIT, os.X_OK):
        gaps.append(f"{runtime.CATATONIT} is not installed")
    root = os.open("/", os.O_PATH)
    try:
        os.close(linux.openat2(root, ".", os.O_RDONLY, 0, linux.RESOLVE_IN_ROOT))
    except OSError as exc:
        gaps.append(f"openat2 with RESOLVE_IN_ROOT: {exc}")
    finally:
        os.close(root)
    return gaps


# -- what the host holds, for the leak check -------------------------------------------------

def _mounts() -> set[tuple[str, str]]:
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            found.add((left.split()[4], right.split()[0]))
    return found


def _processes() -> dict[int, tuple[int, str, str, int]]:
    """pid -> (ppid, state, comm, start time in clock ticks since boot) of every process on the host."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            close = data.rindex(b")")
            fields = data[close + 2:].split()
            found[int(name)] = (int(fields[1]), fields[0].decode(), data[data.index(b"(") + 1:close].decode(),
                                int(fields[19]))
    return found


def _in_our_cgroups(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f"/sandfleet/{NODE}/" in f.read()
    except OSError:
        return False


def _now_ticks() -> int:
    """The clock a process's start time in /proc/PID/stat is read on (boot time, in clock ticks)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _leaks(layout: cgroups.CgroupLayout, mounts_before: set[tuple[str, str]], since: int) -> dict[str, list]:
    """What the module's sandboxes left. A zombie counts if it is a child of the spawner or of this
    process started since the module began (`since`): this process is a subreaper, and the helpers
    an earlier module's platform left to end on their own are adopted by it, theirs not ours."""
    spawner = runtime._spawner.proc.pid if runtime._spawner.proc else None
    procs = _processes()
    left = {
        "cgroup dirs": [d for d in layout.node_dirs(NODE) if os.path.exists(d)],
        "netns": [n for n in netns.list_sandboxes(NODE) if n.startswith(PREFIX)],
        "mounts": sorted(m for m in _mounts() - mounts_before if PREFIX in m[0] or m[0] in ("/tmp", "/")),
        "processes": sorted(p for p in procs if _in_our_cgroups(p)),
        "zombies": sorted(p for p, (ppid, state, _, started) in procs.items()
                          if state == "Z" and (ppid == spawner or (ppid == os.getpid() and started >= since))),
    }
    return {k: v for k, v in left.items() if v}


@pytest.fixture(scope="module")
def layout():
    gaps = _kernel_gaps()
    require(not gaps, "; ".join(gaps))
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    mounts_before = _mounts()
    since = _now_ticks()
    found = cgroups.CgroupLayout.detect()
    yield found
    deadline = time.monotonic() + 5
    while (left := _leaks(found, mounts_before, since)) and time.monotonic() < deadline:
        time.sleep(0.05)
    runtime.shutdown()
    _reap_children()
    # The host's /run/netns stays the shared mount point it was made (as `ip netns` leaves it):
    # other platforms on this host (the other xdist worker's) copy it into each holder and roots
    # namespace they make, and removing it under them failed their confines.
    assert not left, f"the kernel tests left resources behind: {left}"


def _reap_children() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


# -- sandboxes -----------------------------------------------------------------------------

@dataclass
class Sandbox:
    id: str
    cgroups: cgroups.SandboxCgroups
    netns: str
    init: runtime.InitProcess

    async def run(self, *argv: str, **kw) -> runtime.ExecResult:
        return await runtime.exec(self.init, list(argv), cgroup_procs=self.cgroups.procs_files, **kw)

    async def sh(self, script: str, **kw) -> runtime.ExecResult:
        return await self.run("sh", "-c", script, **kw)

    def remove(self) -> None:
        self.cgroups.remove()
        netns.remove(NODE, self.id)
        runtime.kill(self.init)


_counter = iter(range(1_000_000))


def new_sandbox(layout, *, cpu=1.0, memory_mb=256, pids=128, **spec) -> Sandbox:
    sandbox_id = f"{PREFIX}{next(_counter)}"
    group = cgroups.SandboxCgroups(layout, NODE, sandbox_id)
    try:
        group.create(cpu=cpu, memory_mb=memory_mb, pids=pids)
        path = netns.create(NODE, sandbox_id)
        init = runtime.start(runtime.ProcessSpec(sandbox_id=sandbox_id, cgroup_procs=group.procs_files, netns=path,
                                                 **spec))
    except BaseException:
        group.remove()
        netns.remove(NODE, sandbox_id)
        raise
    return Sandbox(sandbox_id, group, path, init)


@pytest.fixture
def sandboxes(layout):
    made: list[Sandbox] = []

    def make(**kw) -> Sandbox:
        made.append(new_sandbox(layout, **kw))
        return made[-1]

    yield make
    for sandbox in made:
        sandbox.remove()
    cgroups.remove_node_root(layout, NODE)


@pytest.fixture
def sandbox(sandboxes):
    return sandboxes()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


# -- cgroups -----------------------------------------------------------------------------------

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_cgroup_layout_is_read_from_mountinfo_for_both_hybrid_and_unified_hosts():
    hybrid = cgroups.CgroupLayout.from_mountinfo(HYBRID)
    assert hybrid.mode == "hybrid"
    assert hybrid.v1 == {"cpu": "/sys/fs/cgroup/cpu,cpuacct", "memory": "/sys/fs/cgroup/memory",
                         "pids": "/sys/fs/cgroup/pids"}
    group = cgroups.SandboxCgroups(hybrid, "n1", "s1")
    assert group.v2_dir == "/sys/fs/cgroup/unified/sandfleet/n1/s1"
    assert group.procs_files == [f"{root}/sandfleet/n1/s1/cgroup.procs" for root in (
        "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified")]
    unified = cgroups.CgroupLayout.from_mountinfo(UNIFIED)
    assert (unified.mode, unified.v1) == ("unified", {})
    assert cgroups.SandboxCgroups(unified, "n1", "s1").procs_files == ["/sys/fs/cgroup/sandfleet/n1/s1/cgroup.procs"]
    with pytest.raises(cgroups.CgroupError):
        cgroups.CgroupLayout.from_mountinfo(HYBRID.replace("cgroup2 cgroup2", "tmpfs tmpfs"))


async def test_limits_are_written_and_every_sandbox_process_is_in_every_cgroup(layout, sandboxes):
    box = sandboxes(cpu=0.5, memory_mb=96, pids=50)
    if layout.mode == "hybrid":
        d = {ctrl: f"{root}/sandfleet/{NODE}/{box.id}" for ctrl, root in layout.v1.items()}
        assert _read(f"{d['memory']}/memory.limit_in_bytes") == str(96 << 20)
        assert _read(f"{d['cpu']}/cpu.cfs_quota_us") == "50000"
        assert _read(f"{d['cpu']}/cpu.cfs_period_us") == "100000"
        assert _read(f"{d['pids']}/pids.max") == "50"
    else:
        assert _read(f"{box.cgroups.v2_dir}/memory.max") == str(96 << 20)
        assert _read(f"{box.cgroups.v2_dir}/cpu.max") == "50000 100000"
    command = asyncio.ensure_future(box.run("sleep", "2", timeout_s=0.3))
    while len(box.cgroups.pids()) < 3:  # init, the exec helper, sleep
        await asyncio.sleep(0.005)
    members = [set(map(int, _read(f).split())) for f in box.cgroups.procs_files]
    assert all(m == members[0] for m in members) and box.init.pid in members[0]
    assert len(members[0]) >= 3
    assert (await command).timed_out


async def test_memory_limit_kills_a_process_that_exceeds_it(layout, sandboxes):
    box = sandboxes(memory_mb=64)
    result = await box.sh("head -c 300M /dev/zero | tail")
    assert result.exit_code != 0
    assert runtime.is_alive(box.init)  # only the offender died
    if layout.mode == "hybrid":
        oom = dict(line.split() for line in _read(
            f"{layout.v1['memory']}/sandfleet/{NODE}/{box.id}/memory.oom_control").splitlines())
        assert int(oom["oom_kill"]) >= 1
    assert (await box.run("true")).exit_code == 0


async def test_pids_limit_stops_a_fork_bomb(sandboxes):
    box = sandboxes(pids=12)
    result = await box.sh("i=0; while [ $i -lt 40 ]; do sleep 3 & i=$((i+1)); done; wait", timeout_s=5)
    assert result.exit_code != 0 and not result.timed_out
    assert b"fork" in result.stderr.lower()
    assert len(box.cgroups.pids()) <= 12


# -- what a sandbox can see ------------------------------------------------------------------

async def test_a_sandbox_sees_only_its_init_and_itself(sandbox):
    result = await sandbox.run("python3", "-c", "import os; print(sorted(int(p) for p in os.listdir('/proc') "
                                                "if p.isdigit()), os.getpid(), os.getppid())")
    assert result.exit_code == 0, result.stderr
    pids, me, parent = result.stdout.decode().rsplit(" ", 2)
    assert eval(pids) == sorted({1, int(me)})
    assert int(parent) == 0  # its parent, the exec helper, lives outside the pid namespace


async def test_host_directories_and_files_are_absent(sandbox):
    marker = f"/tmp/{PREFIX}host-marker"
    with open(marker, "w") as f:
        f.write("host")
    try:
        result = await sandbox.sh(
            f"for d in /root /home /srv /var /work /opt /boot /mnt /run /sys {marker}; do "
            "[ -e $d ] && echo present $d; done; ls -A /tmp; ls /; ls /etc; cat /proc/mounts")
    finally:
        os.unlink(marker)
    out = result.stdout.decode()
    words = set(out.split())
    assert "present" not in out, out
    assert {"bin", "dev", "etc", "proc", "tmp", "usr", "workspace"} <= words
    assert not words & {"work", "home", "root", "var", "srv", "shadow", os.path.basename(marker)}
    mounted = {line.split()[1] for line in out.splitlines() if line.count(" ") == 5}
    allowed = {"/", "/usr", "/etc/ssl/certs", "/etc/alternatives", "/etc/ld.so.cache", "/dev", "/dev/pts", "/dev/shm",
               "/proc", "/tmp", "/workspace"}
    assert mounted - allowed <= {f"/proc/{name}" for name in os.listdir("/proc")}, mounted


async def test_usr_root_etc_dev_and_proc_are_read_only(sandbox):
    for target in ("/usr/x", "/x", "/etc/x", "/dev/x", "/proc/x"):
        result = await sandbox.run("touch", target)
        assert result.exit_code != 0, target
        assert b"Read-only file system" in result.stderr or b"No such file" in result.stderr, result.stderr
    for script in ("echo x > /proc/sys/kernel/hostname", "chmod 000 /dev/null", "chmod 777 /proc/cpuinfo"):
        assert (await sandbox.sh(script)).exit_code != 0, script
    assert os.stat("/dev/null").st_mode & 0o777 == 0o666
    with pytest.raises(PermissionError):
        runtime.write_file(sandbox.init, "/usr/lib/planted", b"x")
    with pytest.raises(PermissionError):
        runtime.write_file(sandbox.init, "/etc/passwd", b"x")


async def test_workspace_and_tmp_are_writable_and_private_to_each_sandbox(sandboxes):
    one, two = sandboxes(), sandboxes()
    assert (await one.sh("echo a > /workspace/f && echo b > /tmp/f && echo c > /dev/shm/f")).exit_code == 0
    assert (await one.sh("cat /workspace/f /tmp/f /dev/shm/f")).stdout == b"a\nb\nc\n"
    result = await two.sh("ls -A /workspace /tmp /dev/shm")
    assert result.stdout.split() == [b"/dev/shm:", b"/tmp:", b"/workspace:"]


async def test_hostname_is_set_in_the_sandbox_only(sandboxes):
    assert (await sandboxes().run("hostname")).stdout == b"sandbox\n"
    assert (await sandboxes(hostname="box-7").sh("hostname; grep box-7 /etc/hosts")).stdout.startswith(b"box-7\n127")
    assert os.uname().nodename not in ("sandbox", "box-7")


async def test_only_loopback_exists_and_it_is_up(sandbox):
    result = await sandbox.sh("tail -n +3 /proc/net/dev | cut -d: -f1")
    assert result.stdout.split() == [b"lo"]
    result = await sandbox.run("python3", "-c", "import socket\n"
                               "s = socket.create_server(('127.0.0.1', 0)); socket.create_connection(s.getsockname())\n"
                               "print(open('/proc/net/route').read().count('\\n'))")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"1\n"  # a header and no route: nothing but loopback


# -- exec ---------------------------------------------------------------------------------

async def test_exec_runs_in_workspace_with_default_and_given_environment(sandbox):
    result = await sandbox.sh('pwd; echo "$HOME|$LANG|$FOO|$PATH"', env={"FOO": "bar"})
    assert result.stdout.decode().splitlines() == [
        "/workspace", f"/workspace|C.UTF-8|bar|{runtime.DEFAULT_ENV['PATH']}"]
    assert (await sandbox.run("pwd", cwd="/tmp")).stdout == b"/tmp\n"


async def test_exit_codes_stdout_and_stderr(sandbox):
    result = await sandbox.sh("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert not result.timed_out and not result.truncated
    missing = await sandbox.run("no-such-command", "x")
    assert missing.exit_code == 127 and b"no-such-command: command not found" in missing.stderr
    assert (await sandbox.run("/workspace/nope")).exit_code == 127
    assert (await sandbox.run("/etc")).exit_code == 126
    assert (await sandbox.sh("kill -9 $$")).exit_code == 128 + 9


async def test_large_argv_and_environment_reach_the_command(sandbox):
    words = ["x" * 100_000, "y" * 100_000]
    result = await sandbox.run("sh", "-c", 'printf %s "$1" | wc -c; printf %s "$BIG" | wc -c', "sh", *words,
                               env={"BIG": "z" * 50_000})
    assert result.stdout.split() == [b"100000", b"50000"], result.stderr


async def test_stdin_reaches_the_command(sandbox):
    assert (await sandbox.run("cat", stdin=b"hello\n")).stdout == b"hello\n"
    big = os.urandom(1 << 20)
    result = await sandbox.sh("sha256sum | cut -c1-64", stdin=big)
    assert result.stdout.strip().decode() == hashlib.sha256(big).hexdigest()
    assert (await sandbox.run("true", stdin=big)).exit_code == 0  # unread stdin is not an error


async def test_timeout_kills_the_command_and_its_children(sandbox):
    result = await sandbox.sh("sleep 30 & sleep 31 & echo started; wait", timeout_s=0.5)
    assert result.timed_out and result.exit_code == 137 and result.stdout == b"started\n"
    deadline = time.monotonic() + 2
    while len(sandbox.cgroups.pids()) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert sandbox.cgroups.pids() == [sandbox.init.pid]


async def test_cancelled_exec_kills_its_command(sandbox):
    task = asyncio.ensure_future(sandbox.run("sleep", "30"))
    while len(sandbox.cgroups.pids()) < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 2
    while len(sandbox.cgroups.pids()) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert sandbox.cgroups.pids() == [sandbox.init.pid]


async def test_stopping_the_spawner_ends_running_execs_but_not_the_sandbox(sandbox):
    task = asyncio.ensure_future(sandbox.run("sleep", "30"))
    while len(sandbox.cgroups.pids()) < 3:
        await asyncio.sleep(0.005)
    runtime.shutdown()  # what happens to in-flight execs when the launcher stops or dies
    result = await asyncio.wait_for(task, 5)
    assert result.exit_code == 128 + 9
    assert runtime.is_alive(sandbox.init)
    assert (await sandbox.run("echo", "again")).stdout == b"again\n"  # served by a new spawner


async def test_output_is_truncated_at_max_output_and_the_command_still_finishes(sandbox):
    result = await sandbox.sh("head -c 300000 /dev/zero; echo done >&2", max_output=1000)
    assert (len(result.stdout), result.stderr, result.truncated, result.exit_code) == (1000, b"done\n", True, 0)


async def test_concurrent_execs_in_one_sandbox(sandbox):
    results = await asyncio.gather(*(sandbox.sh(f"echo {i}") for i in range(20)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(20)]


async def test_exec_errors_missing_cwd_and_dead_sandbox(sandboxes):
    box = sandboxes()
    with pytest.raises(FileNotFoundError):
        await box.run("true", cwd="/nope")
    runtime.kill(box.init)
    assert not runtime.is_alive(box.init)
    with pytest.raises(runtime.ExecError):
        await box.run("true")


# -- files -------------------------------------------------------------------------------

async def test_write_file_and_read_file_round_trip(sandbox):
    assert runtime.write_file(sandbox.init, "/workspace/a.sh", b"#!/bin/sh\necho ran\n", 0o755) == 19
    assert runtime.read_file(sandbox.init, "/workspace/a.sh", 100) == b"#!/bin/sh\necho ran\n"
    assert (await sandbox.run("./a.sh")).stdout == b"ran\n"
    assert (await sandbox.run("stat", "-c", "%a", "a.sh")).stdout == b"755\n"
    runtime.write_file(sandbox.init, "b.txt", b"relative")  # relative to /workspace
    assert runtime.read_file(sandbox.init, "/workspace/b.txt", 100) == b"relative"
    assert runtime.write_file(sandbox.init, "/tmp/empty", b"") == 0
    assert runtime.read_file(sandbox.init, "/tmp/empty", 0) == b""
    with pytest.raises(FileNotFoundError):
        runtime.read_file(sandbox.init, "/workspace/missing", 100)
    with pytest.raises(FileNotFoundError):
        runtime.write_file(sandbox.init, "/workspace/no/dir/f", b"x")
    with pytest.raises(IsADirectoryError):
        runtime.read_file(sandbox.init, "/workspace", 100)
    with pytest.raises(IsADirectoryError):
        runtime.write_file(sandbox.init, "/workspace", b"x")
    with pytest.raises(ValueError):
        runtime.read_file(sandbox.init, "/workspace/a.sh", 5)
    assert runtime.read_file(sandbox.init, "/proc/1/comm", 100) == b"catatonit\n"


async def test_planted_symlinks_and_fifos_never_reach_the_host(sandbox):
    secret = f"/tmp/{PREFIX}secret"
    with open(secret, "w") as f:
        f.write("host secret")
    try:
        script = (f"ln -s {secret} /workspace/abs; ln -s ../../../../../..{secret} /workspace/rel; "
                  "ln -s /etc/shadow /workspace/shadow; ln -s /proc/1/root/etc/hostname /workspace/magic; "
                  "ln -s /proc/self/root /workspace/selfroot; mkfifo /workspace/fifo")
        assert (await sandbox.sh(script)).exit_code == 0
        for name in ("abs", "rel", "shadow", "selfroot/etc/shadow"):
            with pytest.raises(FileNotFoundError):
                runtime.read_file(sandbox.init, f"/workspace/{name}", 1000)
        with pytest.raises(OSError):
            runtime.read_file(sandbox.init, "/workspace/magic", 1000)  # a magic link: refused
        with pytest.raises(ValueError):
            runtime.read_file(sandbox.init, "/workspace/fifo", 1000)  # and it did not block
        # Writing through the link creates the target inside the sandbox, never on the host.
        runtime.write_file(sandbox.init, "/workspace/abs", b"written")
        with open(secret) as f:
            assert f.read() == "host secret"
        assert (await sandbox.run("cat", secret)).stdout == b"written"
        assert runtime.read_file(sandbox.init, "/workspace/rel", 100) == b"written"
        with pytest.raises(PermissionError):
            runtime.write_file(sandbox.init, "/workspace/shadow", b"x")  # the sandbox's /etc is read-only
    finally:
        os.unlink(secret)
    assert os.path.exists("/etc/shadow") and open("/etc/shadow").read() != "x"


# -- privileges --------------------------------------------------------------------------------

async def test_sandbox_root_has_no_capabilities_and_cannot_mount(sandbox):
    caps = (await sandbox.run("grep", "^Cap", "/proc/self/status")).stdout.decode()
    assert re.findall(r"Cap(\w+):\s+(\w+)", caps) == [
        (name, "0000000000000000") for name in ("Inh", "Prm", "Eff", "Bnd", "Amb")]
    assert "NoNewPrivs:\t1" in (await sandbox.run("cat", "/proc/self/status")).stdout.decode()
    assert (await sandbox.run("mount", "-t", "tmpfs", "x", "/tmp")).exit_code != 0
    assert (await sandbox.run("umount", "-l", "/usr")).exit_code != 0
    init_caps = (await sandbox.run("grep", "^CapEff", "/proc/1/status")).stdout
    assert init_caps == b"CapEff:\t0000000000000000\n"


# -- lifecycle -------------------------------------------------------------------------------

async def test_removal_leaves_no_cgroup_netns_process_zombie_or_mount(layout):
    mounts_before = _mounts()
    box = new_sandbox(layout)
    assert box.id in cgroups.list_sandboxes(layout, NODE) and box.id in netns.list_sandboxes(NODE)
    await box.sh("sleep 60 & sleep 60 & echo", timeout_s=5)  # background processes outlive the exec
    assert len(box.cgroups.pids()) == 3
    box.remove()
    box.remove()  # idempotent
    assert not runtime.is_alive(box.init)
    assert box.id not in cgroups.list_sandboxes(layout, NODE) and box.id not in netns.list_sandboxes(NODE)
    assert not any(os.path.exists(d) for d in box.cgroups.dirs)
    assert not os.path.exists(netns.path(NODE, box.id))
    await asyncio.sleep(0.05)  # the spawner reaps the init
    procs = _processes()
    assert box.init.pid not in procs or procs[box.init.pid][1] != "Z"
    assert not [p for p in procs if _in_our_cgroups(p)]
    # Only what names this test's sandboxes, or would cover the host's /tmp or /: others may be
    # making namespaces and mounts on this machine meanwhile.
    assert {m for m in _mounts() - mounts_before if (PREFIX in m[0] or m[0] in ("/tmp", "/"))} == set()
    cgroups.remove_node_root(layout, NODE)
    assert not any(os.path.exists(d) for d in layout.node_dirs(NODE))


def test_netns_is_a_named_iproute2_namespace_with_loopback_up(layout):
    sandbox_id = f"{PREFIX}ns"
    netns._ensure_run_dir()
    with open(netns.path(NODE, sandbox_id), "w"):  # on the host's /run/netns, where an older version bound names
        pass  # an unmounted name, as a crash between creating and mounting leaves it
    assert sandbox_id in netns.list_sandboxes(NODE)
    path = netns.create(NODE, sandbox_id)
    try:
        assert netns.create(NODE, sandbox_id) == path  # idempotent
        holder = ["nsenter", f"--mount={netns.holder_pin(NODE)}"]  # the names' mount namespace
        assert os.path.basename(path) in subprocess.run([*holder, "ip", "netns", "list"], capture_output=True,
                                                        text=True, check=True).stdout
        links = subprocess.run([*holder, "ip", "netns", "exec", os.path.basename(path), "ip", "-o", "link"],
                               capture_output=True, text=True, check=True).stdout.splitlines()
        assert len(links) == 1 and "lo:" in links[0] and ",UP," in links[0]
    finally:
        netns.remove(NODE, sandbox_id)
        netns.remove(NODE, sandbox_id)
    assert not os.path.exists(path) and sandbox_id not in netns.list_sandboxes(NODE)  # the host's leftover too
    assert not netns.exists(NODE, sandbox_id) and NODE not in netns.holders()  # unpinned with its last name


def test_start_failures_name_the_step_and_the_errno(layout, sandboxes):
    box = sandboxes()
    with pytest.raises(runtime.RuntimeStartError, match=r"join cgroups: ENOENT"):
        runtime.start(runtime.ProcessSpec(sandbox_id=f"{PREFIX}bad", cgroup_procs=["/sys/fs/cgroup/nope/cgroup.procs"],
                                          netns=box.netns))
    with pytest.raises(runtime.RuntimeStartError, match="open netns"):
        runtime.start(runtime.ProcessSpec(sandbox_id=f"{PREFIX}bad", cgroup_procs=[], netns="/run/netns/none"))
    assert not runtime.is_alive(runtime.InitProcess(box.init.pid, box.init.start_time + 1))
    assert runtime.is_alive(box.init)


async def test_async_start_and_kill_run_on_the_event_loop_without_blocking_it(layout):
    import asyncio as _asyncio

    ticks: list[float] = []  # when the loop ran another task

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await _asyncio.sleep(0)

    async def timed(call):
        """The call's result, and the longest the loop went without running the ticker during it
        (from the call's start to its end), as a share of the call's whole time."""
        start, first = time.monotonic(), len(ticks)
        result = await call
        end = time.monotonic()
        marks = [start, *ticks[first:], end]
        return result, max(b - a for a, b in zip(marks, marks[1:])) / (end - start)

    sandbox_id = f"{PREFIX}async"
    group = cgroups.SandboxCgroups(layout, NODE, sandbox_id)
    group.create(cpu=0.5, memory_mb=64, pids=64)
    path = netns.create(NODE, sandbox_id)
    task = _asyncio.create_task(ticker())
    await _asyncio.sleep(0)
    try:
        # The spawner builds the init while the loop runs on: a blocking start would hold the loop
        # for (nearly) all of its time, one stall as long as the call.
        init, stalled = await timed(runtime.start_async(runtime.ProcessSpec(
            sandbox_id=sandbox_id, cgroup_procs=group.procs_files, netns=path, tmp_size_mb=8, workspace_size_mb=8)))
        assert runtime.is_alive(init)
        assert stalled < 0.5, f"the loop stood still for {stalled:.0%} of the start"
        assert (await runtime.exec(init, ["true"], cgroup_procs=group.procs_files)).exit_code == 0
        ticked = len(ticks)
        await runtime.kill_async(init)  # too short to split: the loop ran the ticker while it waited
        assert not runtime.is_alive(init)
        assert len(ticks) > ticked
    finally:
        task.cancel()
        group.remove()
        netns.remove(NODE, sandbox_id)
        cgroups.remove_node_root(layout, NODE)


def test_the_helper_sweep_reaps_only_zombie_crun_children_outside_our_session():
    """A crun helper that `detached_helpers` missed (a child of crun's session leader, ours only
    once that leader exited) is reaped by the sweep; a zombie of our own session (one of our
    `crun` commands, whose status its caller still waits for) is left alone. Runs in a child
    interpreter, a subreaper as the launcher is: the sweep reaps children of its caller."""
    import subprocess
    import sys
    script = r"""
import ctypes, os, shutil, subprocess, tempfile, time
from linuxnode.container_exec import DetachedHelpers
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as the launcher
crun = os.path.join(tempfile.mkdtemp(), "crun")
shutil.copy("/bin/sleep", crun)
leader = os.fork()
if leader == 0:  # as crun's session leader: a new session, a helper in it, then gone
    os.setsid()
    if os.fork() == 0:
        os.execv(crun, [crun, "0.2"])
    os._exit(0)
os.waitpid(leader, 0)
own = subprocess.Popen([crun, "0.2"])  # one of our own crun commands, in our session
time.sleep(1.0)  # both have exited: zombies, ours to reap
reaped = DetachedHelpers().sweep()
print(len(reaped), own.pid in reaped, own.wait())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    assert out == ["1", "False", "0"]  # the helper reaped; our own command's status still ours


# -- AppArmor ----------------------------------------------------------------------------

async def test_a_sandbox_and_its_commands_exec_into_the_apparmor_profile_they_are_given(sandboxes):
    """Init and command ask the kernel for the profile at their exec (attr/exec, as crun does).
    This kernel has no AppArmor, so it refuses (EINVAL) and each says so at that step: proof the
    profile the node agent names reaches the kernel, where an AppArmor kernel would apply it."""
    only_where("apparmor" not in active_lsms(), "the kernel runs AppArmor (loading needs a loaded profile)")
    with pytest.raises(runtime.RuntimeStartError, match="set the AppArmor profile"):
        sandboxes(apparmor_profile="sandfleet-x")
    box = sandboxes()
    with pytest.raises(runtime.ExecError, match="set the AppArmor profile"):
        await box.run("true", apparmor="sandfleet-x")
    assert (await box.run("true")).exit_code == 0  # no profile named: nothing asked of the kernel

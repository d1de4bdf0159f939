"""`container` sandboxes against the real platform: real crun, real overlays over EROFS layers,
the node agent's cgroups and network namespace, and the same exec and file API as `process`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import time

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers
from linuxnode import netns
from linuxnode.seccomp import filter_bytes
from schemas.sandbox import State
from tests.kernel import require
from tests.layer_trees import make_busybox_base
from tests.test_layered_sandboxes import overlay_of

BASE = "ct-base"


@pytest.fixture(scope="module")
async def base(fleet, platform, tmp_path_factory):
    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("ct-src") / "base"
    make_busybox_base(src, hostname="ct")
    layers = Layers(fleet.bus)
    await layers.build_dir(BASE, src)
    return layers


def _cgroup_lines(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read().splitlines()


async def _gone(platform, sandbox_id: str, init_pid: int, wait_s: float = 3.0) -> list[str]:
    """What of a destroyed container the machine still holds (after a moment: an init adopted
    by the supervisor after a launcher crash is a zombie until the supervisor's next reap)."""
    deadline = time.monotonic() + wait_s
    while (left := _left(platform, sandbox_id, init_pid)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


def _left(platform, sandbox_id: str, init_pid: int) -> list[str]:
    left = []
    launcher = platform.data_dir / "launcher"
    if (launcher / "crun" / sandbox_id).exists() or (launcher / "bundles" / sandbox_id).exists():
        left.append("crun state or bundle")
    if overlay_of(sandbox_id):
        left.append("overlay")
    if netns.exists(platform.node_id, sandbox_id):
        left.append("netns")
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        if sandbox_id in dirs:
            left.append(f"cgroup {root}/{sandbox_id}")
        if root.count("/") > 5:
            dirs.clear()
    if os.path.exists(f"/proc/{init_pid}"):
        left.append(f"process {init_pid}")
    return left


async def test_the_node_advertises_containers(fleet, base):
    nodes = await fleet.nodes()
    # then `microvm` where QEMU and a built guest are (tests/test_microvm.py)
    assert nodes and all(n.isolation[:2] == ["process", "container"] for n in nodes)


async def test_a_container_runs_commands_and_files_in_its_own_root(fleet, base):
    sb = await fleet.create(isolation="container", memory_mb=128, layers=[BASE])
    try:
        r = await sb.exec(["sh", "-c", "echo hi; echo err >&2; pwd; hostname; cat /etc/hostname; exit 3"])
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"hi\n/workspace\nsandbox\nct\n", b"err\n")
        assert (await sb.exec(["cat", "/proc/1/cmdline"])).stdout == b"/dev/init\0-P\0"
        assert (await sb.exec(["cat", "/proc/self/cgroup"])).stdout.decode().splitlines()[-1] == "0::/"

        await sb.write_file("/workspace/a.txt", b"data")
        assert await sb.read_file("/workspace/a.txt") == b"data"
        assert (await sb.exec(["cat", "a.txt"])).stdout == b"data"
        r = await sb.exec(["sh", "-c", "cat; echo; echo $FOO"], stdin=b"input", env={"FOO": "bar"})
        assert r.stdout == b"input\nbar\n"
        await sb.write_file("/etc/new", b"in the root")  # the root is the container's own overlay
        assert (await sb.exec(["cat", "/etc/new"])).stdout == b"in the root"

        with pytest.raises(errors.NotFound):
            await sb.read_file("/workspace/missing")
        with pytest.raises(errors.NotFound):
            await sb.exec(["true"], cwd="/nowhere")
        r = await sb.exec(["no-such-command"])
        assert r.exit_code == 127 and b"not found" in r.stderr
        top = (await sb.exec(["ls", "/"])).stdout.decode().split()
        assert "bin" in top and "usr" not in top  # the layer, not the host
        listed = (await sb.exec(["ls", "/sys/class/net"])).stdout.split()
        assert listed == [b"lo"]  # its own network namespace
    finally:
        await sb.destroy()


_CONFINEMENT_FIELDS = ("Uid", "Gid", "Groups", "Umask", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                       "NoNewPrivs", "Seccomp", "Seccomp_filters")
_NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")


_libc = ctypes.CDLL(None, use_errno=True)
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT, _PTRACE_SECCOMP_GET_FILTER = 17, 0x4206, 0x4207, 0x420C
_WALL = 0x40000000


def seccomp_programs(pid: int) -> list[bytes]:
    """The classic-BPF programs of every seccomp filter on `pid`, read with ptrace
    (PTRACE_SECCOMP_GET_FILTER: the process is stopped for the read and let go after)."""
    _libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if _libc.ptrace(_PTRACE_SEIZE, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), f"cannot trace {pid}")
    try:
        _libc.ptrace(_PTRACE_INTERRUPT, pid, None, None)
        os.waitpid(pid, _WALL)
        programs = []
        while (n := _libc.ptrace(_PTRACE_SECCOMP_GET_FILTER, pid, len(programs), None)) > 0:
            buf = ctypes.create_string_buffer(n * 8)  # struct sock_filter: 8 bytes an instruction
            _libc.ptrace(_PTRACE_SECCOMP_GET_FILTER, pid, len(programs), buf)
            programs.append(buf.raw)
        return programs
    finally:
        _libc.ptrace(_PTRACE_DETACH, pid, None, None)


def _processes_running(init: int, cmdline: bytes) -> list[int]:
    """Processes in the pid namespace of `init`, other than it, whose command line is `cmdline`."""
    ns, found = os.readlink(f"/proc/{init}/ns/pid"), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != init:
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read() == cmdline and os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        found.append(int(entry))
            except OSError:
                pass  # gone meanwhile
    return found


def _status_fields(text: str) -> dict[str, str]:
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: " ".join(fields[k].split()) for k in _CONFINEMENT_FIELDS}


async def test_an_exec_has_the_confinement_crun_gave_the_init(fleet, base):
    """A command runs without `crun exec` (the spawner joins the container), so it must get what
    crun gave the container's init from the bundle: capabilities, no_new_privs, seccomp, ids,
    umask, rlimits, cgroups and every namespace."""
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    try:
        init = (await fleet.get(sb.id)).init_pid
        script = ("cat /proc/self/status; echo @@; cat /proc/1/status; echo @@; cat /proc/self/cgroup; echo @@; "
                  "cat /proc/1/cgroup; echo @@; cat /proc/self/limits; echo @@; cat /proc/1/limits; echo @@; "
                  f"for ns in {' '.join(_NAMESPACES)}; do busybox readlink /proc/self/ns/$ns; done")
        r = await sb.exec(["sh", "-c", script])
        assert r.exit_code == 0, r
        mine, its, my_cg, its_cg, my_limits, its_limits, my_ns = r.stdout.decode().split("@@\n")
        assert _status_fields(mine) == _status_fields(its)
        assert _status_fields(mine)["CapBnd"] == "0000000000000000"
        assert (_status_fields(mine)["NoNewPrivs"], _status_fields(mine)["Seccomp"]) == ("1", "2")
        assert my_cg == its_cg and my_limits == its_limits
        assert my_ns.split() == [os.readlink(f"/proc/{init}/ns/{ns}") for ns in _NAMESPACES]
        assert sum(sb.id in line for line in _cgroup_lines(init)) >= 2  # they are the sandbox's (v1 and v2)
        # The seccomp programs themselves, instruction for instruction, not only how many.
        busy = asyncio.ensure_future(sb.exec(["sleep", "5"]))
        for _ in range(100):
            children = _processes_running(init, b"sleep\x005\x00")
            if children:
                break
            await asyncio.sleep(0.05)
        programs = seccomp_programs(init)
        # The init has the filter crun compiled from the bundle; a command has the process filter,
        # which is that same program behind a prefix (linuxnode/seccomp.py: it decides the same).
        assert len(programs) == 1 and filter_bytes().endswith(programs[0]) and filter_bytes() != programs[0]
        assert children and [seccomp_programs(p) for p in children] == [[filter_bytes()]] * len(children)
        busy.cancel()
    finally:
        await sb.destroy()


async def test_a_container_runs_in_its_cgroups_and_its_memory_limit_holds(fleet, base, platform):
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    try:
        init = (await fleet.get(sb.id)).init_pid
        mine = [line for line in _cgroup_lines(init) if f"sandfleet/{platform.node_id}/{sb.id}" in line]
        assert len(mine) >= 2 and any(line.startswith("0::") for line in mine)  # v1 controllers and v2
        busy = asyncio.ensure_future(sb.exec(["sleep", "2"]))
        await asyncio.sleep(0.5)
        procs = {}
        for line in mine:
            controller, path = line.split(":", 2)[1], line.split(":", 2)[2]
            root = "/sys/fs/cgroup/unified" if controller == "" else f"/sys/fs/cgroup/{controller.split(',')[0]}"
            if not os.path.isdir(root + path):
                root = "/sys/fs/cgroup"
            with open(f"{root}{path}/cgroup.procs") as f:
                procs[controller] = set(f.read().split())
        assert all(len(p) >= 2 and p == procs[""] for p in procs.values())  # the exec joined every one
        await busy

        r = await sb.exec(["dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"])
        assert r.exit_code == 128 + signal.SIGKILL  # killed by the memory cgroup's OOM killer
        r = await sb.exec(["dd", "if=/dev/zero", "of=/dev/null", "bs=8M", "count=1"])
        assert r.exit_code == 0
    finally:
        await sb.destroy()


async def test_a_write_in_one_container_never_reaches_another_or_the_layer(fleet, base, platform):
    a, b = await asyncio.gather(*(fleet.create(isolation="container", memory_mb=64, layers=[BASE]) for _ in range(2)))
    try:
        # The container's own processes may not touch system content (Landlock); the file API may.
        assert (await a.exec(["rm", "/bin/sh"])).exit_code != 0
        await a.write_file("/bin/evil", b"#!/bin/busybox sh\necho evil\n", mode=0o755)
        assert (await a.exec(["/bin/evil"])).stdout == b"evil\n"
        assert (await b.exec(["sh", "-c", "echo fine; test -e /bin/evil || echo no"])).stdout == b"fine\nno\n"
        digest = (await base.get(BASE)).digest.removeprefix("sha256:")
        assert os.readlink(platform.roots_path(platform.data_dir / "layer-cache" / "mnt" / digest / "bin" / "sh")) == "busybox"
    finally:
        await asyncio.gather(a.destroy(), b.destroy())


async def test_an_exec_timeout_kills_the_command_and_everything_it_started(fleet, base):
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    try:
        r = await sb.exec(["sh", "-c", "sleep 30 & sleep 31"], timeout_s=0.5)
        assert r.timed_out and r.exit_code == 128 + signal.SIGKILL
        left = (await sb.exec(["ps", "-o", "args"])).stdout.decode()
        assert "sleep" not in left
    finally:
        await sb.destroy()


async def test_destroy_leaves_no_overlay_crun_state_cgroup_netns_or_process(fleet, base, platform):
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    init = (await fleet.get(sb.id)).init_pid
    await sb.exec(["sh", "-c", "sleep 100 &"])  # a background process, left to the init
    record = await sb.destroy()
    assert record.state is State.STOPPED
    assert await _gone(platform, sb.id, init) == []


async def test_a_container_without_layers_is_refused_with_the_reason(fleet, base):
    with pytest.raises(errors.InvalidRequest, match="no layers given and no default layers"):
        await fleet.create(isolation="container", memory_mb=64)
    with pytest.raises(errors.InvalidRequest, match="a container has no host view"):
        await fleet.create(isolation="container", memory_mb=64, host_view=True)


async def test_a_restarted_launcher_keeps_its_containers(fleet, base, platform):
    keep = await fleet.create(isolation="container", memory_mb=64, layers=[BASE])
    await keep.write_file("/workspace/state", b"before")
    old = platform.service_pid("launcher")
    os.kill(old, signal.SIGKILL)
    await platform.restarted(fleet, "launcher", old)
    assert (await keep.exec(["cat", "/workspace/state"])).stdout == b"before"
    init = (await fleet.get(keep.id)).init_pid
    await keep.destroy()
    assert await _gone(platform, keep.id, init) == []

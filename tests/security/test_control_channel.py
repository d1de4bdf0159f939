"""Red team: there is no control channel inside a sandbox to forge.

The published system this platform answers caught agents forging RPC calls to an
in-sandbox session agent and reading that agent's logs. Here nothing of the platform runs
or listens inside a sandbox: exec is a process the spawner forks on the host that enters
the sandbox's namespaces with setns() (crun exec does the same for containers) and whose
only link to the launcher is the command's own stdio pipes; read_file/write_file open
paths from the host with openat2(RESOLVE_IN_ROOT) under /proc/<init>/root; the spawner
talks to the launcher over an unnamed socketpair; the bus is TCP on the host's loopback.
So there is no peer to authenticate and no rejection to report: these tests prove, from
inside real sandboxes, that there is nothing to connect to. Each survey also runs a
control (a listener the sandbox opens itself, a socket the host can reach) so that a
survey which saw nothing because it could not look would fail.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from sandfleet import errors
from linuxnode import cgroups, veth
from sandfleet.layers_client import Layers
from tests.kernel import require
from tests.layer_trees import make_busybox_base

pytestmark = pytest.mark.kernel

LISTENING = 0x00010000  # __SO_ACCEPTCON in /proc/net/unix's Flags column
TCP_LISTEN = "0A"
STREAM, SEQPACKET = 1, 5

# Runs inside the sandbox with only the standard library: what it can see and reach.
INSPECT = r'''
import json, os, socket, sys

args = json.loads(sys.argv[1])

def rows(name):
    try:
        with open("/proc/net/" + name) as f:
            return [line.split() for line in f.read().splitlines()[1:]]
    except OSError as exc:
        return [["error", str(exc.errno)]]

def survey():
    tcp = rows("tcp") + rows("tcp6")
    return {
        "tcp_listen": [r[1] for r in tcp if len(r) > 3 and r[3] == "0A"],
        "tcp": [r[1] + " " + r[2] for r in tcp],
        "udp": [r[1] for r in rows("udp") + rows("udp6")],
        "raw": [r[1] for r in rows("raw") + rows("raw6")],
        "unix": [{"flags": int(r[3], 16), "type": int(r[4], 16), "path": r[7] if len(r) > 7 else ""}
                 for r in rows("unix") if len(r) > 6],
        "interfaces": [n for _, n in socket.if_nameindex()],
    }

def processes():
    found = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            comm = open("/proc/%s/comm" % pid).read().strip()
            ppid = int(open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()[1])
            fds = {}
            for fd in os.listdir("/proc/%s/fd" % pid):
                try:
                    fds[fd] = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                except OSError as exc:
                    fds[fd] = "error %d" % exc.errno
        except OSError as exc:
            found.append({"pid": int(pid), "error": exc.errno})
            continue
        found.append({"pid": int(pid), "comm": comm, "ppid": ppid, "fds": fds, "self": int(pid) == os.getpid()})
    return found

def connect_unix(address, kind):
    with socket.socket(socket.AF_UNIX, kind) as s:
        try:
            s.connect(address)
            return 0
        except OSError as exc:
            return exc.errno

def connect_tcp(host, port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect((host, port))
            return 0
        except socket.timeout:
            return "timeout"
        except OSError as exc:
            return exc.errno

def exists(path):
    try:
        os.lstat(path)
        return 0
    except OSError as exc:
        return exc.errno

out = {"before": survey(), "processes": processes()}
out["abstract"] = {name: connect_unix("\0" + name, kind) for name, kind in args["abstract"]}
out["paths"] = {path: exists(path) for path in args["paths"]}
out["unix_paths"] = {path: connect_unix(path, socket.SOCK_STREAM) for path in args["paths"]}
out["tcp"] = [connect_tcp(h, p) for h, p in args["tcp"]]
# The control: what the sandbox opens itself shows up in the same survey and connects.
with socket.socket() as t, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
    t.bind(("127.0.0.1", 0))
    t.listen()
    u.bind("\0sandfleet-control-" + str(os.getpid()))
    u.listen()
    out["control"] = {"survey": survey(), "port": t.getsockname()[1],
                      "abstract": connect_unix("\0sandfleet-control-" + str(os.getpid()), socket.SOCK_STREAM),
                      "tcp": connect_tcp("127.0.0.1", t.getsockname()[1])}
print(json.dumps(out))
'''


def _host_unix_listeners() -> list[tuple[str, int]]:
    """Every named listening unix socket in the host's network namespace (abstract ones as
    '@name'), with its type: whatever the platform or anyone else on the node serves."""
    found = []
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            if len(cols) > 7 and int(cols[3], 16) & LISTENING:
                found.append((cols[7], int(cols[4], 16)))
    return found


@pytest.fixture
def host_sockets(platform):
    """A listening abstract socket and a filesystem socket in the platform's data dir, on the
    host, standing for any the platform might ever serve; the host reaches both."""
    abstract = f"sandfleet-redteam-{os.getpid()}"
    path = str(platform.data_dir / "redteam.sock")
    a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    a.bind("\0" + abstract)
    a.listen()
    p = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    p.bind(path)
    p.listen()
    for address in ("\0" + abstract, path):  # the control: from the host they answer
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(address)
    yield abstract, path
    a.close()
    p.close()
    os.unlink(path)


async def _targets(platform, abstract: str, path: str) -> dict:
    listeners = _host_unix_listeners()
    assert ("@" + abstract, STREAM) in listeners and (path, STREAM) in listeners, listeners
    names = [(name[1:], kind if kind in (STREAM, SEQPACKET) else STREAM) for name, kind in listeners
             if name.startswith("@")]
    files = [name for name, _ in listeners if not name.startswith("@")]
    logs = sorted(str(p) for p in (platform.data_dir / "logs").glob("*.log"))
    assert {"launcher.log", "agent.log", "nats.log"} <= {Path(p).name for p in logs}, logs
    nats_port = int(platform.url.rsplit(":", 1)[1])
    node_addresses = sorted({str(a) for a in await asyncio.to_thread(veth.host_addresses) if a.version == 4 and not a.is_loopback})
    return {
        "abstract": names,
        "paths": sorted({*files, *logs, str(platform.data_dir), str(platform.data_dir / "launcher"), "/run/netns",
                         "/run/crun", "/var/run/netns"}),
        "tcp": [("127.0.0.1", nats_port)] + [(a, nats_port) for a in node_addresses],
        "nats_port": nats_port,
    }


async def _inspect(sb, targets: dict) -> dict:
    r = await sb.exec(["python3", "-c", INSPECT, json.dumps(targets)], timeout_s=60)
    assert r.exit_code == 0, r.stderr.decode()[-2000:]
    return json.loads(r.stdout)


@pytest.fixture
async def sandbox(fleet):
    sb = await fleet.create(memory_mb=128, host_view=True, labels={"task": "control-channel"})
    yield sb
    try:
        await sb.destroy()
    except errors.SandfleetError:
        pass


async def test_nothing_listens_in_a_sandboxs_network_namespace(sandbox, platform, host_sockets):
    seen = await _inspect(sandbox, await _targets(platform, *host_sockets))
    before, control = seen["before"], seen["control"]["survey"]
    assert before["interfaces"] == ["lo"]
    assert before["tcp_listen"] == [] and before["tcp"] == [], before
    assert before["udp"] == [] and before["raw"] == [], before
    assert before["unix"] == [], "no unix socket of any kind exists in the sandbox's netns"
    # The control: the same survey sees what the sandbox opens itself.
    assert len(control["tcp_listen"]) == 1 and control["tcp_listen"][0].endswith(f":{seen['control']['port']:04X}")
    assert [u["path"] for u in control["unix"] if u["flags"] & LISTENING] == [f"@sandfleet-control-{_pid(seen)}"]


def _pid(seen: dict) -> int:
    return next(p["pid"] for p in seen["processes"] if p.get("self"))


async def test_no_platform_process_runs_in_a_sandbox(sandbox, platform, host_sockets):
    seen = await _inspect(sandbox, await _targets(platform, *host_sockets))
    procs = seen["processes"]
    assert [(p["pid"], p["comm"]) for p in procs if not p["self"]] == [(1, "catatonit")], procs
    me = next(p for p in procs if p["self"])
    assert me["comm"] == "python3" and me["ppid"] == 0, "exec enters from outside: its parent is not in the sandbox"
    assert sorted(me["fds"])[:3] == ["0", "1", "2"] and all(me["fds"][fd].startswith("pipe:") for fd in "012")
    assert not [link for link in me["fds"].values() if link.startswith("socket:")], me["fds"]


async def test_no_process_in_a_sandboxs_cgroup_holds_a_socket_even_during_an_exec(sandbox, platform):
    # Seen from the host, which may read every fd: the init, a command in flight and the
    # exec helper that waits for it outside the sandbox's pid namespace (it joined the cgroups).
    procs_file = cgroups.SandboxCgroups(cgroups.CgroupLayout.detect(), platform.node_id, sandbox.id).procs_files[-1]
    running = asyncio.create_task(sandbox.exec(["sleep", "3"]))
    pids: list[str] = []
    for _ in range(250):  # until the command has exec'd: before that the helper's child is still python
        pids = Path(procs_file).read_text().split()
        if len(pids) >= 3 and "sleep" in {_comm(pid) for pid in pids}:
            break
        await asyncio.sleep(0.01)
    links = {}
    for pid in pids:
        comm = _comm(pid)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:  # a short-lived helper already gone
            continue
        for fd in fds:
            try:
                links[f"{pid}:{comm}:{fd}"] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile
                pass
    assert (await running).exit_code == 0
    comms = {key.split(":")[1] for key in links}
    assert {"catatonit", "sleep"} <= comms and len(pids) >= 3, (pids, links)
    assert not [k for k, link in links.items() if link.startswith("socket:")], links


async def test_platform_sockets_abstract_or_on_disk_are_unreachable_from_a_sandbox(sandbox, platform, host_sockets):
    targets = await _targets(platform, *host_sockets)
    seen = await _inspect(sandbox, targets)
    abstract, path = host_sockets
    assert (abstract, STREAM) in [tuple(t) for t in targets["abstract"]]
    assert seen["abstract"] and set(seen["abstract"].values()) == {errno.ECONNREFUSED}, seen["abstract"]
    assert seen["unix_paths"][path] == errno.ENOENT
    assert seen["control"]["abstract"] == 0, "an abstract socket in the sandbox's own netns does connect"


async def test_the_platforms_logs_data_and_state_are_not_visible_in_a_sandbox(sandbox, platform, host_sockets):
    targets = await _targets(platform, *host_sockets)
    seen = await _inspect(sandbox, targets)
    assert all(os.path.exists(p) for p in targets["paths"] if "netns" not in p and "crun" not in p)
    assert seen["paths"] and set(seen["paths"].values()) == {errno.ENOENT}, seen["paths"]


async def test_the_nats_port_is_unreachable_from_a_sandbox(sandbox, platform, host_sockets):
    targets = await _targets(platform, *host_sockets)
    seen = await _inspect(sandbox, targets)
    loopback, *node = seen["tcp"]
    assert loopback == errno.ECONNREFUSED, "the sandbox's loopback is its own: nothing listens on the bus port"
    assert node and all(r in (errno.EPERM, errno.ENETUNREACH) for r in node), seen["tcp"]
    assert seen["control"]["tcp"] == 0, "a listener on the sandbox's own loopback does connect"
    with socket.create_connection(("127.0.0.1", targets["nats_port"]), timeout=5):
        pass  # the control: the bus is up and listening on the host


# -- containers: the same survey with busybox (no python in the image) --------------------------

CT_BASE = "cc-base"
CT_SURVEY = ("cat /proc/net/tcp /proc/net/tcp6 /proc/net/udp /proc/net/udp6 /proc/net/unix; echo ==; "
             "for p in /proc/[0-9]*; do echo \"$p $(cat $p/comm) $(ls -l $p/fd/ 2>&1 | grep -c socket:)\"; done; "
             "echo ==; for f in \"$@\"; do if [ -e \"$f\" ]; then echo \"$f present\"; fi; done")


@pytest.fixture(scope="module")
async def ct_base(fleet, tmp_path_factory):
    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(os.path.exists("/bin/busybox"), "busybox-static at /bin/busybox")
    src = tmp_path_factory.mktemp("cc-src") / "base"
    make_busybox_base(src, hostname="cc")
    await Layers(fleet.bus).build_dir(CT_BASE, src)
    return CT_BASE


async def test_a_container_has_no_listener_no_platform_process_and_no_platform_files(fleet, ct_base, platform,
                                                                                    host_sockets):
    targets = await _targets(platform, *host_sockets)
    sb = await fleet.create(isolation="container", memory_mb=64, layers=[ct_base])
    try:
        r = await sb.exec(["/bin/sh", "-c", CT_SURVEY, "sh", *targets["paths"]], timeout_s=60)
        assert r.exit_code == 0, r.stderr
        tables, procs, present = r.stdout.decode().split("==\n")
        rows = [line.split() for line in tables.splitlines()]
        assert all(cols[0] in ("sl", "Num") for cols in rows), f"sockets in the container's netns:\n{tables}"
        assert sum(cols[0] == "Num" for cols in rows) == 1, "the survey read /proc/net/unix"
        lines = [line.split() for line in procs.splitlines()]
        assert lines[0][:2] == ["/proc/1", "init"], "pid 1 is catatonit, bound at /dev/init"
        assert {cols[1] for cols in lines[1:]} <= {"sh", "cat", "ls", "grep"}, "only the command's own processes"
        assert all(cols[2] == "0" for cols in lines), lines
        assert present == "", f"platform paths visible in the container: {present}"
    finally:
        await sb.destroy()


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""

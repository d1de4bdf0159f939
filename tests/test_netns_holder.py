"""Network namespace names on the real kernel (linuxnode.netns): bound in the node's holder, a
mount namespace pinned on the host, so the host's mount table and every mount namespace made
from it later hold none of them; opened through the holder from any process; outliving the
process that made them (a restarted agent finds them); the holder unpinned with its last name;
SANDFLEET_NETNS=host keeping them on the host's /run/netns as before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from linuxnode import netns
from linuxnode import syscalls as linux
from tests.kernel import require

NODE = f"krt{os.getpid()}nh"  # tests/conftest.py SESSION_NODES: a leak of it fails the session


def _points(mountinfo: str) -> list[str]:
    return [line.split()[4] for line in mountinfo.splitlines()]


def _host_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return _points(f.read())


def _new_host_namespace_points() -> list[str]:
    """The table a mount namespace made from the host's now starts with (what `unshare -m` copies)."""
    def copy() -> list[str]:
        linux.unshare(0x200 | linux.CLONE_NEWNS)  # CLONE_FS | CLONE_NEWNS: this thread only
        with open("/proc/thread-self/mountinfo") as f:
            return _points(f.read())

    return linux.on_own_thread(copy, "copy")


def _in_holder(*argv: str) -> str:
    return subprocess.run(["nsenter", f"--mount={netns.holder_pin(NODE)}", *argv], capture_output=True,
                          text=True, check=True).stdout


def _in_another_process(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", f"import os, sys; from linuxnode import netns; {code}"],
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode in (0, -9), out.stderr
    return out.stdout


@pytest.fixture
def names():
    require(os.geteuid() == 0, "namespaces need root")
    made: list[str] = []
    yield made
    for sandbox in made:
        netns.remove(NODE, sandbox)
    assert netns.list_sandboxes(NODE) == [] and NODE not in netns.holders()
    assert not os.path.exists(netns.holder_pin(NODE))


def test_names_live_in_the_holder_and_no_host_table_holds_them(names):
    names += ["sb-a", "sb-b"]
    paths = [netns.create(NODE, s) for s in names]
    assert paths == [f"/run/netns/sf-{NODE}.{s}" for s in names]  # where they are, inside the holder
    assert netns.list_sandboxes(NODE) == names and NODE in netns.holders()
    ours = [p for p in _host_points() if NODE in p]
    assert ours == [netns.holder_pin(NODE)]  # one mount of the host's per node, whatever it holds
    assert [p for p in _new_host_namespace_points() if NODE in p] == []  # a copy drops mount-namespace pins
    assert not any(os.path.exists(p) for p in paths)  # not on the host's /run/netns
    assert sorted(_in_holder("ip", "netns", "list").split()) == sorted(os.path.basename(p) for p in paths)
    assert sum(f"/run/netns/sf-{NODE}." in p for p in _points(_in_holder("cat", "/proc/self/mountinfo"))) == 2

    # Opened from here through the holder: two namespaces of their own, with loopback up.
    inodes = {os.stat(netns.resolve(p)).st_ino for p in paths}
    assert len(inodes) == 2 and os.stat("/proc/self/ns/net").st_ino not in inodes
    links = subprocess.run(["nsenter", f"--net={netns.resolve(paths[0])}", "ip", "-o", "link"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(links) == 1 and "lo:" in links[0] and ",UP," in links[0]
    fd = netns.open_ns(paths[1])
    os.close(fd)

    netns.remove(NODE, "sb-a")
    assert netns.list_sandboxes(NODE) == ["sb-b"] and NODE in netns.holders()  # pinned while a name is left
    assert not netns.exists(NODE, "sb-a") and netns.exists(NODE, "sb-b")


def test_names_outlive_the_process_that_made_them(names):
    """As a restarted agent finds its sandboxes' names: made by a process killed after (no
    cleanup of its own ran), they are found, opened and removed by another."""
    names += ["sb-kept"]
    inode = _in_another_process(f"netns.create({NODE!r}, 'sb-kept'); "
                                f"print(os.stat(netns.resolve(netns.path({NODE!r}, 'sb-kept'))).st_ino); "
                                "sys.stdout.flush(); os.kill(os.getpid(), 9)")
    assert netns.list_sandboxes(NODE) == ["sb-kept"]
    assert os.stat(netns.resolve(netns.path(NODE, "sb-kept"))).st_ino == int(inode)  # the same namespace


def test_a_holder_pinned_again_is_followed(names):
    """This process's view of the holder (the launcher's) follows it when another (the agent)
    removed the last name, which unpinned it, and made a new one."""
    names += ["sb-x", "sb-y"]
    netns.create(NODE, "sb-x")
    assert netns.exists(NODE, "sb-x")  # this process now looks through the holder it made
    old = os.stat(netns.holder_pin(NODE)).st_ino
    _in_another_process(f"netns.remove({NODE!r}, 'sb-x'); netns.create({NODE!r}, 'sb-y')")
    assert os.stat(netns.holder_pin(NODE)).st_ino != old
    assert netns.list_sandboxes(NODE) == ["sb-y"] and netns.exists(NODE, "sb-y") and not netns.exists(NODE, "sb-x")


def test_host_mode_keeps_names_on_the_host(names, monkeypatch):
    monkeypatch.setenv(netns.MODE_ENV, "host")
    names += ["sb-h"]
    path = netns.create(NODE, "sb-h")
    assert path in _host_points() and NODE not in netns.holders()
    assert netns.resolve(path) == path and netns.list_sandboxes(NODE) == ["sb-h"]
    assert os.path.basename(path) in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    netns.remove(NODE, "sb-h")
    assert path not in _host_points() and not os.path.exists(path)


def test_a_name_an_older_version_left_on_the_host_is_found_and_removed(names):
    """Names bound on the host's /run/netns before the holder (an upgrade with sandboxes
    running) are listed with the holder's, opened where they are and removed."""
    names += ["sb-old", "sb-new"]
    os.environ[netns.MODE_ENV] = "host"
    try:
        old = netns.create(NODE, "sb-old")
    finally:
        del os.environ[netns.MODE_ENV]
    netns.create(NODE, "sb-new")
    assert netns.list_sandboxes(NODE) == ["sb-new", "sb-old"]
    assert netns.resolve(old) == old and netns.exists(NODE, "sb-old")
    netns.remove(NODE, "sb-old")
    assert old not in _host_points() and netns.list_sandboxes(NODE) == ["sb-new"]


def test_a_kept_holder_outlasts_its_last_name_until_released(names):
    """The agent keeps its node's holder (no new one per sandbox when they come one at a time)
    and unpins it at a clean stop, only with no name left."""
    names += ["sb-k"]
    netns.keep_holder(NODE)
    try:
        netns.create(NODE, "sb-k")
        assert not netns.release_holder(NODE)  # a name is left: still pinned
        netns.keep_holder(NODE)
        pinned = os.stat(netns.holder_pin(NODE)).st_ino
        netns.remove(NODE, "sb-k")
        assert NODE in netns.holders() and os.stat(netns.holder_pin(NODE)).st_ino == pinned
        netns.create(NODE, "sb-k")
        netns.remove(NODE, "sb-k")
        assert os.stat(netns.holder_pin(NODE)).st_ino == pinned  # the same holder throughout
    finally:
        assert netns.release_holder(NODE)

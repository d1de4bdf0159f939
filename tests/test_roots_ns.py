"""The node's roots namespace on the real kernel (linuxnode.roots_ns): pinned so it outlives
its processes, found again by its pin, holding what is mounted inside away from the host's
table, lending a root out as a detached clone another namespace attaches, ending with its
pin; and a new one without the sandbox mounts the host held when it was copied."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from linuxnode import mount_api, roots_ns
from linuxnode import syscalls as linux
from tests.kernel import require

NODE = f"krt{os.getpid()}rn"  # tests/conftest.py SESSION_NODES: a leak of it fails the session


def _in_thread(fn):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0] if out else None


def _host_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def _inside_points(node: str) -> list[str]:
    return [line.split()[4] for line in (roots_ns.read_mountinfo(node) or "").splitlines()]


@pytest.fixture
def pinned():
    require(os.geteuid() == 0, "namespaces need root")
    fd = roots_ns.ensure(NODE)
    yield fd
    os.close(fd)
    roots_ns.remove(NODE)
    assert roots_ns.open_pinned(NODE) is None and not os.path.exists(roots_ns.pin_path(NODE))


def _mount_inside(ns_fd: int, target: Path, source: str = "inside") -> None:
    def run() -> None:
        roots_ns.enter(ns_fd)
        linux.mount(source, str(target), "tmpfs", 0, "size=64k")
        (target / "hello").write_text("from inside")

    _in_thread(run)


def test_a_mount_inside_stays_out_of_the_host_table_and_is_lent_as_a_clone(pinned, tmp_path):
    target = tmp_path / "root"
    target.mkdir()
    _mount_inside(pinned, target)
    assert str(target) not in _host_points() and not (target / "hello").exists()
    assert str(target) in _inside_points(NODE)
    again = roots_ns.ensure(NODE)  # found by its pin: the same namespace
    try:
        assert os.fstat(again).st_ino == os.fstat(pinned).st_ino
    finally:
        os.close(again)

    view = roots_ns.RootsView(NODE)
    try:
        assert Path(view.path(str(target / "hello"))).read_text() == "from inside"
        assert str(target) in [line.split()[4] for line in view.mountinfo().splitlines()]
        tree = view.clone(str(target))
        try:
            def attach() -> str:  # a sandbox's private namespace, as an init's
                linux.unshare(roots_ns.CLONE_FS | linux.CLONE_NEWNS)
                linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
                stage = tmp_path / "stage"
                stage.mkdir()
                mount_api.attach(tree, str(stage))
                return (stage / "hello").read_text()

            assert _in_thread(attach) == "from inside"
        finally:
            os.close(tree)
    finally:
        view.close()
    assert str(tmp_path / "stage") not in _host_points()


def test_a_view_follows_a_namespace_pinned_again(pinned, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    _mount_inside(pinned, first)
    view = roots_ns.RootsView(NODE)
    try:
        assert Path(view.path(str(first / "hello"))).exists()
        roots_ns.remove(NODE)  # the old namespace ends (no process is in it) with its mounts
        fresh = roots_ns.ensure(NODE)
        try:
            _mount_inside(fresh, second)
        finally:
            os.close(fresh)
        assert Path(view.path(str(second / "hello"))).exists()
        assert not Path(view.path(str(first / "hello"))).exists()
    finally:
        view.close()


def test_a_new_namespace_leaves_the_hosts_sandbox_mounts_behind(tmp_path):
    require(os.geteuid() == 0, "namespaces need root")
    held = tmp_path / "held"
    held.mkdir()
    linux.mount("upper", str(held), "tmpfs", 0, "size=64k")  # as a root's upper dir is mounted
    try:
        fd = roots_ns.ensure(NODE)
        os.close(fd)
        try:
            assert str(held) in _host_points() and str(held) not in _inside_points(NODE)
            assert "/proc" in _inside_points(NODE)  # the rest of the host's table is there
        finally:
            roots_ns.remove(NODE)
    finally:
        linux.umount2(str(held), linux.MNT_DETACH)


def test_network_namespace_names_bound_on_the_host_later_stay_out_of_the_namespace(pinned, monkeypatch):
    """The copy's /run/netns is its own: a name bound on the host after it was made (one per
    sandbox with SANDFLEET_NETNS=host, or `ip netns add`'s) is not copied in, where it would grow
    this table and keep that namespace alive."""
    from linuxnode import netns
    monkeypatch.setenv(netns.MODE_ENV, "host")
    sandbox = "sb-rootsns-name"
    path = netns.create(NODE, sandbox)
    try:
        assert path in _host_points() and path not in _inside_points(NODE)
    finally:
        netns.remove(NODE, sandbox)

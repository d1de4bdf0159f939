"""Sandbox roots are an unprivileged host range (linuxnode.userns), at both namespace levels: the
mapping as the sandbox sees it and as the host does (the owner of its init and of the files it
and the node write), a root-only host file bound in on purpose stays unreadable inside, and
the layers stay one idmapped EROFS mount each however many sandboxes use them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from linuxnode import roots_ns, userns
from tests.conftest import NODE_ID
from tests.kernel import require
from tests.layer_trees import APPLETS, busybox_layer, level_sandbox

LEVELS = ["process", "container"]
ROOT = Path(__file__).resolve().parents[2]
IDS = userns.node_range()  # the platform's: the test's environment is the platform's


async def _base(fleet, tmp_path_factory) -> str:
    return await busybox_layer(fleet, tmp_path_factory, "userns-base", hostname="ct", applets=(*APPLETS, "mkdir"))


@pytest.fixture(params=LEVELS)
async def sb(request, fleet, tmp_path_factory):
    require(IDS is not None, "SANDFLEET_USERNS is not off")
    async with level_sandbox(fleet, request.param, lambda: _base(fleet, tmp_path_factory)) as box:
        yield box


async def _sh(sb, script: str) -> tuple[int, str, str]:
    r = await sb.exec(["sh", "-c", script])
    return r.exit_code, r.stdout.decode(), r.stderr.decode()


async def test_root_inside_is_the_nodes_unprivileged_range_outside(sb):
    code, out, err = await _sh(sb, "cat /proc/self/uid_map /proc/self/gid_map; cat /proc/self/status")
    assert code == 0, err
    maps = [line.split() for line in out.splitlines()[:2]]
    assert maps == [["0", str(IDS.host), str(userns.RANGE)]] * 2
    status = dict(line.split(":", 1) for line in out.splitlines()[2:] if ":" in line)
    assert status["Uid"].split() == ["0"] * 4 and status["Gid"].split() == ["0"] * 4  # root, inside
    assert status["CapEff"].strip() == "0" * 16  # and still without a capability
    code, _, err = await _sh(sb, "echo x > /dev/null && head -c 1 /dev/zero > /dev/null")
    assert code == 0, err  # the node's device nodes are the host root's: open to "others", as they must be

    init = (await sb.info()).init_pid
    assert os.stat(f"/proc/{init}").st_uid == IDS.host  # the init, seen from the host
    assert userns.mapped_root(init) == IDS.host
    with open(f"/proc/{init}/status") as f:
        host_status = dict(line.split(":", 1) for line in f if ":" in line)
    assert host_status["Uid"].split() == [str(IDS.host)] * 4


async def test_files_the_sandbox_and_the_node_write_belong_to_the_mapped_root(sb):
    code, _, err = await _sh(sb, "echo mine > /workspace/by-sandbox && mkdir /workspace/d && ls -ln /workspace")
    assert code == 0, err
    await sb.write_file("/workspace/by-node", b"theirs")
    await sb.write_file("/workspace/d/nested", b"theirs too")
    root = f"/proc/{(await sb.info()).init_pid}/root/workspace"
    for name in ("by-sandbox", "d", "by-node", "d/nested"):
        st = os.stat(f"{root}/{name}")
        assert (name, st.st_uid, st.st_gid) == (name, IDS.host, IDS.host)
    code, out, err = await _sh(sb, "ls -ln /workspace/by-node /workspace/d/nested; echo more >> /workspace/by-node")
    assert code == 0, err  # the node's file is the sandbox root's own: it may change it
    assert [line.split()[2:4] for line in out.splitlines()] == [["0", "0"], ["0", "0"]]


_BIND_IN = """
import os, sys
sys.path.insert(0, sys.argv[1])
from linuxnode import mount_api, userns, syscalls as linux
tree = mount_api.clone_tree(sys.argv[3])  # a detached mount of the host file, taken before leaving the host
root = userns.mapped_root(int(sys.argv[2]))
linux.setns(os.open(f"/proc/{sys.argv[2]}/ns/mnt", os.O_RDONLY), linux.CLONE_NEWNS)  # not its user namespace
with userns.acting_as(root):  # a container's /tmp knows no host uid 0
    os.close(os.open(sys.argv[4], os.O_WRONLY | os.O_CREAT, 0o600))
mount_api.attach(tree, sys.argv[4])
"""


def _bind_into(init: int, host_file: Path, target: str) -> None:
    """Make a host file visible in the sandbox on purpose, as a mistake in a node would: bound
    onto `target` in the sandbox's mount namespace (by a child of ours, not the test process)."""
    subprocess.run([sys.executable, "-c", _BIND_IN, str(ROOT), str(init), str(host_file), target],
                   check=True, timeout=30)


async def test_a_root_only_host_file_bound_in_on_purpose_is_unreadable_inside(sb, tmp_path):
    secret, public = tmp_path / "secret", tmp_path / "public"
    secret.write_text("host secret\n")
    secret.chmod(0o600)  # the host's root's alone: inside, root is not that root
    public.write_text("host public\n")
    public.chmod(0o644)
    init = (await sb.info()).init_pid
    _bind_into(init, secret, "/tmp/secret")
    _bind_into(init, public, "/tmp/public")
    code, out, err = await _sh(sb, "cat /tmp/public; ls -ln /tmp/secret; cat /tmp/secret")
    assert out.splitlines()[0] == "host public"  # the bind is there and works (control)
    assert out.splitlines()[1].split()[2:4] == ["65534", "65534"]  # the host's root: unmapped, nobody
    assert code != 0 and "Permission denied" in err and "host secret" not in out
    code, _, err = await _sh(sb, "chmod 644 /tmp/secret || echo refused >&2")
    assert "refused" in err  # nor may it make the file its own


async def test_each_layer_stays_one_idmapped_mount_for_every_sandbox_on_it(fleet, tmp_path_factory):
    require(IDS is not None, "SANDFLEET_USERNS is not off")
    layer = await _base(fleet, tmp_path_factory)
    boxes = [await fleet.create(memory_mb=64, layers=[layer]) for _ in range(3)]
    try:
        info = [await b.info() for b in boxes]
        roots = roots_ns.read_mountinfo(NODE_ID) or ""  # layers are mounted where roots are composed
        erofs = [line.split() for line in roots.splitlines() if " - erofs " in line and "/layer-cache/mnt/" in line]
        # one per layer, shared by the three roots: never one per sandbox
        points = [m[4] for m in erofs]
        assert points and len(points) == len(set(points))
        for b in boxes:  # the layer's root-owned files are the sandbox root's: it may write where Landlock lets it
            code, out, err = await _sh(b, "ls -lnd /bin/busybox /workspace; echo x > /workspace/mine && cat /workspace/mine")
            assert code == 0, err
            assert [line.split()[2:4] for line in out.splitlines()[:2]] == [["0", "0"], ["0", "0"]]
        for record in info:  # what one wrote went to its own upper dir, owned by the mapped root
            st = os.stat(f"/proc/{record.init_pid}/root/workspace/mine")
            assert (st.st_uid, st.st_gid) == (IDS.host, IDS.host)
    finally:
        for b in boxes:
            await b.destroy()


async def test_a_checkpoint_keeps_the_sandbox_roots_files_its_own_after_restore(fleet, tmp_path_factory):
    """The upper dir holds host ids (1048576+); the checkpoint layer holds them as the sandbox saw
    them, so the restored sandbox, mapped like any, owns what it wrote and may change it."""
    require(IDS is not None, "SANDFLEET_USERNS is not off")
    sb = await fleet.create(memory_mb=64, layers=[await _base(fleet, tmp_path_factory)])
    restored = None
    try:
        code, _, err = await _sh(sb, "mkdir /workspace/d && echo one > /workspace/d/f && chmod 600 /workspace/d/f")
        assert code == 0, err
        restored = await fleet.restore(await sb.checkpoint())
        code, out, err = await _sh(restored, "ls -ln /workspace/d/f; echo two >> /workspace/d/f && cat /workspace/d/f")
        assert code == 0, err
        assert out.splitlines()[0].split()[:4] == ["-rw-------", "1", "0", "0"]
        assert out.splitlines()[1:] == ["one", "two"]
    finally:
        for box in (sb, restored):
            if box is not None:
                await box.destroy()


def test_a_directory_build_gives_the_sandbox_ranges_host_ids_back_their_inside_ids(tmp_path):
    from services.layer_cache.build import unmap_ids

    ids = userns.IdRange(userns.DEFAULT_BASE)
    (tmp_path / "d").mkdir(mode=0o2755)
    (tmp_path / "d" / "f").write_text("x")
    os.symlink("f", tmp_path / "d" / "l")
    (tmp_path / "other").write_text("y")
    os.chown(tmp_path, ids.host, ids.host)
    os.chown(tmp_path / "d", ids.host + 1000, ids.host + 1000)
    os.chmod(tmp_path / "d", 0o2755)
    os.chown(tmp_path / "d" / "f", ids.host, ids.host + 5)
    os.lchown(tmp_path / "d" / "l", ids.host + 7, ids.host + 7)
    os.chown(tmp_path / "other", 1234, ids.host + ids.count)  # outside the range: left as it is
    assert unmap_ids(tmp_path, ids) == 4
    owners = {p: (os.lstat(tmp_path / p).st_uid, os.lstat(tmp_path / p).st_gid) for p in ("", "d", "d/f", "d/l", "other")}
    assert owners == {"": (0, 0), "d": (1000, 1000), "d/f": (0, 5), "d/l": (7, 7), "other": (1234, ids.host + ids.count)}
    assert os.stat(tmp_path / "d").st_mode & 0o7777 == 0o2755  # the setgid bit chown cleared is back

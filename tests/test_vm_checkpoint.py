"""`checkpoint(memory=True)` of a microVM against the real platform: the running machine saved
as a layer over the VM's disks, `fleet.restore` starting a VM from it whose processes go on,
and every bad input to that path refused typed, with nothing left.

Few VMs (TCG is slow): one booted and saved shape state for the module, one VM checkpointed,
one restored from it; the forged states are refused before or by QEMU.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from sandfleet import errors
from sandfleet.config import DEFAULT_EGRESS_SUBNET
from sandfleet.layers_client import Layers
from linuxnode.vm.guest_image import GuestImage, default_dir
from schemas.node import Checkpoint, MachineState
from schemas.sandbox import CreateRequest, SandboxSpec
from tests.kernel import require
from tests.layer_trees import APPLETS, make_busybox_base
from tests.leaks import microvm_left
from tests.vm_shapes import create_vm

LAYER = "vmck-base"
MEMORY_MB = 512
COUNTER = "i=0; while :; do i=$((i+1)); echo $i >> /workspace/count; sleep 0.2; done"


@pytest.fixture(scope="module")
async def guest(fleet, platform, tmp_path_factory) -> GuestImage:
    require(os.geteuid() == 0, "microVMs need root (cgroups, namespaces)")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86 is installed")
    found = GuestImage.find(default_dir())
    require(isinstance(found, GuestImage), f"a built guest ({found})")
    assert isinstance(found, GuestImage)
    src = tmp_path_factory.mktemp("vmck-src") / "base"
    make_busybox_base(src, hostname="vmck", applets=(*APPLETS, "wc", "tail", "seq", "cmp", "uname"))
    await Layers(fleet.bus).build_dir(LAYER, src)
    await (await create_vm(fleet, tries=2, isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)).destroy()
    return found


async def _gone(platform, sandbox_id: str, level: str = "microvm", wait_s: float = 10.0) -> list[str]:
    deadline = asyncio.get_running_loop().time() + wait_s
    while (left := microvm_left(str(platform.data_dir), sandbox_id, level)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return left


async def _lines(sb) -> int:
    r = await sb.exec(["sh", "-c", "cat /workspace/count 2>/dev/null | wc -l"])
    assert r.exit_code == 0, r
    return int(r.stdout)


async def _until_lines(sb, at_least: int, wait_s: float = 60.0) -> int:
    deadline = time.monotonic() + wait_s
    while (n := await _lines(sb)) < at_least:
        assert time.monotonic() < deadline, f"the counter stands at {n} lines"
        await asyncio.sleep(0.3)
    return n


def _qemus_of(platform) -> list[str]:
    """QEMU processes working in this platform's data dir (a VM's directory is their cwd)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(platform.data_dir) + "/"):
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("qemu"):
                        found.append(pid)
        except OSError:
            continue
    return found


def _vm_dirs(platform) -> list[str]:
    vms = Path(platform.data_dir) / "launcher" / "microvm" / "vms"
    return sorted(p.name for p in vms.iterdir()) if vms.exists() else []


async def test_a_memory_checkpoint_restores_a_vm_whose_processes_go_on(fleet, platform, guest):
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB, timeout_s=600)
    ck = await _goes_on(fleet, platform, sb, guest, "pc-i440fx-")
    # The state's layer gone from the store: a restore of the handle is refused, typed.
    await Layers(fleet.bus).remove(ck.name)
    with pytest.raises(errors.NotFound):
        await fleet.restore(ck)
    assert _vm_dirs(platform) == []


async def test_a_full_machine_takes_the_same_path(fleet, platform, guest):
    """`vm` (q35, SeaBIOS, a screen): its driver is the microVM's on another machine, so its memory
    checkpoint is the same, saying its own machine type; its first create boots the shape."""
    from linuxnode.vm import vm_guest

    found = vm_guest.find(default_dir())
    require(isinstance(found, GuestImage), f"a built vm guest ({found})")
    sb = await create_vm(fleet, isolation="vm", layers=[LAYER], memory_mb=MEMORY_MB, timeout_s=600,
                         request_timeout_s=300)
    ck = await _goes_on(fleet, platform, sb, found, "pc-q35-", level="vm")
    await Layers(fleet.bus).remove(ck.name)


async def _goes_on(fleet, platform, sb, guest: GuestImage, machine_type: str, level: str = "microvm") -> Checkpoint:
    """`sb`'s counter goes on in the VM restored from its memory checkpoint; the checkpoint."""
    restored = None
    try:
        await sb.spawn(["sh", "-c", COUNTER])
        await _until_lines(sb, 3)
        ck = await sb.checkpoint(memory=True)
        before = await _lines(sb)  # the original ran on after its save: at least what was saved
        assert ck.processes and ck.machine is not None
        assert ck.machine.level == level and ck.machine.accelerator in ("tcg", "kvm")
        assert ck.machine.guest == guest.digest and ck.machine.size > 1 << 20
        assert ck.machine.machine.startswith(machine_type) and ck.machine.qemu.startswith("QEMU")
        assert len(ck.base) == 1 and ck.digest not in ck.base
        assert (await sb.info()).state == "running"  # saved running, not left paused
    finally:
        await sb.destroy()
    assert await _gone(platform, sb.id, level) == []
    try:
        restored = await fleet.restore(ck, request_timeout_s=120)
        r = await restored.exec(["uname", "-r"])  # a new sandbox, answering
        assert (r.exit_code, r.stdout.decode().strip()) == (0, guest.release)
        after = await _until_lines(restored, before + 3)  # the loop went on counting...
        numbers = (await restored.read_file("/workspace/count")).split()
        assert numbers[:after] == [str(i).encode() for i in range(1, after + 1)]  # ...from where it was
        disks = (await restored.exec(["ls", "/sys/block"])).stdout.split()
        assert [d for d in disks if d.startswith(b"vd")] == [b"vda"]  # the state's layer is no disk
        spawned = await restored.spawn(["sh", "-c", "echo new; exit 5"])  # its own processes work too
        assert (await spawned.wait(timeout_s=60)).exit_code == 5
        assert b"".join([o.data async for o in spawned.output()]) == b"new\n"
        with pytest.raises(errors.InvalidRequest, match="guest RAM"):
            await restored.checkpoint()  # files-only: a VM's writable layer is in RAM
        again = await restored.checkpoint(memory=True)  # of a restored VM: over the same disks
        assert again.base == ck.base
        await Layers(fleet.bus).remove(again.name)
    finally:
        if restored is not None:
            await restored.destroy()
    if restored is not None:
        assert await _gone(platform, restored.id, level) == []
    return ck


def _forged(ck_spec: SandboxSpec, digest: str, machine: MachineState) -> Checkpoint:
    return Checkpoint(sandbox_id="sb-forged", node="any", name="forged", digest=digest, base=[LAYER],
                      spec=ck_spec, processes=True, created_at=0.0, machine=machine)


async def _state_layer(fleet, tmp_path: Path, name: str, state: bytes | None, needs: bytes) -> str:
    src = tmp_path / name
    src.mkdir()
    if state is not None:
        (src / "machine.state").write_bytes(state)
    (src / "machine.json").write_bytes(needs)
    return (await Layers(fleet.bus).build_dir(name, src, on=LAYER)).layer.digest


async def test_a_hostile_machine_state_is_refused_typed_and_leaves_nothing(fleet, platform, guest, tmp_path):
    from linuxnode.vm import machine

    saved = sorted((Path(platform.data_dir) / "launcher" / "microvm" / "states").glob("*.state"),
                   key=lambda p: p.stat().st_mtime)
    assert saved, "the module's shape state"
    real = saved[-1].read_bytes()
    from linuxnode.vm.runtime import MicroVMs

    # What this node's own states need (asked of QEMU as the node asks), so only the forged part differs.
    mine = MicroVMs(guest, machine.detect_accelerator(), machine.qemu_binary() or "", tmp_path / "vms").needs()
    ours = MachineState(level="microvm", machine=mine.machine, accelerator=mine.accelerator, cpu=mine.cpu,
                        qemu=mine.qemu, guest=mine.guest)
    other = "kvm" if mine.accelerator == "tcg" else "tcg"
    spec = SandboxSpec(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
    cases = [
        ("vmck-garbage", os.urandom(1 << 20), msgspec.json.encode(ours), errors.InvalidRequest, "refused"),
        ("vmck-truncated", real[:len(real) // 2], msgspec.json.encode(ours), errors.InvalidRequest, "refused"),
        ("vmck-kvm", real, msgspec.json.encode(msgspec.structs.replace(ours, accelerator=other, cpu="host: X")),
         errors.Unsupported, f"accelerator '{other}'"),
        ("vmck-other-level", real, msgspec.json.encode(msgspec.structs.replace(ours, level="vm")),
         errors.Unsupported, "level 'vm'"),
        ("vmck-bad-needs", real, b'{"level": 1}', errors.InvalidRequest, "machine.json is not one"),
        ("vmck-no-state", None, msgspec.json.encode(ours), errors.InvalidRequest, "no machine state"),
    ]
    for name, state, needs, error, match in cases:
        digest = await _state_layer(fleet, tmp_path, name, state, needs)
        with pytest.raises(error, match=match):
            await fleet.restore(_forged(spec, digest, ours))
        assert _vm_dirs(platform) == [], name
        assert _qemus_of(platform) == [], name
        await Layers(fleet.bus).remove(name)


@pytest.mark.parametrize("isolation", ["process", "container"])
async def test_memory_checkpoints_are_for_vms_only(fleet, platform, guest, isolation):
    sb = await fleet.create(isolation=isolation, layers=[LAYER])
    try:
        with pytest.raises(errors.Unsupported, match=f"isolation '{isolation}' keeps files only"):
            await sb.checkpoint(memory=True)
        assert (await sb.exec(["true"])).exit_code == 0  # and it was not left frozen
    finally:
        await sb.destroy()
    # A machine state named for another level: refused by the spec itself, so by the SDK's restore
    # and by placement's decoding of any create that says so.
    ours = MachineState(level="microvm", machine="m", accelerator="tcg", cpu="c", qemu="q", guest="g")
    with pytest.raises(ValueError, match="VM level"):
        await fleet.restore(_forged(SandboxSpec(isolation="container", layers=[LAYER]), "sha256:x", ours))
    with pytest.raises(msgspec.ValidationError, match="VM level"):
        msgspec.json.decode(b'{"isolation": "process", "layers": ["a", "b"], "machine_state": true}',
                            type=CreateRequest)


# -- on a second node ------------------------------------------------------------------------------

@pytest.fixture
def second_node(platform, tmp_path):
    """A node of its own joining the session's bus (`sandfleet node --nats URL`, as a node on
    another machine joins; here the same machine, so the same CPU), brought down after."""
    from tests.conftest import CLI, NODE_ID, ROOT, assert_nothing_left
    from tests.leaks import Snapshot

    before = Snapshot.take()
    joined, data = f"{NODE_ID}j", tmp_path / "node"
    # The upper half of the session's subnet: its node hands out /30s from the bottom, and the
    # stub addresses (each subnet's first) differ.
    session = ipaddress.IPv4Network(platform.env.get("SANDFLEET_EGRESS_SUBNET") or DEFAULT_EGRESS_SUBNET)
    subnet = list(session.subnets(prefixlen_diff=1))[1]
    out = subprocess.run([*CLI, "node", "--detach", "--nats", platform.url, "--node-id", joined, "--data-dir",
                          str(data), "--egress-subnet", str(subnet)],
                         env=platform.env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    try:
        yield joined, data
    finally:
        state = json.loads((data / "supervisor.json").read_text())
        subprocess.run([*CLI, "down", "--data-dir", str(data)], env=platform.env, timeout=150, check=True, cwd=ROOT)
        try:
            os.waitpid(state["pid"], 0)
        except ChildProcessError:
            pass
    assert_nothing_left(before, data, [joined])


async def test_a_memory_checkpoint_restores_on_another_node(fleet, platform, guest, second_node):
    joined, data = second_node
    dirs = {platform.node_id: str(platform.data_dir), joined: str(data)}
    deadline = time.monotonic() + 60
    while not any(n.id == joined and n.microvm.startswith("on") for n in await fleet.nodes()):
        assert time.monotonic() < deadline, "the joined node never offered microvm"
        await asyncio.sleep(0.5)
    # Placed on the joined node, it boots the shape there first.
    sb = await create_vm(fleet, isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB, timeout_s=600,
                         request_timeout_s=300)
    other = joined if sb.node == platform.node_id else platform.node_id
    try:
        await sb.spawn(["sh", "-c", COUNTER])
        await _until_lines(sb, 3)
        ck = await sb.checkpoint(memory=True, keep_paused=True)  # a migration: the original stops
        assert ck.paused and (await sb.info()).state == "paused"
        await sb.resume()  # and thawed, goes on from where it stood
        before = await _lines(sb)
    finally:
        await sb.destroy()
    restored = await fleet.restore(ck, node=other, request_timeout_s=300)
    try:
        assert restored.node == other != ck.node
        assert await _until_lines(restored, before + 3) > before  # its counter goes on, on the other node
        assert (await restored.exec(["uname", "-r"])).stdout.decode().strip() == guest.release
    finally:
        await restored.destroy()
        await Layers(fleet.bus).remove(ck.name)
    for node, sandbox_id in ((ck.node, sb.id), (other, restored.id)):
        deadline = time.monotonic() + 10
        while (left := microvm_left(dirs[node], sandbox_id)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert left == []


def test_a_state_layer_is_checked_before_qemu_sees_it(tmp_path):
    """The restoring node's checks of the layer's two files, on files made here (no VM)."""
    from linuxnode.vm.runtime import MachineNeeds
    from services.launcher.drivers import machine_state
    from services.launcher.drivers.base import LaunchRefused

    mine = MachineNeeds("pc-i440fx-7.2", "tcg", "qemu64", "QEMU 7.2", "g")
    needs = MachineState(level="microvm", machine="pc-i440fx-7.2", accelerator="tcg", cpu="qemu64",
                         qemu="QEMU 7.2", guest="g")

    def check(state_size: int | None = 1 << 20, raw: bytes = msgspec.json.encode(needs), link: bool = False,
              guest_mb: int = 352) -> Path:
        layer = tmp_path / f"layer{len(list(tmp_path.iterdir()))}"
        layer.mkdir()
        (layer / "machine.json").write_bytes(raw)
        if link:
            (layer / "machine.state").symlink_to("/etc/passwd")
        elif state_size is not None:
            with open(layer / "machine.state", "wb") as f:
                f.truncate(state_size)  # sparse: its size is what is checked
        return machine_state.checked(lambda name: layer / name, "microvm", lambda: mine, guest_mb)

    assert check().name == "machine.state"
    with pytest.raises(LaunchRefused, match="more than a machine of 352 MiB"):
        check(state_size=(352 + 129) << 20)
    with pytest.raises(LaunchRefused, match="not a regular file"):
        check(link=True)
    with pytest.raises(LaunchRefused, match="over 4096 bytes"):
        check(raw=b" " * 5000)
    with pytest.raises(LaunchRefused, match="no machine state"):
        check(state_size=None)
    with pytest.raises(errors.Unsupported, match="qemu 'QEMU 9.0'.*this node: 'QEMU 7.2'"):
        check(raw=msgspec.json.encode(msgspec.structs.replace(needs, qemu="QEMU 9.0")))
    with pytest.raises(errors.Unsupported, match="guest 'other'"):
        check(raw=msgspec.json.encode(msgspec.structs.replace(needs, guest="other")))
    layer = tmp_path / "json-link"
    layer.mkdir()
    (layer / "machine.json").symlink_to("/etc/hostname")  # a needs file is read only as itself
    with pytest.raises(LaunchRefused, match="no machine state"):
        machine_state.checked(lambda name: layer / name, "microvm", lambda: mine, 352)

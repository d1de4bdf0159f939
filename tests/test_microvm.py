"""`microvm` sandboxes against the real platform: QEMU (TCG here, KVM where it runs a stock
guest), Debian's kernel, the layer stack as read-only disks, the guest agent over virtio-serial.

One machine state is booted and saved for the module's layer (the first create, ~13 s under
TCG on a quiet machine); every other create restores it. The hostile-guest tests play the guest
with a process of our own on the agent's socket (they are the hostile party), and one makes a
real guest lie from inside the VM.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct

import pytest

from sandfleet import errors
from sandfleet.layers_client import Layers
from linuxnode.vm import frames
from linuxnode.vm.channel import AgentChannel, GuestBroken
from linuxnode.vm.guest_image import GuestImage, default_dir
from schemas.sandbox import Reason, State
from tests.kernel import require
from tests.layer_trees import APPLETS, make_busybox_base
from tests.leaks import microvm_left
from tests.test_pause_resume import cgroup_dir, read
from tests.vm_shapes import create_vm

LAYER = "vm-base"
MEMORY_MB = 512  # every create of the module the same shape: one saved machine state for all


@pytest.fixture(scope="module")
async def guest(fleet, platform, tmp_path_factory) -> GuestImage:
    require(os.geteuid() == 0, "microVMs need root (cgroups, namespaces)")
    require(shutil.which("qemu-system-x86_64") is not None, "qemu-system-x86 is installed")
    found = GuestImage.find(default_dir())
    require(isinstance(found, GuestImage), f"a built guest ({found})")
    assert isinstance(found, GuestImage)
    src = tmp_path_factory.mktemp("vm-src") / "base"
    make_busybox_base(src, hostname="vm", applets=(*APPLETS, "uname", "printf", "cut", "grep", "wc", "stty", "tty", "pwd", "ln"))
    await Layers(fleet.bus).build_dir(LAYER, src)
    # The module's machine state, booted and saved by the first create. Under TCG on a loaded
    # node that boot can outlast placement's 30 s launch budget; the node finishes saving it
    # anyway, and the second try restores it.
    await (await create_vm(fleet, tries=2, isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)).destroy()
    return found


async def _gone(platform, sandbox_id: str, wait_s: float = 5.0) -> list[str]:
    deadline = asyncio.get_running_loop().time() + wait_s
    while (left := microvm_left(str(platform.data_dir), sandbox_id)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return left


async def test_a_microvm_runs_the_guest_kernel_and_leaves_nothing(fleet, platform, guest):
    status = platform.cli("status").stdout.decode()
    assert "microvm" in status and ("on: tcg (no usable KVM" in status or "on: kvm" in status), status
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB, timeout_s=300)
    try:
        r = await sb.exec(["uname", "-r"])
        assert r.exit_code == 0, r
        assert r.stdout.decode().strip() == guest.release != os.uname().release
        assert (await sb.exec(["cat", "/etc/hostname"])).stdout == b"vm\n"  # the layer is the root
        assert (await sb.exec(["ls", "/sys/class/net"])).stdout.split() == [b"lo"]  # no allow rules, no NIC
        qemu = (await sb.info()).init_pid
        with open(f"/proc/{qemu}/status") as f:
            uids = next(line.split()[1:] for line in f if line.startswith("Uid:"))
        assert "0" not in uids, uids  # QEMU dropped root once set up
        with open(f"/proc/{qemu}/cgroup") as f:
            assert f"/{sb.id}" in f.read()  # and runs in the sandbox's cgroups
        r = await sb.exec(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"piped in")
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"piped in", b"err\n")
        r = await sb.exec(["sh", "-c", "sleep 1; wc -c"], stdin=b"x" * (1 << 20))  # 16 pipes' worth, read late
        assert r.stdout.split() == [b"1048576"], r
        assert await sb.write_file("/workspace/data.bin", bytes(range(256)) * 4096, mode=0o600) == 1 << 20
        assert await sb.read_file("/workspace/data.bin") == bytes(range(256)) * 4096
        r = await sb.exec(["sh", "-c", "ls -l /workspace/data.bin | cut -c1-10"])
        assert r.stdout == b"-rw-------\n"
        with pytest.raises(errors.NotFound):
            await sb.read_file("/no/such/file")
        with pytest.raises(errors.NotFound):
            await sb.exec(["true"], cwd="/no/such/dir")
        streamed = await sb.spawn(["sh", "-c", "echo a; sleep 0.3; echo b >&2; exit 4"])
        chunks = [(o.stream, o.data) async for o in streamed.output()]
        assert (await streamed.wait(timeout_s=30)).exit_code == 4
        assert ("stdout", b"a\n") in chunks and ("stderr", b"b\n") in chunks
        fed = await sb.spawn(["cat"], stdin=True)
        await fed.send_stdin(b"through stdin")
        await fed.close_stdin()
        assert (await fed.wait(timeout_s=30)).exit_code == 0
        assert b"".join([o.data async for o in fed.output()]) == b"through stdin"
        timed = await sb.exec(["sleep", "30"], timeout_s=1)
        assert timed.timed_out
        assert (await sb.exec(["true"])).exit_code == 0
    finally:
        await sb.destroy()
    assert await _gone(platform, sb.id) == []


async def test_a_microvm_has_terminals_and_shell_sessions(fleet, platform, guest):
    """A terminal of the guest's own devpts (the agent holds its master): the controlling tty of
    its command, sized and resized from the node; `sb.shell()` rides on a background process."""
    import re

    from tests.test_pty import Screen

    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
    try:
        term = await sb.pty(["sh", "-c", "tty; stty size; [ -t 0 ] && [ -t 2 ] && echo 'is''atty'"], cols=90, rows=20)
        assert (await term.wait()).exit_code == 0
        assert re.fullmatch(rb"/dev/pts/\d+\r\n20 90\r\nisatty\r\n", b"".join([c async for c in term.output(0)]))
        term = await sb.pty(["sh"], cols=80, rows=24)
        screen = Screen(term)
        await term.write(b"stty size\r")
        await screen.until(r"\b24 80\r\n")
        await term.resize(132, 50)
        await term.write(b"stty size; echo sid=$(cut -d' ' -f6 /proc/$$/stat) pid=$$\r")
        await screen.until(r"\b50 132\r\n")
        found = await screen.until(r"sid=(\d+) pid=(\d+)")
        assert found[1] == found[2]  # a session leader with the terminal as its controlling tty
        await term.write(b"exit 7\r")
        assert (await term.wait()).exit_code == 7
        with pytest.raises(errors.InvalidRequest):
            await sb.pty(["sh"], cols=0, rows=24)
        sh = await sb.shell()
        try:
            assert (await sh.run("cd /tmp && export X=kept")).exit_code == 0
            assert (await sh.run("pwd; echo $X")).stdout == b"/tmp\nkept\n"
        finally:
            await sh.close()
    finally:
        await sb.destroy()
    assert await _gone(platform, sb.id) == []


async def test_a_microvm_takes_files_of_any_size_and_its_tree_is_worked_from_outside(fleet, platform, guest,
                                                                                   tmp_path):
    """Uploads and downloads of one file in chunks, and stat/list/mkdir/remove/rename, through the
    agent; the node hashes both ways itself. A directory comes down as a tar the node writes; one
    going up is a typed Unsupported."""
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
    try:
        data = os.urandom((9 << 20) + 12345)  # several chunks, not a whole number of them
        done = await sb.upload(data, "/workspace/big.bin", mode=0o640)
        assert done.size == len(data)
        r = await sb.exec(["sh", "-c", "wc -c < /workspace/big.bin; ls -l /workspace/big.bin | cut -c1-10; "
                                       "ls -a /workspace | grep -c sandfleet || true"])
        assert r.stdout.split() == [str(len(data)).encode(), b"-rw-r-----", b"0"], r  # no temporary left
        back = tmp_path / "back.bin"
        await sb.download("/workspace/big.bin", back)
        assert back.read_bytes() == data
        files = sb.files
        await files.mkdir("/workspace/a/b/c", parents=True)
        await sb.write_file("/workspace/a/b/c/x.txt", b"x")
        await files.rename("/workspace/a/b/c/x.txt", "/workspace/a/y.txt")
        listed = {(e.path, e.kind) for e in await files.list("/workspace/a", depth=3)}
        assert listed == {("/workspace/a/b", "dir"), ("/workspace/a/b/c", "dir"), ("/workspace/a/y.txt", "file")}
        entry = await files.stat("/workspace/big.bin")
        assert (entry.kind, entry.size, entry.mode) == ("file", len(data), 0o640)
        with pytest.raises(errors.NotFound):
            await files.stat("/workspace/nothing")
        with pytest.raises(errors.InvalidRequest):
            await files.remove("/workspace/a")  # not empty
        await files.remove("/workspace/a", recursive=True)
        assert not await files.exists("/workspace/a")
        # A tree comes down as a tar the node writes from the agent's listing and reads.
        await files.mkdir("/workspace/t/sub")
        await sb.write_file("/workspace/t/sub/f.txt", b"in the tree", mode=0o600)
        await sb.upload(data[:100000], "/workspace/t/part.bin")
        assert (await sb.exec(["ln", "-s", "sub/f.txt", "/workspace/t/link"])).exit_code == 0
        await sb.download("/workspace/t", tmp_path / "tree")
        tree = tmp_path / "tree"
        assert (tree / "sub/f.txt").read_bytes() == b"in the tree" and (tree / "sub/f.txt").stat().st_mode & 0o777 == 0o600
        assert (tree / "part.bin").read_bytes() == data[:100000]
        assert os.readlink(tree / "link") == "sub/f.txt"
        source = tmp_path / "up"
        source.mkdir()
        with pytest.raises(errors.Unsupported, match="directory tree"):
            await sb.upload(source, "/workspace/up")
        assert (await sb.exec(["true"])).exit_code == 0
    finally:
        await sb.destroy()
    assert await _gone(platform, sb.id) == []


async def test_two_restored_microvms_do_not_share_their_writable_layer(fleet, platform, guest):
    a, b = await asyncio.gather(*(fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
                                  for _ in range(2)))
    try:
        await a.write_file("/workspace/mine", b"a's")
        assert (await b.exec(["test", "-e", "/workspace/mine"])).exit_code == 1
        assert (await a.exec(["cat", "/workspace/mine"])).stdout == b"a's"
        df = await b.exec(["sh", "-c", "grep ' /mnt/upper ' /proc/mounts || true"])
        assert df.exit_code == 0
    finally:
        await asyncio.gather(a.destroy(), b.destroy())
    for sb in (a, b):
        assert await _gone(platform, sb.id) == []


async def test_the_agents_port_is_not_the_sandboxs_and_a_dead_qemu_fails_it(fleet, platform, guest):
    """A process of the sandbox is root in its guest, yet cannot open the agent's port (a
    virtio-serial port has one opener: the agent) to speak for it. A QEMU that dies (killed
    here from outside, as the node kills a guest that breaks the protocol) fails the sandbox
    and leaves nothing."""
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
    try:
        port = ("for p in /sys/class/virtio-ports/*; do grep -q org.sandfleet.agent $p/name && "
                "printf '\\377\\377\\377\\377' > /dev/${p##*/} && echo opened; done")
        r = await sb.exec(["sh", "-c", port])
        assert b"opened" not in r.stdout and b"busy" in r.stderr.lower(), r
        assert (await sb.exec(["true"])).exit_code == 0  # the agent heard nothing of it
        qemu = (await sb.info()).init_pid
        with open(f"/proc/{qemu}/comm") as f:
            assert f.read().strip() == "qemu-system-x86"
        os.kill(qemu, 9)
        deadline = asyncio.get_running_loop().time() + 20
        while (record := await sb.info()).state not in (State.FAILED, State.STOPPED):
            assert asyncio.get_running_loop().time() < deadline, record
            await asyncio.sleep(0.05)
        assert (record.state, record.reason) == (State.FAILED, Reason.PROCESS_EXITED)
    finally:
        if (await sb.info()).state not in (State.FAILED, State.STOPPED):
            await sb.destroy()
    assert await _gone(platform, sb.id) == []


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, every thread of QEMU's


async def test_a_paused_microvm_spends_no_cpu_and_answers_again_after_resume(fleet, platform, guest):
    """Pause freezes QEMU's cgroup (vCPUs and all): no CPU time while paused, commands refused;
    the idle hint changes its CPU weight; after resume the guest's agent answers as before."""
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
    try:
        await sb.write_file("/workspace/before", b"kept")
        record = await sb.pause()
        assert (record.state, record.reason) == (State.PAUSED, Reason.REQUESTED)
        qemu = record.init_pid
        v2 = cgroup_dir(qemu, "")
        assert read(f"{v2}/cgroup.freeze").strip() == "1"
        assert "frozen 1" in read(f"{v2}/cgroup.events")
        spent = _cpu_ticks(qemu)
        await asyncio.sleep(1.0)  # an idle TCG guest's timer ticks cost QEMU CPU every second
        assert _cpu_ticks(qemu) == spent
        with pytest.raises(errors.Conflict, match="paused"):
            await sb.exec(["true"])
        hinted = await sb.hint("idle")  # the weight of QEMU's own cgroup
        assert f"/{sb.id}" in hinted.file and int(read(hinted.file)) == hinted.value
        record = await sb.resume()
        assert record.state is State.RUNNING
        assert read(f"{v2}/cgroup.freeze").strip() == "0"
        assert (await sb.exec(["cat", "/workspace/before"])).stdout == b"kept"
        assert _cpu_ticks(qemu) > spent  # the same count moves once it runs
        assert (await sb.hint("active")).value > hinted.value
    finally:
        await sb.destroy()
    assert await _gone(platform, sb.id) == []


async def test_a_microvm_outlives_a_launcher_crash(fleet, platform, guest):
    """The restarted launcher re-adopts the VM from its record: a new channel to the same QEMU,
    whose agent ends what it ran for the dead launcher."""
    sb = await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)
    try:
        await sb.write_file("/workspace/kept", b"before the crash")
        running = await sb.spawn(["sleep", "300"])
        old = platform.service_pid("launcher")
        os.kill(old, 9)
        await platform.restarted(fleet, "launcher", old)
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                r = await sb.exec(["cat", "/workspace/kept"])
                break
            except errors.NotFound:  # not re-adopted yet
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.2)
        assert r.stdout == b"before the crash"
        assert (await sb.exec(["sh", "-c", "ps | grep -c 'sleep 30[0]' || true"])).stdout == b"0\n"
        del running
    finally:
        await sb.destroy()
    assert await _gone(platform, sb.id) == []


async def test_what_a_microvm_cannot_have_is_refused_typed(fleet, guest):
    with pytest.raises(errors.InvalidRequest, match="http://evil.test"):  # the agent's check, as for any level
        await fleet.create(isolation="microvm", layers=[LAYER], allow=["http://evil.test"])
    with pytest.raises(errors.InvalidRequest, match="memory_mb"):
        await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=128)
    with pytest.raises(errors.InvalidRequest, match="host view"):
        await fleet.create(isolation="microvm", host_view=True)


# -- the node's side of the agent's port, against a guest played by the test -------------------------

async def _played_guest(reply_timeout: float = 2.0):
    """(channel, the guest's socket, what on_broken was told)."""
    node_end, guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, writer = await asyncio.open_unix_connection(sock=node_end, limit=frames.MAX_FRAME)
    guest_end.setblocking(False)  # written with sock_sendall: the node reads on this same loop
    told: list[str] = []
    return AgentChannel(reader, writer, told.append, reply_timeout=reply_timeout), guest_end, told


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _answer(*fields) -> bytes:
    import msgspec

    return _frame(msgspec.msgpack.encode(list(fields)))


async def _until_broken(channel: AgentChannel) -> str:
    for _ in range(200):
        if channel.broken:
            return channel.broken
        await asyncio.sleep(0.01)
    raise AssertionError("the channel did not break")


@pytest.mark.parametrize("sent, why", [
    (struct.pack(">I", frames.MAX_FRAME + 1), "a frame of"),
    (_frame(b"\xc1not msgpack"), "not one"),
    (_answer("exited", 7, 0), "not running"),
    (_answer("out", 1, 1, b"x"), "not running"),
    (_answer("out", 1, 3, b"x"), "not one"),
    (_answer("pong", 99, "6.1"), "nobody asked"),
    (_answer("hello", "x" * 65), "not one"),
    (_answer("launch-missiles", 1), "not one"),
])
async def test_a_guest_that_breaks_the_protocol_is_cut_off_with_why(sent, why):
    channel, guest_end, told = await _played_guest()
    try:
        await asyncio.get_running_loop().sock_sendall(guest_end, sent)
        assert why in await _until_broken(channel)
        assert told == [channel.broken]
        with pytest.raises(GuestBroken):
            await channel.ping()
    finally:
        channel.close()
        guest_end.close()


async def test_a_silent_guest_is_cut_off_and_a_flood_of_output_stays_bounded():
    channel, guest_end, told = await _played_guest(reply_timeout=0.5)
    try:
        with pytest.raises(GuestBroken, match="did not answer"):
            await channel.ping()
        assert told and "did not answer" in told[0]
    finally:
        channel.close()
        guest_end.close()
    # A started command's output is handed on frame by frame; a frame over the cap is a breach.
    channel, guest_end, told = await _played_guest()
    got: list[int] = []
    try:
        start = asyncio.ensure_future(channel.start(["yes"], {}, "/", lambda s, d: got.append(len(d)), lambda st: None))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().sock_sendall(guest_end, _answer("started", 1, 42) + _answer("out", 1, 1, b"y" * frames.CHUNK) * 4)
        command = await start
        assert command.pid == 42
        await asyncio.get_running_loop().sock_sendall(guest_end, _answer("out", 1, 1, b"y" * (frames.CHUNK + 1)))
        assert "not one" in await _until_broken(channel)
        assert got == [frames.CHUNK] * 4
    finally:
        channel.close()
        guest_end.close()


# -- pure pieces, no VM ------------------------------------------------------------------------------

def test_the_layer_disks_are_the_image_files_under_the_overlay_bottom_first():
    from linuxnode.vm.layer_disks import NoLayerImages, images_under

    mountinfo = "\n".join([
        "30 1 0:40 / /cache/layers/aa ro,relatime - erofs /cache/images/aa.erofs ro,user_xattr",
        "31 1 0:41 / /cache/layers/b\\072b ro,relatime - erofs /cache/lazy/bb.erofs ro",
        "40 1 0:50 / /roots/sb-1/rootfs rw - overlay overlay rw,lowerdir=/cache/layers/b\\:b:/cache/layers/aa,"
        "upperdir=/roots/sb-1/upper,workdir=/roots/sb-1/work",
        "41 1 0:51 / /roots/sb-2/rootfs rw - overlay overlay rw,lowerdir=/tmp/plain,upperdir=/u,workdir=/w",
        "42 1 0:52 / /tmp/plain rw - tmpfs tmpfs rw",
    ])
    assert [str(p) for p in images_under("/roots/sb-1/rootfs", mountinfo)] == [
        "/cache/images/aa.erofs", "/cache/lazy/bb.erofs"]
    with pytest.raises(NoLayerImages, match="not an EROFS mount"):
        images_under("/roots/sb-2/rootfs", mountinfo)
    with pytest.raises(NoLayerImages, match="not an overlay"):
        images_under("/roots/sb-3/rootfs", mountinfo)


def test_requests_the_node_cannot_frame_are_refused_and_shapes_key_their_states():
    from linuxnode.vm import machine
    from linuxnode.vm.machine import Accelerator
    from linuxnode.vm.runtime import Shape

    with pytest.raises(ValueError, match="NUL"):
        frames.exec_request(1, ["sh", "-c", "a\0b"], {}, "/")
    with pytest.raises(ValueError, match="empty argv"):
        frames.exec_request(1, [], {}, "/")
    with pytest.raises(ValueError, match="frame size"):
        frames.request(frames.Op.STDIN, 1, b"x" * frames.MAX_FRAME)
    assert machine.guest_memory_mb(512) == 512 - machine.QEMU_OVERHEAD_MB
    with pytest.raises(ValueError, match="memory_mb >= "):
        machine.guest_memory_mb(200)
    guest = GuestImage(kernel=None, initramfs=None, release="r", digest="d")  # type: ignore[arg-type]
    tcg = Accelerator("tcg", "why")
    keys = {Shape(1, 352, ("a", "b")).key(guest, tcg), Shape(1, 352, ("b", "a")).key(guest, tcg),
            Shape(2, 352, ("a", "b")).key(guest, tcg), Shape(1, 353, ("a", "b")).key(guest, tcg),
            Shape(1, 352, ("a", "b")).key(guest, Accelerator("kvm"))}
    assert len(keys) == 5  # a state restores only into the very same machine and disks


async def test_a_running_machines_state_restores_into_a_new_vm_with_its_processes(tmp_path):
    """The node library's memory checkpoint (under `checkpoint(memory=True)`: test_vm_checkpoint.py): the agent
    goes quiet, QMP saves the whole machine, the original runs on; a new QEMU restored from that
    state has the guest's files and its running processes, its agent detached from the old node's
    commands (their output and exits go nowhere) and answering the new one."""
    from linuxnode.vm import machine
    from linuxnode.vm.runtime import MicroVMs, Shape

    require(os.geteuid() == 0, "microVMs need root")
    require(shutil.which("qemu-system-x86_64") is not None and shutil.which("mkfs.erofs") is not None,
            "qemu-system-x86 and erofs-utils are installed")
    found = GuestImage.find(default_dir())
    require(isinstance(found, GuestImage), f"a built guest ({found})")
    assert isinstance(found, GuestImage)
    make_busybox_base(tmp_path / "tree", hostname="ckpt", applets=(*APPLETS, "grep", "wc"))
    image = tmp_path / "base.erofs"
    import subprocess

    subprocess.run(["mkfs.erofs", "-zlz4", str(image), str(tmp_path / "tree")], check=True, capture_output=True)
    vms = MicroVMs(found, machine.detect_accelerator(), machine.qemu_binary() or "", tmp_path / "state", snapshots=False)
    shape = Shape(vcpus=1, memory_mb=MEMORY_MB - machine.QEMU_OVERHEAD_MB, layers=("base",))
    told: list[str] = []
    first = await vms.start("ckpt-a", shape, [image], 64, [], "", told.append)
    second = None
    try:
        out: list[bytes] = []
        counter = "while :; do echo tick >> /tmp/count; echo tick; sleep 0.2; done"  # appends: never read half-made
        await first.channel.start(["sh", "-c", counter], {}, "/", lambda s, d: out.append(d), lambda st: None)
        await first.channel.write_file("/workspace/kept", b"before the checkpoint", 0o644)
        await asyncio.sleep(1)
        state = tmp_path / "running.state"
        await vms.save_running(first, state)
        assert (await _run(first.channel, "cat /workspace/kept")) == b"before the checkpoint"  # it runs on
        ticks = len(out)
        await asyncio.sleep(0.6)
        assert len(out) > ticks  # and the command's output still comes to its node
        second = await vms.start("ckpt-b", shape, [image], 64, [], "", told.append, from_state=state)
        assert (await _run(second.channel, "cat /workspace/kept")) == b"before the checkpoint"
        before = int(await _run(second.channel, "wc -l < /tmp/count"))
        await asyncio.sleep(1)
        assert int(await _run(second.channel, "wc -l < /tmp/count")) > before  # the loop went on running
        assert told == []
    finally:
        for vm in (first, second):
            if vm is not None:
                vm.channel.close()
                await vms.stop(vm.sandbox_id, vm.process)
    assert not list((tmp_path / "state" / "vms").iterdir())


async def _run(channel: AgentChannel, script: str) -> bytes:
    got: list[bytes] = []
    command = await channel.start(["sh", "-c", script], {}, "/", lambda s, d: got.append(d), lambda st: None)
    channel.close_stdin(command)
    status = await asyncio.wait_for(command.exited, 60)
    assert status == 0, (status, got)
    return b"".join(got).strip()


@pytest.mark.parametrize("entries, why", [
    ([["/etc/passwd", "file", 1, 0o644, 0.0, ""]], "outside the directory"),  # not under what was listed
    ([["/workspace/x", "device", 1, 0o644, 0.0, ""]], "not one"),  # a kind there is not
    ([["/workspace/x", "file", -1, 0o644, 0.0, ""]], "not one"),
    ([["/workspace/x", "file", 1, 0o644, 0.0, "t" * 4097]], "not one"),
])
async def test_a_guest_that_lies_in_a_listing_is_cut_off(entries, why):
    from linuxnode.vm import files as vm_files

    channel, guest_end, told = await _played_guest()
    loop = asyncio.get_running_loop()
    try:
        listing = loop.run_in_executor(None, vm_files.list_dir, channel,
                                       lambda make: asyncio.run_coroutine_threadsafe(make(), loop).result(),
                                       "/workspace", 1, 100)
        await asyncio.sleep(0.1)
        await loop.sock_sendall(guest_end, _answer("entries", 1, entries, False))
        with pytest.raises(GuestBroken):
            await listing
        assert why in channel.broken and told == [channel.broken]
    finally:
        channel.close()
        guest_end.close()


async def test_while_a_state_is_saved_the_node_asks_the_guest_nothing():
    """Between quiesce and resume no request that the agent would answer leaves the node, so the
    port's stream stays at a frame's end for the whole save."""
    channel, guest_end, told = await _played_guest()
    loop = asyncio.get_running_loop()
    try:
        quiescing = asyncio.ensure_future(channel.quiesce())
        assert (await loop.sock_recv(guest_end, 64))[4] == frames.Op.QUIESCE
        await loop.sock_sendall(guest_end, _answer("done", 1, 0))
        await quiescing
        pinging = asyncio.ensure_future(channel.ping())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(loop.sock_recv(guest_end, 64), 0.3)  # nothing sent
        resuming = asyncio.ensure_future(channel.resume())
        frame = await loop.sock_recv(guest_end, 9)
        assert frame[4] == frames.Op.RESUME
        await loop.sock_sendall(guest_end, _answer("done", int.from_bytes(frame[5:9], "big"), 0))
        await resuming
        frame = await loop.sock_recv(guest_end, 64)
        assert frame[4] == frames.Op.PING  # the held request goes now
        await loop.sock_sendall(guest_end, _answer("pong", int.from_bytes(frame[5:9], "big"), "6.1"))
        assert await pinging == "6.1" and told == []
    finally:
        channel.close()
        guest_end.close()

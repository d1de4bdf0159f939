"""Files of any size against the real platform, for `process` and `container` sandboxes: uploads
and downloads in chunks over the bus, checked end to end, never seen half done, a tree keeping
its modes and symlinks, and every bad input refused with a typed error that changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import stat
from pathlib import Path

import pytest

from sandfleet import errors, stream_check
from sandfleet.layers_client import Layers
from schemas import files as wire
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

BASE = "files-base"
BIG = int(os.environ.get("SANDFLEET_TEST_BIG_FILE_MB", "1024")) << 20


@pytest.fixture(scope="module")
async def base(fleet, tmp_path_factory):
    require(os.geteuid() == 0, "sandboxes need root")
    require(BUSYBOX.exists() and shutil.which("crun") is not None, "busybox-static and crun")
    src = tmp_path_factory.mktemp("files-src") / "base"
    make_busybox_base(src, applets=(*_APPLETS,))
    await Layers(fleet.bus).build_dir(BASE, src)
    return BASE


_APPLETS = ("sh", "cat", "ls", "echo", "rm", "ln", "mkdir", "stat", "readlink", "true", "test", "wc", "sleep")


@pytest.fixture(params=["process", "container"])
async def make(request, fleet, base):
    made = []

    async def create(disk_mb: int = 256, memory_mb: int = 256):
        if request.param == "process":
            sb = await fleet.create(memory_mb=memory_mb, disk_mb=disk_mb, host_view=True)
        else:
            sb = await fleet.create(isolation="container", memory_mb=memory_mb, disk_mb=disk_mb, layers=[base])
        made.append(sb)
        return sb

    yield create
    for sb in made:
        try:
            await sb.destroy()
        except errors.ServiceFailure:
            pass  # a test destroyed it


def _generate(path: Path, size: int, seed: int) -> tuple[str, str]:
    """The file's (sha256, xxh3-128) digests, hex."""
    rng, sha, xxh = random.Random(seed), hashlib.sha256(), stream_check.digest("xxh3-128")
    with open(path, "wb") as f:
        left = size
        while left:
            block = rng.randbytes(min(left, 8 << 20))
            f.write(block)
            sha.update(block)
            xxh.update(block)
            left -= len(block)
    return sha.hexdigest(), xxh.hexdigest()


def _xxh3(data: bytes) -> str:
    digest = stream_check.digest("xxh3-128")
    digest.update(data)
    return digest.hexdigest()


def _same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(8 << 20), fb.read(8 << 20)
            if x != y:
                return False
            if not x:
                return True


def _leftovers(root: str) -> list[str]:
    return [n for n in os.listdir(root) if ".sandfleet-" in n]


async def test_a_big_file_goes_up_and_comes_back_byte_for_byte(make, tmp_path):
    sb = await make(disk_mb=BIG // (1 << 20) + 64, memory_mb=256)
    src, back = tmp_path / "big", tmp_path / "back"
    sha, xxh = _generate(src, BIG, seed=12)
    seen = []
    done = await sb.upload(src, "/workspace/big", progress=lambda n, total: seen.append((n, total)), check="sha256")
    assert (done.size, done.check, done.digest) == (BIG, "sha256", sha)
    assert seen[-1] == (BIG, BIG) and len(seen) == -(-BIG // wire.CHUNK_BYTES)
    r = await sb.exec(["wc", "-c", "/workspace/big"])
    assert r.stdout.split()[0] == str(BIG).encode()
    src.unlink()  # keep the test's disk small: the download is compared with the hash, then regenerated
    got = await sb.download("/workspace/big", back)  # the default check
    assert (got.size, got.check, got.digest) == (BIG, "xxh3-128", xxh)
    _generate(src, BIG, seed=12)
    assert _same_bytes(src, back)
    assert not _leftovers(str(tmp_path))


async def test_bytes_and_small_files_round_trip_with_their_mode(make, tmp_path):
    sb = await make()
    await sb.upload(b"", "/workspace/empty")
    await sb.upload(b"hello", "/workspace/hello", mode=0o600)
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(tmp_path / "run.sh", 0o755)
    await sb.upload(tmp_path / "run.sh", "/workspace/run.sh")
    assert (await sb.exec(["/workspace/run.sh"])).stdout == b"ran\n"
    assert (await sb.exec(["stat", "-c", "%a", "/workspace/hello"])).stdout == b"600\n"
    assert await sb.read_file("/workspace/hello") == b"hello"  # the one-request subjects still work
    await sb.download("/workspace/empty", tmp_path / "empty")
    await sb.download("/workspace/hello", tmp_path / "hello")
    assert (tmp_path / "empty").read_bytes() == b"" and (tmp_path / "hello").read_bytes() == b"hello"
    assert stat.S_IMODE((tmp_path / "hello").stat().st_mode) == 0o600


def _tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 1000)
    (root / "tool").write_text("#!/bin/sh\necho tool\n")
    os.chmod(root / "tool", 0o750)
    os.chmod(root / "pkg" / "sub", 0o711)
    os.symlink("pkg/sub/data.bin", root / "rel-link")
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("missing", root / "dangling")
    os.link(root / "tool", root / "tool-hardlink")


def _describe(root: Path) -> dict[str, tuple]:
    out = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(where) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


async def test_a_tree_keeps_its_modes_and_symlinks_both_ways(make, tmp_path):
    sb = await make()
    _tree(tmp_path / "repo")
    await sb.upload(tmp_path / "repo", "/workspace/repo")
    assert (await sb.exec(["readlink", "/workspace/repo/abs-link"])).stdout == b"/etc/hostname\n"
    assert (await sb.exec(["/workspace/repo/tool"])).stdout == b"tool\n"
    assert (await sb.exec(["stat", "-c", "%a", "/workspace/repo/pkg/sub"])).stdout == b"711\n"
    await sb.download("/workspace/repo", tmp_path / "back")
    assert _describe(tmp_path / "back") == _describe(tmp_path / "repo")
    # again over the tree that is there: replaced as a whole, nothing left of the old one
    (tmp_path / "repo" / "tool").unlink()
    await sb.upload(tmp_path / "repo", "/workspace/repo")
    assert (await sb.exec(["test", "-e", "/workspace/repo/tool"])).exit_code == 1
    assert b".sandfleet-" not in (await sb.exec(["ls", "-a", "/workspace"])).stdout


async def test_a_file_past_disk_mb_is_enospc_and_leaves_nothing(make, tmp_path):
    sb = await make(disk_mb=16)
    src = tmp_path / "too-big"
    _generate(src, 40 << 20, seed=3)
    with pytest.raises(errors.Capacity, match="ENOSPC"):
        await sb.upload(src, "/workspace/too-big")
    listing = (await sb.exec(["ls", "-a", "/workspace"])).stdout.split()
    assert b"too-big" not in listing and not [n for n in listing if b".sandfleet-" in n]
    await sb.upload(b"x" * (4 << 20), "/workspace/fits")  # the space came back
    (tmp_path / "tree").mkdir()
    shutil.copy(src, tmp_path / "tree" / "inside")
    with pytest.raises(errors.Capacity):
        await sb.upload(tmp_path / "tree", "/workspace/tree")
    assert b"tree" not in (await sb.exec(["ls", "-a", "/workspace"])).stdout


async def test_paths_escaping_the_root_are_refused_and_change_nothing(make, tmp_path, platform):
    sb = await make()
    assert (await sb.exec(["ln", "-s", "/", "/workspace/up"])).exit_code == 0
    assert (await sb.exec(["ln", "-s", "../../../../..", "/workspace/climb"])).exit_code == 0
    for path in ("/workspace/../etc/x", "/workspace/a/../../x", "/.."):
        with pytest.raises(errors.InvalidRequest):
            await sb.upload(b"x", path)
    for path in ("/workspace/up/tmp/escaped", "/workspace/climb/tmp/escaped"):
        with pytest.raises(errors.InvalidRequest, match="out of the sandbox"):
            await sb.upload(b"x", path)
    assert (await sb.exec(["test", "-e", "/tmp/escaped"])).exit_code == 1
    assert not os.path.exists("/tmp/escaped")
    with pytest.raises(errors.NotFound):
        await sb.upload(b"x", "/workspace/no-such-dir/file")
    with pytest.raises(errors.NotFound):
        await sb.download("/workspace/missing", tmp_path / "missing")
    assert not (tmp_path / "missing").exists() and not _leftovers(str(tmp_path))
    with pytest.raises(errors.InvalidRequest):
        await sb.upload(b"x", "/workspace")  # a directory is not replaced by a file


async def test_a_tar_with_a_symlink_out_is_refused_and_leaves_nothing(make, tmp_path):
    import io
    import tarfile
    sb = await make()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("out")
        link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
        tar.addfile(link)
        member = tarfile.TarInfo("out/pwned")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"x"))
    bus, data = sb._fleet.bus, buf.getvalue()
    begin = await bus.request(sb._subject(wire.UPLOAD), wire.UploadRequest(sandbox_id=sb.id, path="/workspace/t",
                                                                           kind="dir"), wire.Transfer)
    with pytest.raises(errors.InvalidRequest, match="symlink"):
        await bus.request_raw(sb._subject(wire.UPLOAD_CHUNK), wire.UploadChunk(
            sandbox_id=sb.id, transfer_id=begin.transfer_id, seq=0), wire.ChunkAck, data=data)
        await bus.request(sb._subject(wire.UPLOAD_END), wire.UploadEnd(
            sandbox_id=sb.id, transfer_id=begin.transfer_id, chunks=1, size=len(data),
            digest=_xxh3(data)), wire.TransferDone)
    listing = (await sb.exec(["ls", "-a", "/workspace", "/tmp"])).stdout
    assert b"pwned" not in listing and b".sandfleet-" not in listing and not os.path.exists("/tmp/pwned")


async def test_a_wrong_hash_or_a_missing_chunk_keeps_nothing(make):
    sb = await make()
    bus = sb._fleet.bus

    async def begin() -> str:
        req = wire.UploadRequest(sandbox_id=sb.id, path="/workspace/f")
        return (await bus.request(sb._subject(wire.UPLOAD), req, wire.Transfer)).transfer_id

    async def chunk(tid: str, seq: int, data: bytes) -> None:
        req = wire.UploadChunk(sandbox_id=sb.id, transfer_id=tid, seq=seq)
        await bus.request_raw(sb._subject(wire.UPLOAD_CHUNK), req, wire.ChunkAck, data=data)

    async def end(tid: str, chunks: int, size: int, digest: str) -> None:
        req = wire.UploadEnd(sandbox_id=sb.id, transfer_id=tid, chunks=chunks, size=size, digest=digest)
        await bus.request(sb._subject(wire.UPLOAD_END), req, wire.TransferDone)

    tid = await begin()
    await chunk(tid, 0, b"abc")
    with pytest.raises(errors.InvalidRequest, match="digest"):
        await end(tid, 1, 3, "0" * 32)
    tid = await begin()  # two chunks sent under each other's numbers: put in order, they are not the bytes
    await chunk(tid, 0, b"def")
    await chunk(tid, 1, b"abc")
    with pytest.raises(errors.InvalidRequest, match="digest"):
        await end(tid, 2, 6, _xxh3(b"abcdef"))
    tid = await begin()
    await chunk(tid, 1, b"def")  # chunk 0 never comes
    with pytest.raises(errors.InvalidRequest, match="chunks"):
        await end(tid, 2, 3, _xxh3(b"def"))
    tid = await begin()
    with pytest.raises(errors.InvalidRequest, match="window"):
        await chunk(tid, 10_000, b"far ahead")
    with pytest.raises(errors.NotFound):
        await chunk("abc123", 0, b"no such transfer")
    closed = await bus.request(sb._subject(wire.CLOSE), wire.CloseRequest(sandbox_id=sb.id, transfer_id=tid),
                               wire.Closed)
    assert closed.closed  # a refused chunk left its transfer as it was, until closed
    assert b".sandfleet-" not in (await sb.exec(["ls", "-a", "/workspace"])).stdout
    assert (await sb.exec(["test", "-e", "/workspace/f"])).exit_code == 1


async def test_a_transfer_whose_client_vanished_is_removed_after_its_idle_time(make):
    sb = await make()
    bus = sb._fleet.bus
    req = wire.UploadRequest(sandbox_id=sb.id, path="/workspace/abandoned", idle_s=1)
    tid = (await bus.request(sb._subject(wire.UPLOAD), req, wire.Transfer)).transfer_id
    await bus.request_raw(sb._subject(wire.UPLOAD_CHUNK), wire.UploadChunk(
        sandbox_id=sb.id, transfer_id=tid, seq=0), wire.ChunkAck, data=b"partial")
    assert b".abandoned.sandfleet-" in (await sb.exec(["ls", "-a", "/workspace"])).stdout
    for _ in range(100):  # the sweep runs every second
        if b".sandfleet-" not in (await sb.exec(["ls", "-a", "/workspace"])).stdout:
            break
        await asyncio.sleep(0.1)
    assert b".sandfleet-" not in (await sb.exec(["ls", "-a", "/workspace"])).stdout
    with pytest.raises(errors.NotFound):
        await bus.request_raw(sb._subject(wire.UPLOAD_CHUNK), wire.UploadChunk(
            sandbox_id=sb.id, transfer_id=tid, seq=1), wire.ChunkAck, data=b"late")


async def test_destroy_ends_the_transfers_in_progress(make, platform):
    sb = await make()
    bus = sb._fleet.bus
    up = await bus.request(sb._subject(wire.UPLOAD), wire.UploadRequest(sandbox_id=sb.id, path="/workspace/u",
                                                                        kind="dir"), wire.Transfer)
    down = await bus.request(sb._subject(wire.DOWNLOAD), wire.DownloadRequest(sandbox_id=sb.id, path="/workspace"),
                             wire.Transfer)
    await sb.destroy()  # the tar threads and fds go with it, or the root could not be released
    for tid in (up.transfer_id, down.transfer_id):
        with pytest.raises(errors.NotFound):
            await bus.request(sb._subject(wire.CLOSE), wire.CloseRequest(sandbox_id=sb.id, transfer_id=tid),
                              wire.Closed)
    launcher = platform.service_pid("launcher")
    threads = os.listdir(f"/proc/{launcher}/task")
    names = [open(f"/proc/{launcher}/task/{t}/comm").read().strip() for t in threads]
    assert "sandfleet-tar" not in names
    fds = [os.readlink(f"/proc/{launcher}/fd/{fd}") for fd in os.listdir(f"/proc/{launcher}/fd")]
    assert not [f for f in fds if sb.id in f or ".sandfleet-" in f]


async def test_the_tree_is_listed_stated_made_removed_and_renamed(make):
    sb = await make()
    await sb.files.mkdir("/workspace/a/b/c")
    await sb.upload(b"12345", "/workspace/a/b/f")
    assert (await sb.exec(["ln", "-s", "/etc", "/workspace/a/etc-link"])).exit_code == 0
    top = await sb.files.list("/workspace/a")
    assert [(e.path, e.kind) for e in top] == [("/workspace/a/b", "dir"), ("/workspace/a/etc-link", "symlink")]
    assert top[1].target == "/etc"
    deep = await sb.files.list("/workspace/a", depth=3)
    assert [e.path for e in deep] == ["/workspace/a/b", "/workspace/a/b/c", "/workspace/a/b/f",
                                      "/workspace/a/etc-link"]  # never through the symlink
    f = await sb.files.stat("/workspace/a/b/f")
    assert (f.kind, f.size, f.mode) == ("file", 5, 0o644)
    await sb.files.rename("/workspace/a/b/f", "/workspace/a/g")
    assert await sb.read_file("/workspace/a/g") == b"12345" and not await sb.files.exists("/workspace/a/b/f")
    with pytest.raises(errors.InvalidRequest, match="ENOTEMPTY"):
        await sb.files.remove("/workspace/a")
    await sb.files.remove("/workspace/a/etc-link")  # the link goes, not what it points to
    assert await sb.files.exists("/etc/hostname")
    await sb.files.remove("/workspace/a", recursive=True)
    assert not await sb.files.exists("/workspace/a")


async def test_bad_tree_operations_get_typed_errors_and_change_nothing(make):
    sb = await make()
    await sb.upload(b"x", "/workspace/file")
    assert (await sb.exec(["ln", "-s", "/", "/workspace/up"])).exit_code == 0
    with pytest.raises(errors.NotFound):
        await sb.files.stat("/workspace/missing")
    with pytest.raises(errors.NotFound):
        await sb.files.list("/workspace/missing")
    with pytest.raises(errors.InvalidRequest, match="ENOTDIR"):
        await sb.files.list("/workspace/file")
    with pytest.raises(errors.InvalidRequest, match="ENOTDIR"):
        await sb.files.mkdir("/workspace/file/sub")
    with pytest.raises(errors.NotFound):
        await sb.files.mkdir("/workspace/x/y", parents=False)
    with pytest.raises(errors.NotFound):
        await sb.files.rename("/workspace/missing", "/workspace/other")
    for bad in (lambda: sb.files.remove("/workspace/up/etc", recursive=True),
                lambda: sb.files.mkdir("/workspace/up/tmp/made"),
                lambda: sb.files.rename("/workspace/file", "/workspace/up/tmp/moved"),
                lambda: sb.files.remove("/workspace/../etc", recursive=True)):
        with pytest.raises(errors.InvalidRequest):
            await bad()
    assert await sb.files.exists("/etc/hostname") and await sb.files.exists("/workspace/file")
    assert not os.path.exists("/tmp/made") and not os.path.exists("/tmp/moved")


async def test_sandfleet_cp_copies_a_tree_in_and_out_with_progress(make, platform, tmp_path):
    import subprocess
    import sys
    sb = await make()
    _tree(tmp_path / "repo")
    (tmp_path / "repo" / "big.bin").write_bytes(os.urandom(9 << 20))  # several chunks: progress redraws
    up = await asyncio.to_thread(platform.cli, "cp", "--progress", str(tmp_path / "repo"), f"{sb.id}:/workspace/repo")
    assert f"{sb.id}:/workspace/repo" in up.stdout.decode() and b"/s" in up.stderr
    await asyncio.to_thread(platform.cli, "cp", f"{sb.id}:repo", str(tmp_path / "back"))  # relative: /workspace
    assert _describe(tmp_path / "back") == _describe(tmp_path / "repo")
    (tmp_path / "into").mkdir()  # an existing directory receives it under its own name
    await asyncio.to_thread(platform.cli, "cp", f"{sb.id}:/workspace/repo/tool", str(tmp_path / "into"))
    assert (tmp_path / "into" / "tool").read_bytes() == (tmp_path / "repo" / "tool").read_bytes()
    bad = await asyncio.to_thread(platform.cli, "cp", str(tmp_path / "repo"), str(tmp_path / "x"), check=False)
    assert bad.returncode == 2 and b"ID:path" in bad.stderr and b"Traceback" not in bad.stderr
    missing = await asyncio.to_thread(platform.cli, "cp", f"{sb.id}:/workspace/nope", str(tmp_path / "n"), check=False)
    assert missing.returncode == 2 and b"NotFound" in missing.stderr and not (tmp_path / "n").exists()
    # stdout closed before the summary is written (`| head -c0`): quiet, and the copy is done
    cmd = f"{sys.executable} -m sandfleet.cli cp {tmp_path / 'repo' / 'tool'} {sb.id}:/workspace/t2"
    piped = await asyncio.to_thread(subprocess.run, ["sh", "-c", f"{cmd} | true"], capture_output=True,
                                    env={**platform.env, "SANDFLEET_NATS_URL": platform.url}, timeout=60)
    assert b"Traceback" not in piped.stderr and b"BrokenPipe" not in piped.stderr
    assert await sb.read_file("/workspace/t2") == b"#!/bin/sh\necho tool\n"


async def _until(w, want: set[tuple[str, str]], got: list) -> None:
    while not want <= {(e.kind, e.path) for e in got}:
        events = await w.poll(wait_s=5)
        assert events or not w.ended, f"the watch ended with {got}"
        got.extend(events)


async def test_a_watch_sees_files_created_modified_and_removed(make):
    sb = await make()
    await sb.files.mkdir("/workspace/w/sub")
    async with sb.files.watch("/workspace/w", recursive=True) as w:
        await sb.exec(["sh", "-c", "echo 1 > /workspace/w/a; echo 2 >> /workspace/w/a; mkdir /workspace/w/new"])
        got: list = []
        await _until(w, {("created", "/workspace/w/a"), ("modified", "/workspace/w/a"),
                         ("created", "/workspace/w/new")}, got)
        await sb.exec(["sh", "-c", "echo 3 > /workspace/w/new/deep; rm /workspace/w/a; echo 4 > /workspace/w/sub/s"])
        await _until(w, {("created", "/workspace/w/new/deep"), ("removed", "/workspace/w/a"),
                         ("created", "/workspace/w/sub/s")}, got)
        assert w.dropped == 0
    assert w.ended


async def test_a_watch_ends_with_its_directory_and_refuses_bad_paths(make):
    sb = await make()
    await sb.files.mkdir("/workspace/gone")
    assert (await sb.exec(["ln", "-s", "/", "/workspace/up"])).exit_code == 0
    w = await sb.files.watch("/workspace/gone").start()
    await sb.files.remove("/workspace/gone")
    events = []
    while not w.ended:
        events += await w.poll(wait_s=5)
    with pytest.raises(errors.NotFound):
        await sb.files.watch("/workspace/missing").start()
    await sb.upload(b"x", "/workspace/file")
    with pytest.raises(errors.InvalidRequest, match="ENOTDIR"):
        await sb.files.watch("/workspace/file").start()
    with pytest.raises(errors.InvalidRequest):
        await sb.files.watch("/workspace/../etc").start()


async def test_a_slow_reader_loses_the_oldest_events_and_is_told(make):
    sb = await make()
    await sb.files.mkdir("/workspace/many")
    async with sb.files.watch("/workspace/many") as w:
        # more changes than the node's buffer holds (SANDFLEET_WATCH_BUFFER, 4096), nobody reading
        r = await sb.exec(["sh", "-c", "i=0; while [ $i -lt 6000 ]; do : > /workspace/many/f$i; i=$((i+1)); done"],
                          timeout_s=120)
        assert r.exit_code == 0
        got = await w.poll(wait_s=0)
        while batch := await w.poll(wait_s=0):
            got += batch
        assert w.dropped > 0 and len(got) <= 4096
        assert got[-1].path == "/workspace/many/f5999"  # the newest are kept


def _inotify_fds(pid: int) -> int:
    return sum(os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify" for fd in os.listdir(f"/proc/{pid}/fd"))


async def test_destroy_ends_a_watch_and_its_waiting_poll(make, platform):
    sb = await make()
    launcher = platform.service_pid("launcher")
    before = _inotify_fds(launcher)
    w = await sb.files.watch("/workspace").start()
    assert _inotify_fds(launcher) == before + 1
    waiting = asyncio.ensure_future(w.poll(wait_s=30))
    await asyncio.sleep(0.2)
    await sb.destroy()
    assert await waiting == [] and w.ended
    assert _inotify_fds(launcher) == before


class _GatedSink:
    """An upload's end whose writes of chosen chunks wait for a gate (or fail), for the node's
    order of writes and acks without a sandbox (services/launcher/files._write_in_order)."""

    def __init__(self, gated: bytes, failing: bytes = b"") -> None:
        import threading
        self.gate, self.gated, self.failing = threading.Event(), gated, failing
        self.size, self.written = 0, []

    def write(self, data: bytes) -> None:
        if data == self.gated:
            self.gate.wait(30)
        if data == self.failing:
            raise OSError(28, "No space left on device")
        self.written.append(data)
        self.size += len(data)

    def commit(self) -> None: ...

    def abort(self) -> None: ...


async def test_a_chunk_is_acked_when_it_is_written_not_with_those_written_after_it():
    from services.launcher.files import _write_in_order
    from services.launcher.transfers import Transfer

    sink = _GatedSink(gated=b"one")
    transfer = Transfer(id="t", end=sink, check="xxh3-128", idle_s=60)
    acks = [transfer.hold(seq, data, True) for seq, data in enumerate((b"zero", b"one", b"two"))]
    writer = asyncio.ensure_future(_write_in_order(transfer))
    await asyncio.wait_for(acks[0], 10)  # while chunk 1's write is held at its gate
    assert not acks[1].done() and not acks[2].done() and sink.written == [b"zero"]
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*acks, writer), 10)
    assert sink.written == [b"zero", b"one", b"two"] and transfer.next_seq == 3 and not transfer.acks


async def test_a_failed_write_fails_its_chunk_and_every_chunk_held_after_it():
    from services.launcher.files import _write_in_order
    from services.launcher.transfers import Transfer

    sink = _GatedSink(gated=b"", failing=b"one")
    transfer = Transfer(id="t", end=sink, check="xxh3-128", idle_s=60)
    acks = [transfer.hold(seq, data, True) for seq, data in enumerate((b"zero", b"one", b"two"))]
    await asyncio.wait_for(_write_in_order(transfer), 10)
    assert acks[0].result() is None and sink.written == [b"zero"]
    for ack in acks[1:]:
        with pytest.raises(errors.ServiceError, match="ENOSPC"):
            ack.result()
    assert transfer.failed is not None and not transfer.held and not transfer.acks

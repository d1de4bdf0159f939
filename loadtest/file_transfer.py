"""Uploads and downloads over the bus vs `tar` piped into the sandbox directly on the node.

    .venv/bin/python -m loadtest.file_transfer [--mb 1024] [--files 50000] [--rounds 3] [--isolation process]
                                               [--payloads file tree]

Two payloads: one file of `--mb` MiB (seeded random bytes, incompressible) and one tree of
`--files` small files (1 KiB each, 100 per directory). Each round, alternating sides:
  sdk      `sb.upload(local, path)` then `sb.download(path, local2)` through a platform
           started for the run (chunked, pipelined, xxh3-128 on both sides, temp file + rename);
  direct   what the node could do with no bus: `tar -c` of the local copy piped into
           `tar -x` under /proc/<init>/root (the host entering the sandbox's root, what it
           makes owned by the sandbox's mapped root, as an upload's files are), and back;
  bus      the bus's own ceiling (loadtest/bus_ceiling.py): the same number of bytes (a file's
           own, a tree's tar stream's size in zeros) in chunks of CHUNK_BYTES, WINDOW in
           flight, acked per chunk up and asked for per chunk down, between a plain nats-py
           requester and responder through the same nats-server and auth: no sandbox, no
           disk written, no sandfleet code.
Figures are medians over rounds in MB/s (10^6 bytes of payload per second; a tree counts its
files' bytes) and files/s for the tree; the ratio is sdk / direct (the issue's target: >= 0.5),
and beside it sdk / bus: how much of the gap is the bus, how much is ours.
Beside each, the CPU seconds each side used (medians): the client (this process), the launcher
and nats-server for the sdk; the two tars for direct; the requester ("client"), the responder
("node") and nats-server for bus. On a machine others share, wall time follows the load, CPU
seconds say what the path itself costs.

Where the time goes (perf and py-spy of a 1 GiB transfer): per GiB nats-server ~0.8 CPU-s
forwarding at GOGC=400 (its read, a fresh 4 MiB buffer per chunk and the copy into it, the copy
into the subscriber's queue, the write; 1.1 at Go's default GOGC, the collector a fifth of it);
the launcher ~0.8 up (the kernel's copy off the socket, straight into the chunk's buffer, and its
write into tmpfs, page allocation included, ~0.35; xxh3 ~0.07; the event loop's turns per read)
and ~0.6 down; the client ~0.4 up (the file read once into a reused buffer and hashed, then
sendfile: natspy_sendfile.py) and ~1.6 down (its write to the host's disk, which the direct tar
pays too). A tree adds the one ustar module (schemas/ustar.py) at both ends, about half of each
side's time in its syscalls (lstat/open/read/close to pack, open/write/utime/close to unpack),
the rest Python per member.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import sandfleet
from sandfleet import credentials
from schemas import files as wire
from linuxnode import procfs, userns
from loadtest import bus_ceiling
from loadtest.platform import running_platform
from loadtest.report import print_table, write_json

_TICK = os.sysconf("SC_CLK_TCK")
SIDES = ("sdk", "direct", "bus")


class CpuMeter:
    """CPU seconds used by this process, its reaped children (the direct side's tars) and the
    platform's services (the supervisor's children: launcher, nats-server, ...), by name."""

    def __init__(self, data_dir: Path) -> None:
        supervisor = json.loads((data_dir / "supervisor.json").read_text())["pid"]
        self.services: dict[int, str] = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            st = procfs.read_stat(int(pid))
            if st is not None and st.ppid == supervisor:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                name = next((a.decode().split(".")[-1] for a in argv if a.startswith(b"services.")), st.comm)
                self.services[int(pid)] = name

    def read(self) -> dict[str, float]:
        me = procfs.read_stat(os.getpid())
        used = {"client": (me.utime + me.stime) / _TICK, "children": me.children_time / _TICK}  # type: ignore[union-attr]
        for pid, name in self.services.items():
            st = procfs.read_stat(pid)
            if st is not None:
                used[name] = used.get(name, 0.0) + (st.utime + st.stime) / _TICK
        return used

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: round(after[k] - before.get(k, 0.0), 2) for k in after if after[k] - before.get(k, 0.0) >= 0.01}


def make_file(path: Path, mb: int) -> None:
    rng = random.Random(7)
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(rng.randbytes(1 << 20))
        _on_disk(f.fileno())


def _on_disk(fd: int) -> None:
    """Written back now, not ~30 s later (the kernel's dirty_expire) in the middle of the
    rounds, where its disk writes fell on whichever side ran then."""
    os.fsync(fd)


def make_tree(root: Path, files: int) -> None:
    rng = random.Random(8)
    for i in range(files):
        d = root / f"d{i // 100:04d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        (d / f"f{i:06d}.txt").write_bytes(rng.randbytes(1024))
    subprocess.run(["sync", "--file-system", str(root)], check=True)  # as make_file's fsync (syncfs)


def _tar_pipe(src_dir: str, dst_dir: str, only: str = ".", owner: int | None = None) -> None:
    """`tar -c | tar -x`; with `owner`, what is made belongs to that host id (the sandbox's root
    under its user namespace, as an upload's files do), so the sandbox can remove it."""
    os.makedirs(dst_dir, exist_ok=True)
    owned = [] if owner is None else [f"--owner={owner}", f"--group={owner}", "--numeric-owner"]
    if owner is not None:
        os.chown(dst_dir, owner, owner)
    pack = subprocess.Popen(["tar", "-C", src_dir, *owned, "-cf", "-", only], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-C", dst_dir, "-xf", "-"], stdin=pack.stdout, check=True)
    pack.stdout.close()  # type: ignore[union-attr]
    assert pack.wait() == 0


def _remove(path: Path) -> None:
    """What a round downloaded, a file (the sdk's) or a directory (the tar's). A file left there
    (rmtree of a file fails, and ignore_errors hid it) made every later sdk download a rename
    over it, which ext4 (auto_da_alloc) answers by writing the new file back at once: rounds 2-3
    took 2.4-4.2 s a GiB against round 1's 1.8-2.1."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


async def bus_round(url: str, payload: Path, stream_bytes: int, is_tree: bool,
                    cpu: CpuMeter) -> tuple[float, float, dict, dict]:
    """The bus side of a round: a file's own bytes, a tree's tar stream's size in zeros, each way."""
    options = credentials.connect_options(url)
    path = None if is_tree else str(payload)
    out = []
    for way in ("up", "down"):
        c0 = cpu.read()
        got = await asyncio.to_thread(bus_ceiling.measure, url, options, way, stream_bytes, wire.CHUNK_BYTES,
                                      wire.WINDOW, path)
        used = CpuMeter.spent(c0, cpu.read())
        used.pop("children", None)  # the two ends, reaped: said by name below
        out.append((got.seconds, used | got.cpu_s))
    (up, cpu_up), (down, cpu_down) = out
    return up, down, cpu_up, cpu_down


async def one_round(sb, init_pid: int, work: Path, payload: Path, is_tree: bool, side: str,
                    cpu: CpuMeter) -> tuple[float, float, dict, dict, int]:
    """(upload seconds, download seconds, upload CPU-s, download CPU-s, bytes sent) for one side."""
    remote = f"/workspace/bench-{side}"
    back = work / f"back-{side}"
    _remove(back)
    c0 = cpu.read()
    sent = 0
    if side == "sdk":
        t0 = time.perf_counter()
        sent = (await sb.upload(payload, remote)).size
        t1 = time.perf_counter()
        c1 = cpu.read()
        await sb.download(remote, back)
        t2 = time.perf_counter()
    else:
        root, owner = f"/proc/{init_pid}/root", userns.mapped_root(init_pid)
        t0 = time.perf_counter()
        if is_tree:
            await asyncio.to_thread(_tar_pipe, str(payload), root + remote, ".", owner)
        else:
            await asyncio.to_thread(_tar_pipe, str(payload.parent), root + remote, payload.name, owner)
        t1 = time.perf_counter()
        c1 = cpu.read()
        await asyncio.to_thread(_tar_pipe, root + remote, str(back))
        t2 = time.perf_counter()
    c2 = cpu.read()
    r = await sb.exec(["rm", "-rf", remote], timeout_s=600)
    assert r.exit_code == 0, r.stderr
    _remove(back)
    return t1 - t0, t2 - t1, CpuMeter.spent(c0, c1), CpuMeter.spent(c1, c2), sent


def median_cpu(rounds: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rounds for k in r})
    medians = {k: round(statistics.median(r.get(k, 0.0) for r in rounds), 2) for k in keys}
    return {k: v for k, v in medians.items() if v}  # a service idle in most rounds: left out


async def run(url: str, args: argparse.Namespace, work: Path, data_dir: Path) -> dict:
    cpu = CpuMeter(data_dir)
    big, tree = work / "big.bin", work / "tree"
    if "file" in args.payloads:
        make_file(big, args.mb)
    if "tree" in args.payloads:
        make_tree(tree, args.files)
    payloads = {"file": (big, False, args.mb << 20, 1), "tree": (tree, True, args.files * 1024, args.files)}
    payloads = {name: payloads[name] for name in args.payloads}
    results: dict = {}
    async with sandfleet.connect(url) as fleet:
        disk_mb = args.mb * 2 + 512
        kw = {"host_view": True} if args.isolation == "process" else {"isolation": "container", "layers": args.layers}
        sb = await fleet.create(memory_mb=512, disk_mb=disk_mb, timeout_s=7200, **kw)
        try:
            init_pid = (await sb.info()).init_pid
            for name, (payload, is_tree, nbytes, nfiles) in payloads.items():
                times: dict[str, dict[str, list[float]]] = {s: {"up": [], "down": []} for s in SIDES}
                cpus: dict[str, dict[str, list[dict]]] = {s: {"up": [], "down": []} for s in SIDES}
                stream_bytes = nbytes  # a tree's: its tar stream's, as the first upload says
                for rnd in range(args.rounds):
                    for side in (SIDES if rnd % 2 == 0 else tuple(reversed(SIDES))):
                        if side == "bus":
                            up, down, cpu_up, cpu_down = await bus_round(url, payload, stream_bytes, is_tree, cpu)
                        else:
                            up, down, cpu_up, cpu_down, sent = await one_round(sb, init_pid, work, payload, is_tree,
                                                                               side, cpu)
                            stream_bytes = sent or stream_bytes
                        times[side]["up"].append(up)
                        times[side]["down"].append(down)
                        cpus[side]["up"].append(cpu_up)
                        cpus[side]["down"].append(cpu_down)
                row = {}
                for way in ("up", "down"):
                    sdk, direct = statistics.median(times["sdk"][way]), statistics.median(times["direct"][way])
                    bus = statistics.median(times["bus"][way])
                    row[way] = {"sdk_mb_s": round(nbytes / sdk / 1e6, 1), "direct_mb_s": round(nbytes / direct / 1e6, 1),
                                "bus_mb_s": round(nbytes / bus / 1e6, 1), "of_bus": round(bus / sdk, 3),
                                "bus_s": round(bus, 3), "bus_rounds_s": [round(t, 3) for t in times["bus"][way]],
                                "bus_cpu_s": median_cpu(cpus["bus"][way]), "stream_bytes": stream_bytes,
                                "sdk_files_s": round(nfiles / sdk, 1), "direct_files_s": round(nfiles / direct, 1),
                                "ratio": round(direct / sdk, 3), "sdk_s": round(sdk, 3), "direct_s": round(direct, 3),
                                "sdk_rounds_s": [round(t, 3) for t in times["sdk"][way]],
                                "direct_rounds_s": [round(t, 3) for t in times["direct"][way]],
                                "sdk_cpu_s": median_cpu(cpus["sdk"][way]), "direct_cpu_s": median_cpu(cpus["direct"][way])}
                results[name] = row
        finally:
            await sb.destroy()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--payloads", nargs="+", choices=["file", "tree"], default=["file", "tree"])
    ap.add_argument("--isolation", choices=["process", "container"], default="process")
    ap.add_argument("--layers", nargs="*", default=[], help="for --isolation container: the root's layers")
    ap.add_argument("--out", type=Path, default=Path("results/file_transfer.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandfleet-file-transfer-") as tmp:
        with running_platform(f"bench-files-{os.getpid()}") as (url, data_dir):
            results = asyncio.run(run(url, args, Path(tmp), data_dir))
    rows = []
    for name, row in results.items():
        for way in ("up", "down"):
            r = row[way]
            cpu = " ".join(f"{k} {v}" for k, v in r["sdk_cpu_s"].items())
            direct_cpu = sum(r["direct_cpu_s"].values())
            bus_cpu = " ".join(f"{k} {v}" for k, v in r["bus_cpu_s"].items())
            rows.append([f"{name} {way}", r["sdk_mb_s"], r["direct_mb_s"], r["bus_mb_s"],
                         r["sdk_files_s"] if name == "tree" else "", r["direct_files_s"] if name == "tree" else "",
                         r["ratio"], r["of_bus"], cpu, round(direct_cpu, 2), bus_cpu])
    print_table(f"file transfer ({args.mb} MiB file, {args.files} files, {args.isolation}, medians of {args.rounds})",
                ["what", "sdk MB/s", "direct MB/s", "bus MB/s", "sdk files/s", "direct files/s", "sdk/direct",
                 "sdk/bus", "sdk CPU-s", "direct CPU-s", "bus CPU-s"], rows)
    print(f"\nwrote {write_json(args.out, 'file_transfer', vars(args) | {'out': str(args.out)}, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

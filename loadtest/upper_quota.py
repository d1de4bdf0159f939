"""What the per-sandbox disk quota costs: a root's upper dir on a size-limited tmpfs vs on the data dir.

    .venv/bin/python -m loadtest.upper_quota [--n 300] [--rounds 3] [--hold 500]

One small EROFS layer is mounted once; each cycle then does what the layer-cache does for a
root (make its dir, [mount a tmpfs of 1024 MiB on it], make upper/work/rootfs, mount the
overlay, unmount, [unmount the tmpfs], remove the dir), with and without the tmpfs, rounds
alternating. `--hold` roots of each kind are then kept mounted at once to read the kernel
memory (Slab + page tables, /proc/meminfo) that each costs, and 64 MiB are written through
one overlay of each kind to compare write throughput.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from loadtest.report import percentiles, print_table, write_json
from linuxnode import syscalls as linux

DISK_MB = 1024


def _meminfo_kb(*keys: str) -> int:
    found = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            found[name] = int(value.split()[0])
    return sum(found[k] for k in keys)


def compose(root: Path, lower: str, quota: bool) -> None:
    root.mkdir()
    if quota:
        linux.mount("upper", str(root), "tmpfs", linux.MS_NODEV, f"size={DISK_MB}m,mode=0755")
    for name in ("upper", "work", "rootfs"):
        (root / name).mkdir()
    linux.mount("overlay", str(root / "rootfs"), "overlay", linux.MS_NODEV,
                f"lowerdir={lower},upperdir={root}/upper,workdir={root}/work")


def release(root: Path, quota: bool) -> None:
    linux.umount2(str(root / "rootfs"))
    if quota:
        linux.umount2(str(root))
    shutil.rmtree(root)


def write_mb_per_s(root: Path) -> float:
    started = time.perf_counter()
    with open(root / "rootfs" / "blob", "wb") as f:
        chunk = b"\1" * (1 << 20)
        for _ in range(64):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return 64 / (time.perf_counter() - started)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hold", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("results/upper_quota.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sandfleet-upper-quota-", dir=os.environ.get("SANDFLEET_DATA_DIR")))
    tree, image, lower = work / "tree", work / "layer.erofs", work / "lower"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hostname").write_text("bench\n")
    subprocess.run(["mkfs.erofs", "-zlz4", "--quiet", str(image), str(tree)], check=True)
    lower.mkdir()
    linux.mount(str(image), str(lower), "erofs", linux.MS_RDONLY | linux.MS_NODEV, "directio")
    sides = {"tmpfs upper (disk_mb)": True, "upper on the data dir": False}
    lat: dict[str, list[float]] = {s: [] for s in sides}
    rates: dict[str, list[float]] = {s: [] for s in sides}
    results: dict[str, dict] = {}
    try:
        for r in range(args.rounds):
            for side, quota in sides.items():
                started = time.perf_counter()
                for i in range(args.n):
                    t0 = time.perf_counter()
                    root = work / f"r{r}-{i}"
                    compose(root, str(lower), quota)
                    release(root, quota)
                    lat[side].append((time.perf_counter() - t0) * 1000)
                rates[side].append(args.n / (time.perf_counter() - started))
        for side, quota in sides.items():
            before = _meminfo_kb("Slab", "PageTables")
            held = [work / f"hold-{quota}-{i}" for i in range(args.hold)]
            for root in held:
                compose(root, str(lower), quota)
            per_root_kib = (_meminfo_kb("Slab", "PageTables") - before) / args.hold
            throughput = write_mb_per_s(held[0])
            for root in held:
                release(root, quota)
            results[side] = {"cycles_per_s": round(statistics.median(rates[side]), 1),
                             **{f"cycle_ms_{k}": v for k, v in percentiles(lat[side]).items()},
                             "kernel_kib_per_root": round(per_root_kib, 1), "write_64mib_mb_per_s": round(throughput)}
    finally:
        for entry in sorted(e for e in work.iterdir() if e.name.startswith(("r", "hold-"))):
            for point in (entry / "rootfs", entry):
                try:
                    linux.umount2(str(point), linux.MNT_DETACH)
                except OSError:
                    pass
        linux.umount2(str(lower), linux.MNT_DETACH)
        shutil.rmtree(work, ignore_errors=True)
    print_table(f"root compose + release, {args.n} x {args.rounds} rounds; {args.hold} roots held",
                ["upper dir", "cycles/s", "p50 ms", "p99 ms", "kernel KiB/root", "write MB/s"],
                [[s, v["cycles_per_s"], v["cycle_ms_p50"], v["cycle_ms_p99"], v["kernel_kib_per_root"],
                  v["write_64mib_mb_per_s"]] for s, v in results.items()])
    out = write_json(args.out, "upper_quota", vars(args) | {"out": str(args.out)}, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cold burst: N sandboxes at once from a big image, lazy fetch beside full fetch, empty node cache each time.

    .venv/bin/python -m loadtest.cold_burst [--n 64] [--rounds 1] [--isolation container]
                                            [--packages python3 python3-numpy ...] [--cpu-hogs K]

One data dir (so one JetStream store) for the whole run: the image is built once (a Debian
root with `--packages`, plus a small task layer holding the script), then for each round
and each mode the platform comes up with `sandfleet up --fetch MODE`, the node's cache is
emptied (`layer cache --drop`), and N sandboxes are created at once; each runs the task
(imports a few modules, a small computation). Reported per mode: time until every sandbox
runs, time until every task is done, and the bytes the node fetched from the store and
wrote to its disk for the two layers (from the layer-cache's own counters). Rounds
alternate the modes so both see the same machine noise; times are medians over rounds.
`--cpu-hogs K` keeps K busy processes running through each burst: CPU pressure from outside
the platform, which every read a lazy layer serves from its FUSE daemon has to get past.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sandfleet
from loadtest.report import print_table, write_json
from sandfleet.layers_client import connect
from sandfleet.config import free_port

NODE = os.environ.get("SANDFLEET_NODE_ID", "bench-cold")  # a run beside other runs needs its own node
BASE, TASK = "cold-burst-base", "cold-burst-task"
DEFAULT_PACKAGES = ["python3", "python3-numpy", "python3-scipy", "python3-pandas"]
TASK_SCRIPT = """\
import csv, decimal, email.parser, fractions, io, json, sqlite3, statistics, xml.dom.minidom
rows = list(csv.reader(io.StringIO("a,b\\n1,2\\n3,4\\n")))
db = sqlite3.connect(":memory:")
db.execute("create table t (x)")
db.executemany("insert into t values (?)", [(i,) for i in range(1000)])
total = db.execute("select sum(x) from t").fetchone()[0]
print(json.dumps({"rows": len(rows), "sum": total, "mean": statistics.mean(range(100)),
                  "third": str(fractions.Fraction(1, 3)), "d": str(decimal.Decimal("1.10") * 3)}))
"""
CLI = [sys.executable, "-m", "sandfleet.cli"]


def up(data_dir: Path, fetch: str) -> str:
    out = subprocess.run([*CLI, "up", "--detach", "--port", str(free_port()), "--data-dir", str(data_dir),
                          "--node-id", NODE, "--fetch", fetch], capture_output=True, text=True,
                         # A burst is CPU pressure by design: admission must not refuse its own burst.
                         env={"SANDFLEET_CPU_PSI_LIMIT": "0", **os.environ, "SANDFLEET_LOG_LEVEL": "WARNING"})
    if out.returncode != 0:
        raise SystemExit(f"sandfleet up failed: {out.stderr}")
    return out.stdout.strip()


def down(data_dir: Path) -> None:
    subprocess.run([*CLI, "down", "--data-dir", str(data_dir)], capture_output=True, timeout=300)


async def build(url: str, packages: list[str], work: Path) -> dict:
    layers = await connect(url)
    try:
        have = {layer.name for layer in await layers.list()}
        if BASE not in have:
            print(f"building {BASE} from Debian: {' '.join(packages)} (once)", flush=True)
            await layers.build_debian(BASE, packages)
        task = work / "task"
        (task / "workspace").mkdir(parents=True, exist_ok=True)
        (task / "workspace" / "task.py").write_text(TASK_SCRIPT)
        await layers.build_dir(TASK, task, on=BASE)
        base = await layers.get(BASE)
        return {"image_bytes": base.size, "content_bytes": base.content_bytes, "files": base.files}
    finally:
        await layers.bus.close()


async def burst(url: str, n: int, isolation: str) -> dict:
    layers = await connect(url)
    try:
        await layers.cache_drop(NODE)
        async with sandfleet.connect(url, name="bench-cold") as fleet:
            start = time.perf_counter()
            running: list[float] = []
            done: list[float] = []
            failures: list[str] = []

            async def one() -> sandfleet.Sandbox | None:
                sb = None
                try:
                    sb = await fleet.create(isolation=isolation, layers=[BASE, TASK], memory_mb=256, cpu=0.5)
                    running.append(time.perf_counter() - start)
                    r = await sb.exec(["python3", "/workspace/task.py"], timeout_s=300)
                    done.append(time.perf_counter() - start)
                    if r.exit_code != 0:
                        failures.append(f"task: {r.exit_code} {r.stderr[-200:]!r}")
                except sandfleet.errors.SandfleetError as exc:
                    failures.append(f"{'exec' if sb else 'create'}: {exc}")
                return sb

            boxes = await asyncio.gather(*(one() for _ in range(n)))
            listing = await layers.cache(NODE)
            await asyncio.gather(*(sb.destroy() for sb in boxes if sb is not None))
        used = [i for i in listing.images if {f"{BASE}", f"{TASK}"} & set(i.names)]
        return {
            "to_all_running_s": round(max(running, default=0.0), 3),
            "to_all_done_s": round(max(done, default=0.0), 3),
            "fetched_bytes": sum(i.fetched_bytes for i in used),
            "written_bytes": sum(i.written_bytes for i in used),
            "image_bytes": sum(i.size for i in used),
            "lazy": [i.lazy for i in used],
            "failures": failures[:5],
            "failed": len(failures),
        }
    finally:
        await layers.bus.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64, help="sandboxes per burst")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--isolation", default="container", choices=["container", "process"])
    ap.add_argument("--packages", nargs="+", default=DEFAULT_PACKAGES, help="Debian packages of the base layer")
    ap.add_argument("--data-dir", type=Path, default=None, help="keep the store here (reused: the image is built once)")
    ap.add_argument("--cpu-hogs", type=int, default=0, help="busy processes running through each burst")
    ap.add_argument("--out", type=Path, default=Path("results/cold_burst.json"))
    args = ap.parse_args()

    runs: dict[str, list[dict]] = {"lazy": [], "full": []}
    with tempfile.TemporaryDirectory(prefix="sandfleet-cold-") as tmp:
        data_dir = (args.data_dir or Path(tmp) / "data").resolve()
        url = up(data_dir, "full")
        try:
            image = asyncio.run(build(url, args.packages, Path(tmp)))
        finally:
            down(data_dir)
        print(f"base image: {image['image_bytes'] / 2**20:.0f} MiB ({image['content_bytes'] / 2**20:.0f} MiB of "
              f"files, {image['files']} entries)", flush=True)
        for r in range(args.rounds):
            for mode in (("lazy", "full") if r % 2 == 0 else ("full", "lazy")):
                url = up(data_dir, mode)
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.cpu_hogs)]
                try:
                    got = asyncio.run(burst(url, args.n, args.isolation))
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait()
                    down(data_dir)
                runs[mode].append(got)
                print(f"round {r + 1}/{args.rounds} {mode}: running {got['to_all_running_s']:.2f}s, done "
                      f"{got['to_all_done_s']:.2f}s, fetched {got['fetched_bytes'] / 2**20:.1f} MiB, written "
                      f"{got['written_bytes'] / 2**20:.1f} MiB, {got['failed']} failed {got['failures'][:1]}", flush=True)

    def med(mode: str, key: str) -> float:
        return round(statistics.median(run[key] for run in runs[mode]), 3)

    results: dict = {"image": image}
    for mode in runs:
        results[mode] = {k: med(mode, k) for k in ("to_all_running_s", "to_all_done_s", "fetched_bytes", "written_bytes")}
        results[mode]["rounds"] = runs[mode]
    lazy, full = results["lazy"], results["full"]
    results["speedup_to_all_done"] = round(full["to_all_done_s"] / lazy["to_all_done_s"], 2) if lazy["to_all_done_s"] else 0
    results["fetched_saved"] = round(1 - lazy["fetched_bytes"] / full["fetched_bytes"], 3) if full["fetched_bytes"] else 0
    results["written_saved"] = round(1 - lazy["written_bytes"] / full["written_bytes"], 3) if full["written_bytes"] else 0
    print_table(
        f"cold burst: {args.n} {args.isolation} sandboxes, empty node cache, {args.cpu_hogs} CPU hog(s), "
        f"median of {args.rounds} round(s)",
        ["fetch", "all running s", "all done s", "fetched MiB", "written MiB"],
        [[m, results[m]["to_all_running_s"], results[m]["to_all_done_s"], results[m]["fetched_bytes"] / 2**20,
          results[m]["written_bytes"] / 2**20] for m in ("lazy", "full")],
    )
    print(f"lazy vs full: {results['speedup_to_all_done']}x to all done; "
          f"{100 * results['fetched_saved']:.0f}% fewer bytes fetched, {100 * results['written_saved']:.0f}% fewer written")
    out = write_json(args.out, "cold_burst", {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

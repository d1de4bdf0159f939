"""Density: how many idle `container` sandboxes (each running `sleep`) this machine holds at once.

    .venv/bin/python -m loadtest.density [--max 3200] [--batch 100]     # --max 50 for a smoke run

Steps up in batches (one `create_many` each, then `sleep` started in every new sandbox) until
a create fails, memory runs short (MemAvailable under --reserve-mb) or --max is reached. It
reports the platform's own memory (PSS of the supervisor, nats-server and every service, from
/proc/<pid>/smaps_rollup) and the memory one idle sandbox costs: the host's used memory
(MemTotal - MemAvailable) grown per sandbox, split into kernel (slab, page tables, kernel
stacks) and the PSS of the sandbox's own processes, plus what its memory cgroup is charged.
Then it destroys everything and checks that no overlay, cgroup, network namespace or
process of the node is left.

Each batch also records the mount tables as the node fills: the host's (which roots no
longer enter: linuxnode.roots_ns) and the node's roots namespace's, and what a new mount
namespace costs on the host then (`unshare -m true`, median of 5: every namespace a tool or
runtime makes on the host copies the host's table), and the CPU the platform's processes
used for the batch: on a machine others share, the batch's wall time mostly says how busy
they are; a per-batch CPU that stays flat says no work per create grows with the node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sandfleet
from linuxnode import cgroups, procfs, roots_ns
from loadtest.container_rate import LAYER, build_busybox_layer
from loadtest.platform import leftovers, running_platform
from loadtest.report import print_table, write_json

KIB = 1024
CPU = 0.1  # what each sandbox asks
SLEEP = ["sh", "-c", "sleep 2147483647 </dev/null >/dev/null 2>&1 &"]


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f}


def used_kib(m: dict[str, int]) -> int:
    return m["MemTotal"] - m["MemAvailable"]


def kernel_kib(m: dict[str, int]) -> int:
    return m["Slab"] + m["PageTables"] + m["KernelStack"]


BREAKDOWN_FIELDS = ("SUnreclaim", "SReclaimable", "Percpu", "VmallocUsed", "PageTables", "KernelStack", "Shmem",
                    "Cached", "Buffers", "AnonPages")


def kernel_snapshot() -> dict[str, dict[str, int]]:
    """What the kernel holds, to split a sandbox's kernel memory by where it goes: /proc/meminfo's
    kernel fields (KiB), the bytes of each slab cache's slabs, and each controller's cgroup count
    from /proc/cgroups (which counts dying cgroups too)."""
    page = os.sysconf("SC_PAGE_SIZE")
    slabs = {}
    with open("/proc/slabinfo") as f:
        for line in f.readlines()[2:]:
            name, rest = line.split(None, 1)
            fields = rest.split()
            slabs[name] = int(fields[13]) * int(fields[4]) * page // KIB  # num_slabs * pages a slab
    with open("/proc/cgroups") as f:
        cgroup_counts = {line.split()[0]: int(line.split()[2]) for line in f if not line.startswith("#")}
    m = meminfo()
    return {"meminfo_kib": {k: m.get(k, 0) for k in BREAKDOWN_FIELDS}, "slab_kib": slabs, "cgroups": cgroup_counts}


def kernel_breakdown(before: dict, after: dict, n: int, top: int = 12) -> dict[str, dict[str, float]]:
    """Per sandbox: growth of each meminfo field and of the `top` slab caches that grew most (KiB),
    and of each controller's cgroup count."""
    def per(a: dict[str, int], b: dict[str, int]) -> dict[str, float]:
        return {k: round((b.get(k, 0) - a.get(k, 0)) / n, 1) for k in b}
    slabs = per(before["slab_kib"], after["slab_kib"])
    return {"meminfo_kib": per(before["meminfo_kib"], after["meminfo_kib"]),
            "slab_kib": dict(sorted(slabs.items(), key=lambda kv: -kv[1])[:top]),
            "cgroups": per(before["cgroups"], after["cgroups"])}


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def mount_tables(node_id: str) -> dict[str, float]:
    """Lines of the host's mount table and of the node's roots namespace's, and the host's
    `unshare -m true` in ms (median of 5)."""
    with open("/proc/self/mountinfo") as f:
        host = sum(1 for _ in f)
    roots = len((roots_ns.read_mountinfo(node_id) or "").splitlines())
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run(["unshare", "-m", "true"], check=True)
        times.append((time.perf_counter() - t0) * 1000)
    return {"host_mounts": host, "roots_mounts": roots, "unshare_ms": round(statistics.median(times), 1)}


def platform_pss_kib(data_dir: Path) -> dict[str, int]:
    """PSS of each platform process: the supervisor, nats-server and the services."""
    state = json.loads((data_dir / "supervisor.json").read_text())
    found = {"supervisor": pss_kib(state["pid"])}
    found.update({name: pss_kib(pid) for name, pid in state["services"].items()})
    return found


def platform_cpu_s(data_dir: Path) -> float:
    """CPU seconds the platform's processes have used so far (user + system, with their reaped
    children: crun and its prelude are the launcher's). Per batch it says whether the work per
    sandbox grows as the node fills, which the batch's wall time on a shared machine cannot."""
    state = json.loads((data_dir / "supervisor.json").read_text())
    ticks = 0
    for pid in (state["pid"], *state["services"].values()):
        stat = procfs.read_stat(pid)
        if stat is not None:
            ticks += stat.utime + stat.stime + stat.children_time
    return ticks / os.sysconf("SC_CLK_TCK")


def sandbox_memory(node_id: str, sandbox_ids: list[str]) -> dict[str, float]:
    """Per sandbox (mean over the sample): the PSS of its processes and its cgroup's charge."""
    pss, charged, procs = [], [], []
    layout = cgroups.CgroupLayout.detect()
    for sid in sandbox_ids:
        group = cgroups.SandboxCgroups(layout, node_id, sid)
        try:
            pids = group.pids()
            with open(group.memory_charged_file) as f:
                charged.append(int(f.read()) / KIB)
        except OSError:  # it ended meanwhile
            continue
        procs.append(len(pids))
        pss.append(sum(pss_kib(p) for p in pids))
    mean = lambda xs: round(statistics.mean(xs), 1) if xs else 0.0  # noqa: E731
    return {"processes_pss_kib": mean(pss), "cgroup_charged_kib": mean(charged), "processes": mean(procs)}


async def _start_sleep(boxes: list[sandfleet.Sandbox], concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(sb: sandfleet.Sandbox) -> None:
        async with gate:
            r = await sb.exec(SLEEP)
            if r.exit_code != 0:
                raise RuntimeError(f"starting sleep in {sb.id} exited {r.exit_code}: {r.stderr[-200:]!r}")

    await asyncio.gather(*(one(sb) for sb in boxes))


async def _destroy(boxes: list[sandfleet.Sandbox], concurrency: int) -> list[str]:
    """Destroy them all; what failed, as text (it must not hide why the fill stopped, nor stop the rest)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(sb: sandfleet.Sandbox) -> None:
        async with gate:
            await sb.destroy()

    done = await asyncio.gather(*(one(sb) for sb in boxes), return_exceptions=True)
    return [f"{sb.id}: {r!r}" for sb, r in zip(boxes, done) if isinstance(r, BaseException)]


async def step_up(url: str, node_id: str, data_dir: Path, args: argparse.Namespace) -> dict:
    async with sandfleet.connect(url, name="bench-density") as fleet:
        await build_busybox_layer(fleet)
        warm = await fleet.create(isolation="container", layers=[LAYER], memory_mb=args.memory_mb)
        await warm.exec(["true"])
        await warm.destroy()
        await asyncio.sleep(1.0)
        before, platform_before, kernel_before = meminfo(), platform_pss_kib(data_dir), kernel_snapshot()
        boxes: list[sandfleet.Sandbox] = []
        steps, limit = [], f"reached --max {args.max}"
        start = time.perf_counter()
        try:
            while len(boxes) < args.max:
                n = min(args.batch, args.max - len(boxes))
                t0, cpu0 = time.perf_counter(), platform_cpu_s(data_dir)
                try:
                    made = await fleet.create_many(n, isolation="container", layers=[LAYER],
                                                   memory_mb=args.memory_mb, cpu=CPU, pids=64)
                except sandfleet.errors.SandfleetError as exc:
                    boxes += getattr(exc, "created", [])
                    limit = f"a create failed at {len(boxes)}: {exc}"
                    break
                boxes += made
                await _start_sleep(made, args.concurrency)
                batch_s, batch_cpu_s = time.perf_counter() - t0, platform_cpu_s(data_dir) - cpu0
                m = meminfo()
                steps.append({"sandboxes": len(boxes), "batch_s": round(batch_s, 2), "platform_cpu_s": round(batch_cpu_s, 2),
                              "used_mib": round(used_kib(m) / KIB), "available_mib": round(m["MemAvailable"] / KIB),
                              **mount_tables(node_id)})
                print(f"{len(boxes):6d} sandboxes  batch {steps[-1]['batch_s']:6.2f}s  cpu {batch_cpu_s:5.2f}s  "
                      f"used {steps[-1]['used_mib']} MiB  available {steps[-1]['available_mib']} MiB  "
                      f"mounts host {steps[-1]['host_mounts']} roots {steps[-1]['roots_mounts']}  "
                      f"unshare -m {steps[-1]['unshare_ms']} ms", flush=True)
                if m["MemAvailable"] < args.reserve_mb * KIB:
                    limit = f"memory: MemAvailable {m['MemAvailable'] // KIB} MiB < reserve {args.reserve_mb} MiB"
                    break
            held_s = time.perf_counter() - start
            after, platform_after, kernel_after = meminfo(), platform_pss_kib(data_dir), kernel_snapshot()
            sample = sandbox_memory(node_id, [sb.id for sb in boxes[:: max(1, len(boxes) // 20)]])
        finally:
            t0 = time.perf_counter()
            destroy_failed = await _destroy(boxes, args.concurrency)
            # A failed create_many names what had no outcome in time: the node may have made those
            # since, and they are not in `boxes`.
            known = {sb.id for sb in boxes}
            late = [await fleet.sandbox(r.id) for r in await fleet.list() if r.id not in known]
            destroy_failed += await _destroy(late, args.concurrency)
            destroy_s = time.perf_counter() - t0
            if destroy_failed:
                print(f"{len(destroy_failed)} destroy(s) failed, e.g. {destroy_failed[:3]}", flush=True)
        await asyncio.sleep(1.0)
        n = max(1, len(boxes))
        platform_growth = sum(platform_after.values()) - sum(platform_before.values())
        kernel = (kernel_kib(after) - kernel_kib(before)) / n
        per_sandbox_used = (used_kib(after) - used_kib(before) - platform_growth) / n
        return {
            "sandboxes_held": len(boxes),
            "limited_by": limit,
            "seconds_to_fill": round(held_s, 1),
            "seconds_to_destroy_all": round(destroy_s, 1),
            "destroys_failed": destroy_failed[:20],
            "platform_pss_mib": {k: round(v / KIB, 1) for k, v in platform_after.items()},
            "platform_pss_mib_total": round(sum(platform_after.values()) / KIB, 1),
            "platform_pss_mib_total_idle": round(sum(platform_before.values()) / KIB, 1),
            "per_sandbox_kib": {
                # Host-wide figures: on a machine others share, their memory moves these too.
                "host_used": round(per_sandbox_used, 1),
                "kernel": round(kernel, 1),
                "kernel_plus_processes": round(kernel + sample["processes_pss_kib"], 1),
                **sample,
            },
            # Host-wide too: what others on the machine make and free moves these.
            "kernel_per_sandbox": kernel_breakdown(kernel_before, kernel_after, n),
            "fits_in_available_memory": int(before["MemAvailable"] / per_sandbox_used) if per_sandbox_used > 0 else None,
            "steps": steps,
            "left_after_destroy": leftovers([node_id], data_dir),
            "live_after_destroy": len(await fleet.list()),
            "data_dir": str(data_dir),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, default=3200, help="stop at this many sandboxes")
    ap.add_argument("--batch", type=int, default=100, help="sandboxes per create_many")
    ap.add_argument("--concurrency", type=int, default=16, help="parallel execs and destroys")
    ap.add_argument("--memory-mb", type=int, default=64, help="each sandbox's memory limit")
    ap.add_argument("--reserve-mb", type=int, default=1024, help="stop when MemAvailable falls below this")
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/density.json"))
    args = ap.parse_args()
    # The node's sandbox capacity (2000 by default) must not be what stops the count, nor placement's
    # overcommit of what the sandboxes ask (0.1 CPU and --memory-mb each: at the default 200x the
    # cores and 10x the RAM, 2 cores and 24 GiB admit ~3,700), nor the host's pressure (others'
    # work on a shared machine stalls it too: 30% memory PSI stopped a fill at 5,800 with 10 GiB
    # free): only the machine's memory may (--reserve-mb).
    cores, ram_mb = os.cpu_count() or 1, meminfo()["MemTotal"] // KIB
    capacity = {"SANDFLEET_CAPACITY": str(max(args.max, 2000)), "SANDFLEET_CPU_PSI_LIMIT": "0",
                "SANDFLEET_MEMORY_PSI_LIMIT": "0",
                "SANDFLEET_CPU_OVERCOMMIT": str(max(200.0, 2 * args.max * CPU / cores)),
                "SANDFLEET_MEMORY_OVERCOMMIT": str(max(10.0, 2 * args.max * args.memory_mb / ram_mb))}
    with running_platform(args.node_id, capacity) as (url, data_dir):
        results = asyncio.run(step_up(url, args.node_id, data_dir, args))
    per = results["per_sandbox_kib"]
    print_table(
        f"idle container sandboxes (each running sleep), batches of {args.batch}",
        ["held", "limited by", "platform PSS MiB", "per sandbox KiB: host used", "kernel", "processes PSS",
         "kernel + processes", "cgroup charge"],
        [[results["sandboxes_held"], results["limited_by"], results["platform_pss_mib_total"], per["host_used"],
          per["kernel"], per["processes_pss_kib"], per["kernel_plus_processes"], per["cgroup_charged_kib"]]],
    )
    first, last = results["steps"][0], results["steps"][-1]
    print(f"batch of {args.batch}: first {first['batch_s']} s, last {last['batch_s']} s "
          f"({last['batch_s'] / first['batch_s']:.2f}x), platform CPU {first['platform_cpu_s']} -> {last['platform_cpu_s']} s "
          f"({last['platform_cpu_s'] / max(first['platform_cpu_s'], 0.01):.2f}x); host mounts {first['host_mounts']} -> {last['host_mounts']}, "
          f"roots namespace {first['roots_mounts']} -> {last['roots_mounts']}; "
          f"unshare -m {first['unshare_ms']} -> {last['unshare_ms']} ms")
    kernel = results["kernel_per_sandbox"]
    print("kernel KiB per sandbox:", " ".join(f"{k} {v}" for k, v in kernel["meminfo_kib"].items()))
    print("  slab caches:", " ".join(f"{k} {v}" for k, v in kernel["slab_kib"].items()))
    print("  cgroups per sandbox:", " ".join(f"{k} {v}" for k, v in kernel["cgroups"].items() if v))
    print(f"fill {results['seconds_to_fill']} s, destroy all {results['seconds_to_destroy_all']} s; "
          f"left after destroy: {results['left_after_destroy'] or 'nothing'}, live records: {results['live_after_destroy']}")
    out = write_json(args.out, "density", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     results)
    print(f"wrote {out}")
    return 0 if not results["left_after_destroy"] and not results["live_after_destroy"] else 1


if __name__ == "__main__":
    sys.exit(main())

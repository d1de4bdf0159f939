"""Container create → exec `true` → destroy cycles: the platform end to end, beside plain crun.

    .venv/bin/python -m loadtest.container_rate [--n 200] [--concurrency 8] [--rounds 3]

The platform side is `sandfleet up` on a free port with the SDK creating `container` sandboxes
over a busybox layer. The baseline is what a person would write to drive crun by hand: a
separate process in its own mount namespace (on a hybrid cgroup host, with the v2 hierarchy
unmounted, which crun 1.8 needs) that per cycle mounts an overlay over the very same EROFS
layer mounts the platform uses, writes its own bundle, and calls `crun run --detach`,
`crun exec true`, `crun delete --force` as subprocesses. crun manages that container's cgroups
and network namespace itself, with the same limits and isolation the platform applies. Rounds
alternate so both sides see the same machine noise; cycles/s is the median over rounds.

CPU per cycle is reported beside the rate, as it holds up better on a busy machine: for the
platform, every process under the supervisor (each service, its helpers such as the
launcher's spawner, and what each reaped: crun, the containers) plus this process (the SDK
client), summed over the live tree before and after a round (own + reaped children's ticks of
every process, which is conserved when a process is reaped); for the baseline, its whole
process tree (what this process reaped from it) less its interpreter's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sandfleet
from loadtest.platform import running_platform
from loadtest.report import percentiles, print_table, write_json
from linuxnode import procfs, roots_ns
from linuxnode.container import ContainerSpec, bundle_config
from sandfleet.layers_client import Layers

LAYER = "bench-busybox"
APPLETS = ("sh", "true", "sleep", "cat", "echo")
HYBRID_V2 = "/sys/fs/cgroup/unified"
TICK = os.sysconf("SC_CLK_TCK")


# -- shared by the container benchmarks: a platform and a layer ---------------------------------

async def build_busybox_layer(fleet: sandfleet.Fleet, name: str = LAYER, applets: tuple[str, ...] = APPLETS) -> None:
    """A tiny root: the host's static busybox and `applets`, an /etc, a /workspace."""
    if not os.path.exists("/bin/busybox"):
        raise RuntimeError("the container benchmarks need busybox-static at /bin/busybox")
    with tempfile.TemporaryDirectory(prefix="bench-layer-") as tmp:
        root = Path(tmp) / "root"
        for d in ("bin", "etc", "workspace", "tmp"):
            (root / d).mkdir(parents=True)
        shutil.copy2("/bin/busybox", root / "bin" / "busybox")
        for applet in applets:
            os.symlink("busybox", root / "bin" / applet)
        (root / "etc" / "hostname").write_text("bench\n")
        await Layers(fleet.bus).build_dir(name, root)


# -- the platform side ---------------------------------------------------------------------------

async def platform_round(url: str, n: int, concurrency: int) -> tuple[float, dict[str, list[float]]]:
    async with sandfleet.connect(url, name="bench") as fleet:
        async def create(i: int) -> sandfleet.Sandbox:
            return await fleet.create(isolation="container", layers=[LAYER], memory_mb=64, cpu=0.5)

        async def exec_true(sb: sandfleet.Sandbox) -> int:
            return (await sb.exec(["true"])).exit_code

        async def destroy(sb: sandfleet.Sandbox) -> None:
            await sb.destroy()

        return await cycles(create, exec_true, destroy, n, concurrency)


async def cycles(create, exec_true, destroy, n: int, concurrency: int) -> tuple[float, dict[str, list[float]]]:  # type: ignore[no-untyped-def]
    lat: dict[str, list[float]] = {"create": [], "exec": [], "destroy": []}
    gate = asyncio.Semaphore(concurrency)

    async def cycle(i: int) -> None:
        async with gate:
            t0 = time.perf_counter()
            box = await create(i)
            t1 = time.perf_counter()
            try:
                code = await exec_true(box)
            finally:
                t2 = time.perf_counter()
                await destroy(box)
            t3 = time.perf_counter()
            if code != 0:
                raise RuntimeError(f"`true` exited {code}")
            lat["create"].append((t1 - t0) * 1000)
            lat["exec"].append((t2 - t1) * 1000)
            lat["destroy"].append((t3 - t2) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(cycle(i) for i in range(n)))
    return n / (time.perf_counter() - start), lat


# -- the baseline: plain crun, driven by subprocess ----------------------------------------------

def layer_lowerdir(rootfs: str, node_id: str) -> str:
    """The lowerdir option of the overlay mounted at `rootfs` (the node's shared EROFS mounts),
    read where the node composes roots (its roots namespace, linuxnode.roots_ns, if pinned)."""
    text = roots_ns.read_mountinfo(node_id)
    if text is None:
        with open("/proc/self/mountinfo") as f:
            text = f.read()
    for line in text.splitlines():
        fields, _, rest = line.partition(" - ")
        if fields.split()[4] == rootfs:
            for opt in rest.split()[2].split(","):
                if opt.startswith("lowerdir="):
                    return opt.removeprefix("lowerdir=")
    raise RuntimeError(f"no overlay mounted at {rootfs}")


def crun_config(cgroup_parent: str, sandbox_id: str) -> dict:
    """The platform's OCI config for the same container, except that crun creates the cgroups
    (with the same limits) and a fresh network namespace itself, and the root is `rootfs`."""
    config = bundle_config(ContainerSpec(sandbox_id=sandbox_id, rootfs="rootfs", cgroup_procs=[], netns="",
                                         tmp_size_mb=32))
    config["linux"]["namespaces"] = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup", "network")]
    config["linux"]["cgroupsPath"] = f"{cgroup_parent}/{sandbox_id}"
    config["linux"]["resources"] = {"memory": {"limit": 64 << 20}, "cpu": {"quota": 50_000, "period": 100_000},
                                    "pids": {"limit": 512}}
    return config


class PlainCrun:
    """One cycle = mount an overlay, write a bundle, `crun run -d`, `crun exec true`, `crun delete -f`."""

    def __init__(self, work: Path, lowerdir: str, cgroup_parent: str) -> None:
        self.work, self.lowerdir, self.cgroup_parent = work, lowerdir, cgroup_parent
        self.state = work / "crun-state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.libc = ctypes.CDLL(None, use_errno=True)

    def _crun(self, *args: str) -> list[str]:
        return ["crun", "--root", str(self.state), *args]

    async def _call(self, bundle: Path, *args: str) -> None:
        # crun's errors go to a log file: a detached container would hold a stderr pipe open.
        proc = await asyncio.create_subprocess_exec(*self._crun(f"--log={bundle}/crun.log", *args),
                                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL)
        if await proc.wait():
            log = (bundle / "crun.log").read_text(errors="replace").strip()
            raise RuntimeError(f"crun {args[0]}: {log or proc.returncode}")

    async def create(self, i: int) -> tuple[str, Path]:
        cid = f"plain-{os.getpid()}-{i}"
        bundle = self.work / cid
        for d in ("upper", "ovl-work", "rootfs"):
            (bundle / d).mkdir(parents=True)
        opts = f"lowerdir={self.lowerdir},upperdir={bundle}/upper,workdir={bundle}/ovl-work".encode()
        if self.libc.mount(b"overlay", str(bundle / "rootfs").encode(), b"overlay", 0, opts) != 0:
            raise OSError(ctypes.get_errno(), "mount overlay", str(bundle))
        os.makedirs(bundle / "rootfs" / "workspace", exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(crun_config(self.cgroup_parent, cid)))
        await self._call(bundle, "run", "--detach", "--pid-file", str(bundle / "init.pid"), "--bundle", str(bundle), cid)
        return cid, bundle

    async def exec_true(self, box: tuple[str, Path]) -> int:
        proc = await asyncio.create_subprocess_exec(*self._crun("exec", "--cwd", "/workspace", box[0], "true"),
                                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL)
        return await proc.wait()

    async def destroy(self, box: tuple[str, Path]) -> None:
        cid, bundle = box
        await self._call(bundle, "delete", "--force", cid)
        if self.libc.umount2(str(bundle / "rootfs").encode(), 0) != 0:
            raise OSError(ctypes.get_errno(), "umount", str(bundle))
        await asyncio.to_thread(shutil.rmtree, bundle)


def plain_crun_main(args: argparse.Namespace) -> int:
    """The baseline process (already in its own mount namespace): one round, JSON to stdout,
    with the CPU it took to get here (interpreter start, imports), which is not the cycles'."""
    me = os.times()
    startup_s = me.user + me.system + me.children_user + me.children_system
    work = Path(args.work)
    side = PlainCrun(work, args.lowerdir, args.cgroup_parent)
    try:
        rate, lat = asyncio.run(cycles(side.create, side.exec_true, side.destroy, args.n, args.concurrency))
    finally:
        for controller in os.listdir("/sys/fs/cgroup"):  # crun leaves the parent it was given
            for root, _, _ in sorted(os.walk(f"/sys/fs/cgroup/{controller}/{args.cgroup_parent}"), reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(root)
            # ...and the parents it made in hierarchies the platform does not use (rmdir refuses
            # any that still hold the platform's node roots).
            parts = Path(args.cgroup_parent).parts
            for depth in range(len(parts) - 1, 0, -1):
                with contextlib.suppress(OSError):
                    os.rmdir(Path("/sys/fs/cgroup", controller, *parts[:depth]))
    json.dump({"rate": rate, "lat": lat, "startup_s": startup_s}, sys.stdout)
    return 0


def plain_crun_round(lowerdir: str, n: int, concurrency: int, work: Path, node_id: str) -> tuple[float, dict, float]:
    """Run the baseline as its own process: `unshare --mount` (and the v2 unmount on hybrid hosts)."""
    prelude = f"umount {HYBRID_V2} && " if os.path.ismount(HYBRID_V2) else ""
    child = [sys.executable, "-m", "loadtest.container_rate", "--plain-crun", "--n", str(n),
             "--concurrency", str(concurrency), "--lowerdir", lowerdir, "--work", str(work),
             "--cgroup-parent", f"sandfleet/{node_id}-plain"]
    # From the node's roots namespace where it has one: the layer mounts are there (linuxnode.roots_ns).
    inside = ["nsenter", f"--mount={roots_ns.pin_path(node_id)}"] if node_id in roots_ns.pinned_nodes() else []
    out = subprocess.run([*inside, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'{prelude}exec "$@"', "sh", *child], capture_output=True, text=True)
    # What crun detached (the inits it killed, its helpers) was orphaned to us, a subreaper.
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    if out.returncode != 0:
        raise RuntimeError(f"the plain crun baseline failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout)
    return got["rate"], got["lat"], got["startup_s"]


# -- CPU accounting ------------------------------------------------------------------------------

def _ticks(pid: int) -> tuple[int, list[int]]:
    """(own utime+stime + reaped children's cutime+cstime, live children) of a process."""
    stat = procfs.read_stat(pid)
    if stat is None:
        return 0, []
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
    return stat.utime + stat.stime + stat.children_time, kids


def _tree_ticks(pid: int) -> int:
    total, queue = 0, [pid]
    while queue:
        ticks, kids = _ticks(queue.pop())
        total += ticks
        queue += kids
    return total


def platform_ticks(data_dir: Path) -> dict[str, int]:
    """Clock ticks of each service's process tree, of the supervisor itself, and of this process."""
    state = json.loads((data_dir / "supervisor.json").read_text())
    found = {name: _tree_ticks(pid) for name, pid in state["services"].items()}
    found["supervisor"] = _ticks(state["pid"])[0]
    me = os.times()
    found["client"] = round((me.user + me.system) * TICK)
    return found


def _children_ticks() -> int:
    me = os.times()
    return round((me.children_user + me.children_system) * TICK)


# -- the run -------------------------------------------------------------------------------------

async def _prepare(url: str, node_id: str) -> str:
    """Build the layer, warm the platform, and compose one root so the baseline can find the
    layer's mounts (the root stays composed, keeping them mounted, until `_release`)."""
    async with sandfleet.connect(url, name="bench") as fleet:
        await build_busybox_layer(fleet)
        rootfs = await Layers(fleet.bus).compose(node_id, "bench-plain-lowers", [LAYER])
        return layer_lowerdir(rootfs.path, node_id)


async def _release(url: str, node_id: str) -> None:
    async with sandfleet.connect(url, name="bench") as fleet:
        await Layers(fleet.bus).release(node_id, "bench-plain-lowers")


def run(n: int, rounds: int, concurrency: int, node_id: str) -> dict:
    rates: dict[str, list[float]] = {"platform": [], "plain_crun": []}
    cpu_ms: dict[str, list[float]] = {"platform": [], "plain_crun": []}  # per cycle, each round
    by_service: list[dict[str, float]] = []  # ms per cycle, by process tree, each platform round
    lat: dict[str, dict[str, list[float]]] = {s: {"create": [], "exec": [], "destroy": []} for s in rates}
    # Memory-pressure admission is off too: this measures the create path, not admission.
    with running_platform(node_id, {"SANDFLEET_CPU_PSI_LIMIT": "0", "SANDFLEET_MEMORY_PSI_LIMIT": "0"}) as (url, data_dir):
        lowerdir = asyncio.run(_prepare(url, node_id))
        try:
            asyncio.run(platform_round(url, min(8, n), concurrency))  # warm-up, not counted
            for r in range(rounds):
                for side in rates:
                    if side == "platform":
                        before = platform_ticks(data_dir)
                        rate, got = asyncio.run(platform_round(url, n, concurrency))
                        after = platform_ticks(data_dir)
                        used = {k: (after[k] - before.get(k, 0)) * 1000 / TICK / n for k in after}
                        by_service.append(used)
                        cpu = sum(used.values())
                    else:
                        before_kids = _children_ticks()
                        rate, got, startup_s = plain_crun_round(lowerdir, n, concurrency, data_dir / "plain-crun",
                                                                node_id)
                        cpu = ((_children_ticks() - before_kids) / TICK - startup_s) * 1000 / n
                    rates[side].append(rate)
                    cpu_ms[side].append(cpu)
                    for k, v in got.items():
                        lat[side][k].extend(v)
                    print(f"round {r + 1}/{rounds} {side:<10} {rate:7.1f} cycles/s {cpu:6.1f} ms CPU/cycle", flush=True)
        finally:
            asyncio.run(_release(url, node_id))
    results: dict = {
        side: {
            "cycles_per_s": round(statistics.median(rates[side]), 1),
            "rounds_cycles_per_s": [round(x, 1) for x in rates[side]],
            "cpu_ms_per_cycle": round(statistics.median(cpu_ms[side]), 1),
            "rounds_cpu_ms_per_cycle": [round(x, 1) for x in cpu_ms[side]],
            **{k: percentiles(v) for k, v in lat[side].items()},
        }
        for side in rates
    }
    results["ratio_platform_over_plain_crun"] = round(
        results["platform"]["cycles_per_s"] / results["plain_crun"]["cycles_per_s"], 3)
    results["ratio_cpu_plain_crun_over_platform"] = round(
        results["plain_crun"]["cpu_ms_per_cycle"] / results["platform"]["cpu_ms_per_cycle"], 3)
    results["platform"]["cpu_ms_per_cycle_by_process"] = {  # medians over rounds
        k: round(statistics.median(r.get(k, 0.0) for r in by_service), 1) for k in sorted(by_service[0])}
    results["platform"]["rounds_cpu_ms_per_cycle_by_process"] = [{k: round(v, 1) for k, v in sorted(r.items())}
                                                                 for r in by_service]
    results["data_dir"] = str(data_dir)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="cycles per round per side")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-id", default=os.environ.get("SANDFLEET_NODE_ID", "bench"))
    ap.add_argument("--out", type=Path, default=Path("results/container_rate.json"))
    ap.add_argument("--plain-crun", action="store_true", help=argparse.SUPPRESS)  # the baseline process
    ap.add_argument("--lowerdir", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup-parent", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups on the way out
    if args.plain_crun:
        return plain_crun_main(args)
    if shutil.which("crun") is None:
        print("crun is not installed", file=sys.stderr)
        return 1

    results = run(args.n, args.rounds, args.concurrency, args.node_id)
    rows = [
        [side, results[side]["cycles_per_s"], results[side]["cpu_ms_per_cycle"],
         *(results[side][k][p] for k in ("create", "exec", "destroy") for p in ("p50", "p99"))]
        for side in ("platform", "plain_crun")
    ]
    print_table(
        f"container create → exec true → destroy, n={args.n} x {args.rounds} rounds, "
        f"concurrency {args.concurrency} (ms)",
        ["side", "cycles/s", "CPU ms/cycle", "create p50", "create p99", "exec p50", "exec p99", "destroy p50", "destroy p99"],
        rows,
    )
    print(f"ratio platform/plain crun: {results['ratio_platform_over_plain_crun']} (cycles/s), "
          f"{results['ratio_cpu_plain_crun_over_platform']} (CPU per cycle, plain/platform)")
    print("platform CPU ms/cycle by process tree:",
          ", ".join(f"{k} {v}" for k, v in results["platform"]["cpu_ms_per_cycle_by_process"].items()))
    params = {k: v for k, v in vars(args).items() if k in ("n", "concurrency", "rounds", "node_id")}
    out = write_json(args.out, "container_rate", params | {"out": str(args.out)}, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

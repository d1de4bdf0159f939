"""MicroVM density: idle microVMs held at once and the memory each costs, with and without KSM,
beside idle `container` sandboxes of the same layer as the baseline, in one run.

    .venv/bin/python -m loadtest.microvm_density [--n 10] [--containers 50] [--ksm-wait 90]

One platform (`sandfleet up`, one node). First `--containers` containers (each `sleep`), measured
and destroyed; then `--n` microVMs (1 vCPU, memory_mb 512: 352 MiB of guest RAM), each restored
from the one saved machine state, idle. Memory per VM is measured twice while they are held:
with KSM stopped and unmerged (`/sys/kernel/mm/ksm/run` = 2), then with KSM running (run = 1)
once its merged pages settle (or `--ksm-wait` s pass). Per VM: the PSS of its QEMU (a merged
page counts a share to each user), what its memory cgroup is charged (the duplicates KSM frees
are uncharged), and the host's used memory grown per VM (MemTotal - MemAvailable: on a machine
others use at the same time this one is noise, even negative). KSM is machine-wide: the
run puts `run` back as it found it at the end, whatever happens, and leaves the scan rate alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import sandfleet
from loadtest.container_rate import build_busybox_layer
from loadtest.density import KIB, SLEEP, meminfo, sandbox_memory, used_kib
from loadtest.platform import leftovers, running_platform
from loadtest.report import print_table, write_json

LAYER = "bench-vm-density"
APPLETS = ("sh", "true", "sleep", "cat", "echo")
MEMORY_MB = 512
KSM = Path("/sys/kernel/mm/ksm")
NODE = "bench-vm-density"


def _ksm(name: str) -> int:
    return int((KSM / name).read_text())


def _set_ksm(name: str, value: int) -> None:
    (KSM / name).write_text(f"{value}\n")


@contextlib.contextmanager
def ksm_restored() -> Iterator[None]:
    saved = _ksm("run")
    try:
        yield
    finally:
        _set_ksm("run", saved)


async def _settled_ksm(wait_s: float) -> dict[str, int]:
    """Run KSM (at the node's scan rate: with the scan-time advisor on, the kernel sets it) until
    pages_sharing stops growing over two full scans, or wait_s."""
    _set_ksm("run", 1)
    deadline, last, scans = time.monotonic() + wait_s, -1, _ksm("full_scans")
    while time.monotonic() < deadline:
        await asyncio.sleep(2)
        sharing = _ksm("pages_sharing")
        if _ksm("full_scans") >= scans + 2 and sharing == last:
            break
        last = sharing
    return {name: _ksm(name) for name in ("pages_shared", "pages_sharing", "full_scans")}


async def _containers(fleet: sandfleet.Fleet, n: int) -> dict[str, object]:
    before = meminfo()
    boxes = await fleet.create_many(n, isolation="container", layers=[LAYER], memory_mb=64, cpu=0.1, pids=64)
    try:
        for sb in boxes:
            await sb.exec(SLEEP)
        await asyncio.sleep(2)
        grown = (used_kib(meminfo()) - used_kib(before)) / len(boxes)
        sample = sandbox_memory(NODE, [sb.id for sb in boxes])
    finally:
        await asyncio.gather(*(sb.destroy() for sb in boxes))
    return {"held": len(boxes), "host_used_kib": round(grown, 1), **sample}


async def _microvms(fleet: sandfleet.Fleet, n: int, ksm_wait_s: float) -> dict[str, object]:
    for attempt in range(2):  # the boot that saves the machine state, outside the figures
        try:
            await (await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB)).destroy()
            break
        except sandfleet.errors.InternalError:  # a TCG boot past placement's launch budget: saved anyway
            if attempt:
                raise
            await asyncio.sleep(20)
    _set_ksm("run", 2)  # stop and unmerge: the "without" figures
    await asyncio.sleep(1)
    before = meminfo()
    boxes: list[sandfleet.Sandbox] = []
    limit = f"reached --n {n}"
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            try:
                boxes.append(await fleet.create(isolation="microvm", layers=[LAYER], memory_mb=MEMORY_MB))
            except sandfleet.errors.SandfleetError as exc:
                limit = f"a create failed at {len(boxes)}: {exc}"
                break
        fill_s = time.perf_counter() - t0
        held = len(boxes)
        await asyncio.sleep(3)  # idle
        ids = [sb.id for sb in boxes]
        without = {"host_used_kib": round((used_kib(meminfo()) - used_kib(before)) / max(1, held), 1),
                   **sandbox_memory(NODE, ids)}
        ksm = await _settled_ksm(ksm_wait_s)
        with_ksm = {"host_used_kib": round((used_kib(meminfo()) - used_kib(before)) / max(1, held), 1),
                    **sandbox_memory(NODE, ids), "ksm": ksm}
        alive = 0
        for sb in boxes:  # merged pages are still the guests' own: every VM answers
            alive += (await sb.exec(["true"])).exit_code == 0
    finally:
        await asyncio.gather(*(sb.destroy() for sb in boxes), return_exceptions=True)
    return {"held": held, "limited_by": limit, "seconds_to_fill": round(fill_s, 1), "answering_after": alive,
            "without_ksm": without, "with_ksm": with_ksm}


async def main(args: argparse.Namespace) -> None:
    if not (KSM / "run").exists():
        raise SystemExit("no KSM in this kernel (/sys/kernel/mm/ksm)")
    with ksm_restored(), running_platform(NODE) as (url, data_dir):
        async with sandfleet.connect(url, name="bench") as fleet:
            await build_busybox_layer(fleet, LAYER, APPLETS)
            status = next((node.microvm for node in await fleet.nodes() if node.microvm), "")
            containers = await _containers(fleet, args.containers)
            vms = await _microvms(fleet, args.n, args.ksm_wait)
        await asyncio.sleep(1)
        left = leftovers([NODE], data_dir)
    results = {"status": status, "container": containers, "microvm": vms, "left_after_destroy": left,
               "memory_mb": MEMORY_MB}
    w, k = vms["without_ksm"], vms["with_ksm"]  # type: ignore[index]
    mib = lambda kib: round(kib / KIB, 1)  # noqa: E731
    rows = [
        ["container (sleep)", containers["held"], mib(containers["processes_pss_kib"]),  # type: ignore[arg-type]
         mib(containers["cgroup_charged_kib"]), mib(containers["host_used_kib"])],  # type: ignore[arg-type]
        ["microvm, KSM off", vms["held"], mib(w["processes_pss_kib"]), mib(w["cgroup_charged_kib"]),
         mib(w["host_used_kib"])],
        ["microvm, KSM on", vms["held"], mib(k["processes_pss_kib"]), mib(k["cgroup_charged_kib"]),
         mib(k["host_used_kib"])],
    ]
    print(f"microvm {status}")
    print_table(f"idle sandboxes held at once, memory per sandbox (MiB; microvm memory_mb {MEMORY_MB})",
                ["sandbox", "held", "PSS", "cgroup charged", "host used"], rows)
    print(f"KSM: {k['ksm']}; per VM with KSM {mib(k['processes_pss_kib'])} MiB PSS = "
          f"{k['processes_pss_kib'] / (MEMORY_MB * KIB):.2f} of memory_mb; left after destroy: {left or 'nothing'}")
    out = write_json(Path(args.out), "microvm_density", vars(args), results)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10, help="microVMs held at once")
    parser.add_argument("--containers", type=int, default=50, help="containers held at once (the baseline)")
    parser.add_argument("--ksm-wait", type=float, default=90.0, help="at most this long for KSM to settle (s)")
    parser.add_argument("--out", default="loadtest/results/microvm_density.json")
    asyncio.run(main(parser.parse_args()))

"""The node's compressed swap: one zram device of its own, owned by the node's reclaimer.

The reclaimer owns it (not the node agent) because it is its only user and their lives
match: made at start (`hot_add`, size, `mkswap`, `swapon`), gone at stop (`swapoff`, `reset`,
`hot_remove`). The device and the UUID its swap header gets are recorded in the node's data
dir *before* it is made usable, so a reclaimer that crashed leaves a record its successor
reads to take the device down before making a new one; the UUID proves the device is still
the one recorded (device numbers are reused as soon as one is removed, by any node). The same
record goes to a machine-wide registry (/run/sandfleet/zram) with the reclaimer's pid, so any
reclaimer that starts takes down the device of one that died and will never come back (a
node whose data dir was a deleted temporary directory). Devices are added, never reused, so
the machine's own zram0 and live nodes' devices are never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.reclaimer.ksm import reclaimer_alive

log = logging.getLogger("sandfleet.reclaimer")

CONTROL = Path("/sys/class/zram-control")
REGISTRY = Path("/run/sandfleet/zram")
BLOCK = Path("/sys/block")
SWAP_UUID_OFFSET = 1024 + 12  # union swap_header: bootbits[1024], version, last_page, nr_badpages, uuid[16]
SWAP_PRIORITY = "100"  # above any disk swap: idle sandboxes go to RAM-compressed swap first


class ZramError(RuntimeError):
    pass


@dataclass(frozen=True)
class ZramStats:
    orig_bytes: int  # what was swapped to it, uncompressed
    compressed_bytes: int
    used_bytes: int  # the RAM it takes, allocator overhead included


def swap_uuid(device: str) -> str:
    """The UUID in a swap device's header ("" if it has none or cannot be read)."""
    try:
        with open(device, "rb") as f:
            f.seek(SWAP_UUID_OFFSET)
            return str(uuid.UUID(bytes=f.read(16)))
    except (OSError, ValueError):
        return ""


def active_swaps() -> set[str]:
    with open("/proc/swaps") as f:
        return {line.split()[0] for line in f.read().splitlines()[1:] if line.strip()}


class ZramSwap:
    def __init__(self, record: Path, node_id: str, registry: Path = REGISTRY) -> None:
        self.record, self.node_id, self.registry = record, node_id, registry
        self.device: str | None = None
        self.uuid = ""
        self.size_mb = 0

    @property
    def available(self) -> bool:
        return (CONTROL / "hot_add").exists()

    def reclaim_leftover(self) -> None:
        """Take down the device a previous reclaimer of this node recorded and left behind, and
        any device in the machine's registry whose reclaimer is dead."""
        records = [self.record] + [e for e in self.registry.glob("*.json") if not _owner_alive(e)]
        for path in records:
            try:
                record = json.loads(path.read_text())
                previous, recorded_uuid = record["device"], record["uuid"]
            except (OSError, ValueError, KeyError):
                continue
            if swap_uuid(previous) == recorded_uuid:
                log.warning("taking down %s, left by a reclaimer that died (%s)", previous, path)
                _take_down(previous)
            else:  # gone, or its number now belongs to someone else (e.g. after a reboot)
                log.warning("%s recorded in %s is no longer that device; leaving it", previous, path)
            path.unlink(missing_ok=True)

    def set_up(self, size_mb: int, algorithm: str = "") -> str:
        if not self.available:
            raise ZramError("no /sys/class/zram-control (load the zram module)")
        index = (CONTROL / "hot_add").read_text().strip()
        device, swap_id = f"/dev/zram{index}", str(uuid.uuid4())
        entry = json.dumps({"device": device, "uuid": swap_id, "size_mb": size_mb, "pid": os.getpid()})
        for path in (self.record, self._entry):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(entry)
        self.device, self.uuid, self.size_mb = device, swap_id, size_mb
        try:
            sysfs = BLOCK / f"zram{index}"
            if algorithm:
                (sysfs / "comp_algorithm").write_text(algorithm)
            (sysfs / "disksize").write_text(f"{size_mb}M")
            _run("mkswap", "-U", swap_id, device)
            _run("swapon", "-p", SWAP_PRIORITY, device)
        except (OSError, ZramError) as exc:
            self.tear_down()
            raise ZramError(f"setting up {device}: {exc}") from None
        return device

    def tear_down(self) -> None:
        if self.device is None:
            return
        _take_down(self.device)
        self.record.unlink(missing_ok=True)
        self._entry.unlink(missing_ok=True)
        self.device = None

    @property
    def _entry(self) -> Path:
        return self.registry / f"{self.node_id}.json"

    def stats(self) -> ZramStats:
        if self.device is None:
            return ZramStats(0, 0, 0)
        try:
            fields = (BLOCK / Path(self.device).name / "mm_stat").read_text().split()
        except OSError:
            return ZramStats(0, 0, 0)
        return ZramStats(int(fields[0]), int(fields[1]), int(fields[2]))

    def status(self) -> str:
        if self.device is None:
            return "off"
        algorithm = ""
        with contextlib.suppress(OSError):
            text = (BLOCK / Path(self.device).name / "comp_algorithm").read_text()
            algorithm = " " + text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""
        return f"on: {self.device} {self.size_mb} MiB{algorithm}"


def _owner_alive(entry: Path) -> bool:
    try:
        return reclaimer_alive(json.loads(entry.read_text()).get("pid", 0))
    except (OSError, ValueError):
        return False


def _take_down(device: str) -> None:
    """swapoff (pages come back into RAM), reset, hot_remove; each step tolerates its being done."""
    name = Path(device).name
    if device in active_swaps():
        _run("swapoff", device)
    sysfs = BLOCK / name
    if sysfs.exists():
        with contextlib.suppress(OSError):
            (sysfs / "reset").write_text("1")
        with contextlib.suppress(OSError):
            (CONTROL / "hot_remove").write_text(name.removeprefix("zram"))


def _run(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise ZramError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")

"""The kernel's same-page merging (KSM, /sys/kernel/mm/ksm) as the reclaimers of a machine share it.

KSM is one per machine, but a machine may run several nodes (`sandfleet up --nodes N`, or
parallel test platforms), each with its own reclaimer. So each reclaimer registers under
/run/sandfleet/ksm/ (a file per node with its pid and whether it wants ksmd running), the first
one saves the settings it found, ksmd runs while any live reclaimer wants it, and the last one
to leave puts the saved settings back. A file lock orders them; a crashed reclaimer's entry
counts as gone once its pid is. Tuning: the kernel's scan-time advisor (6.9+) sizes each scan
so one pass over the mergeable pages takes about `target_scan_s`, within `max_cpu` percent of
a CPU; older kernels get a fixed `pages_to_scan`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("sandfleet.reclaimer")

SYSFS = Path("/sys/kernel/mm/ksm")
REGISTRY = Path("/run/sandfleet/ksm")
SAVED = ("run", "pages_to_scan", "sleep_millisecs", "advisor_mode", "advisor_target_scan_time", "advisor_max_cpu")
FALLBACK_PAGES_TO_SCAN = 2000


class SharedKsm:
    def __init__(self, node_id: str, *, target_scan_s: int = 10, max_cpu: int = 30, sysfs: Path = SYSFS,
                 registry: Path = REGISTRY, pid: int = 0, alive: Callable[[int], bool] | None = None) -> None:
        self.node_id, self.target_scan_s, self.max_cpu = node_id, target_scan_s, max_cpu
        self.sysfs, self.registry = sysfs, registry
        self.pid, self.alive = pid or os.getpid(), alive or reclaimer_alive
        self.wanted = False

    @property
    def available(self) -> bool:
        return (self.sysfs / "run").exists()

    def status(self) -> str:
        if not self.available:
            return "off: this kernel has no KSM (CONFIG_KSM)"
        running = self._get("run") == "1"
        return f"on (ksmd {'running' if running else 'idle'}, {self._get('pages_sharing')} pages sharing)"

    def full_scans(self) -> int | None:
        """How many times ksmd has gone over every mergeable page (None without KSM)."""
        try:
            return int(self._get("full_scans"))
        except (OSError, ValueError):
            return None

    def join(self) -> None:
        """Register this reclaimer; the first of the machine saves the settings it found."""
        with self._locked():
            if not self._live_users() and not (self.registry / "saved.json").exists():
                saved = {k: self._get(k) for k in SAVED if (self.sysfs / k).exists()}
                (self.registry / "saved.json").write_text(json.dumps(saved))
            self._register(False)
            self._apply()

    def want(self, on: bool) -> None:
        if on == self.wanted:
            return
        with self._locked():
            self._register(on)
            self._apply()

    def leave(self) -> None:
        """Unregister; the last reclaimer out restores what the first one found."""
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                (self.registry / f"{self.node_id}.json").unlink()
            if self._live_users():
                self._apply()
                return
            saved_file = self.registry / "saved.json"
            try:
                saved = json.loads(saved_file.read_text())
            except (OSError, ValueError):
                saved = {"run": "0"}
            # `run` last: settings first, then ksmd stops (0 keeps what is merged; never 2, which unmerges).
            for key in sorted(saved, key=lambda k: k == "run"):
                with contextlib.suppress(OSError):
                    self._set(key, saved[key])
            saved_file.unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.registry.mkdir(parents=True, exist_ok=True)
        with open(self.registry / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _register(self, on: bool) -> None:
        self.wanted = on
        entry = self.registry / f"{self.node_id}.json"
        tmp = entry.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": self.pid, "want": on}))
        tmp.replace(entry)

    def _live_users(self) -> list[dict]:
        users = []
        for entry in self.registry.glob("*.json"):
            if entry.name == "saved.json":
                continue
            try:
                user = json.loads(entry.read_text())
            except (OSError, ValueError):
                continue
            if self.alive(user.get("pid", 0)):
                users.append(user)
            else:  # a reclaimer that died without leaving
                entry.unlink(missing_ok=True)
        return users

    def _apply(self) -> None:
        if not self.available:
            return
        run = any(u.get("want") for u in self._live_users())
        if run:
            self._tune()
        if self._get("run") != ("1" if run else "0"):
            self._set("run", "1" if run else "0")
            log.info("ksmd %s", "started" if run else "stopped")

    def _tune(self) -> None:
        if (self.sysfs / "advisor_mode").exists():
            self._set("advisor_target_scan_time", str(self.target_scan_s))
            self._set("advisor_max_cpu", str(self.max_cpu))
            if "[scan-time]" not in self._get("advisor_mode"):
                self._set("advisor_mode", "scan-time")
        else:
            self._set("pages_to_scan", str(FALLBACK_PAGES_TO_SCAN))

    def _get(self, key: str) -> str:
        return (self.sysfs / key).read_text().strip()

    def _set(self, key: str, value: str) -> None:
        if key == "advisor_mode" and "[" in value:  # saved as "[none] scan-time": write the selected one
            value = value.split("[", 1)[1].split("]", 1)[0]
        (self.sysfs / key).write_text(value)


def reclaimer_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"services.reclaimer" in f.read()
    except OSError:
        return False

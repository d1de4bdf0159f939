"""The drivers this node has, by isolation level: `process` always, `container` where crun was
found to work at start, `microvm` where QEMU and a built guest are (linuxnode/vm), `vm` where
SeaBIOS and the vm guest are too (linuxnode/vm/full_machine.py). See
drivers/base.py for the interface and how a level plugs in."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from linuxnode import process as process_runtime
from linuxnode import roots_ns, userns
from services.launcher.drivers.base import Anchor, Driver, LaunchRefused
from services.launcher.drivers.container import ContainerDriver, detect_crun
from services.launcher.drivers.microvm import detect_microvm
from services.launcher.drivers.process import ProcessDriver
from services.launcher.drivers.vm import detect_vm

log = logging.getLogger("sandfleet.launcher")


def _usable(ids: userns.IdRange | None) -> userns.IdRange | None:
    """The node's range if this kernel makes user namespaces for it, else None (said in the log):
    sandboxes then run as the host's uid 0, as before user namespaces."""
    if ids is not None:
        try:
            os.close(userns.make(ids))
        except OSError as exc:
            log.error("no user namespace for sandbox roots here (%s): they run as the host's uid 0", exc)
            return None
    return ids


class Drivers:
    def __init__(self, drivers: dict[str, Driver], microvm: str = "", vm: str = "",
                 roots: roots_ns.RootsView | None = None) -> None:
        self.drivers = drivers
        self.roots = roots
        self.microvm = microvm  # the node's status line for the level: `on: tcg (...)` or `off: <why>`
        self.vm = vm  # the same for the `vm` level

    @classmethod
    async def open(cls, state_dir: Path, userns_setting: str = "", node_id: str = "") -> Drivers:
        """Every level this node can run, each ready for its first sandbox, their roots the host
        ids `userns_setting` gives (ServiceConfig.userns, SANDFLEET_USERNS; linuxnode.userns) and
        taken from the node's roots namespace (linuxnode.roots_ns; `node_id` names it; none:
        roots are mounted in the launcher's own namespace)."""
        process_runtime.warm_up()  # the forking helper takes ~50 ms to start; not on the first create
        ids = _usable(userns.node_range(userns_setting))
        roots = roots_ns.RootsView(node_id) if node_id else None
        drivers: dict[str, Driver] = {"process": ProcessDriver(ids, roots)}
        crun = await detect_crun(state_dir)  # `container` only where crun really runs here
        if crun is not None:
            drivers["container"] = ContainerDriver(crun, ids, roots)
        microvm, microvm_status = await detect_microvm(state_dir)
        if microvm is not None:
            microvm.roots = roots
            drivers["microvm"] = microvm
        log.info("microvm: %s", microvm_status)
        vm, vm_status = await detect_vm(state_dir)  # a full machine: q35, firmware, a screen
        if vm is not None:
            vm.roots = roots
            drivers["vm"] = vm
        log.info("vm: %s", vm_status)
        return cls(drivers, microvm_status, vm_status, roots)

    def close(self) -> None:
        for driver in reversed(list(self.drivers.values())):
            driver.close()
        process_runtime.shutdown()
        if self.roots is not None:
            self.roots.close()

    @property
    def levels(self) -> list[str]:
        return list(self.drivers)

    def __contains__(self, isolation: str) -> bool:
        return isolation in self.drivers

    def driver(self, isolation: str) -> Driver:
        found = self.drivers.get(isolation)
        if found is None:
            raise LaunchRefused(f"this node cannot run isolation {isolation!r}; it offers {self.levels}")
        return found

    def _or_process(self, isolation: str) -> Driver:
        """A recorded sandbox of a level this node no longer offers (a container after crun went
        missing) still has a host process, which `process` can tell alive and end."""
        return self.drivers.get(isolation) or self.drivers["process"]

    def alive(self, isolation: str, anchor: Anchor) -> bool:
        return self._or_process(isolation).alive(anchor)

    async def stop(self, isolation: str, sandbox_id: str, anchor: Anchor | None) -> None:
        """Stop a recorded sandbox of any level, live here or not."""
        await self._or_process(isolation).stop(sandbox_id, anchor)

    async def leftovers(self, keep: set[str]) -> list[str]:
        """Remove what a crash left, in any level, of sandboxes not in `keep`."""
        gone: list[str] = []
        for driver in self.drivers.values():
            gone += await driver.leftovers(keep)
        return gone

"""Small directory trees that tests build layers from: a busybox base, a tools and a task layer."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "cat", "ls", "echo", "rm", "chmod", "sleep", "dd", "ps", "hostname", "head", "true", "test")


def make_busybox_base(root: Path, hostname: str = "base", applets: tuple[str, ...] = APPLETS) -> None:
    """A tiny system: busybox with its applets as symlinks, an /etc, an empty /workspace."""
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "workspace").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in applets:
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc" / "hostname").write_text(f"{hostname}\n")
    (root / "etc" / "base-only").write_text("from base\n")


def make_layer_sources(src: Path, applets: tuple[str, ...] = APPLETS) -> Path:
    """`base`, `tools` (overrides /etc/hostname, adds /etc/tools) and `task` (/workspace/task.txt)."""
    make_busybox_base(src / "base", applets=applets)
    tools = src / "tools"
    (tools / "etc").mkdir(parents=True)
    (tools / "etc" / "hostname").write_text("tools\n")
    (tools / "etc" / "tools").write_text("a tool\n")
    task = src / "task"
    (task / "workspace").mkdir(parents=True)
    (task / "workspace" / "task.txt").write_text("solve it\n")
    return src


_BUSYBOX_LAYERS: set[str] = set()  # built in this test session


async def busybox_layer(fleet, tmp_path_factory, name: str, *, hostname: str = "ct",
                        applets: tuple[str, ...] = APPLETS) -> str:
    """Layer `name`: a busybox base with these applets, built once per test session (only when
    a container test asks for it), for tests that run in `container` sandboxes."""
    from sandfleet.layers_client import Layers
    from tests.kernel import require

    require(os.geteuid() == 0, "containers need root")
    require(shutil.which("crun") is not None, "crun is installed")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    if name not in _BUSYBOX_LAYERS:
        src = tmp_path_factory.mktemp(f"{name}-src") / "base"
        make_busybox_base(src, hostname=hostname, applets=applets)
        await Layers(fleet.bus).build_dir(name, src)
        _BUSYBOX_LAYERS.add(name)
    return name


@contextlib.asynccontextmanager
async def level_sandbox(fleet, level: str, container_layer: Callable[[], Awaitable[str]]) -> AsyncIterator:
    """A sandbox of `level` for tests run on both: `container` over the layer `container_layer`
    builds, `process` with the host view; destroyed after (unless it ended in the test)."""
    from sandfleet import errors

    if level == "container":
        box = await fleet.create(isolation="container", memory_mb=128, layers=[await container_layer()])
    else:
        box = await fleet.create(memory_mb=128, host_view=True)
    box.level = level
    try:
        yield box
    finally:
        try:
            await box.destroy()
        except (errors.NotFound, errors.Conflict):  # it ended in the test (or is ending on its own)
            pass

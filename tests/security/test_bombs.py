"""Fork and memory bombs inside real sandboxes: the sandbox's own limits hold them (the pids
limit, an OOM kill inside its own memory cgroup), a sibling sandbox and the node carry on,
and the limit's violation event arrives on the bus.
"""

from __future__ import annotations

from pathlib import Path

from linuxnode import cgroups
from tests.security.test_syscall_violations import Violations

FORK_BOMB = "b() { b | b & }; b"
# Touch memory page by page until the kernel stops it (a bytearray of the whole size at once
# may be refused by overcommit accounting instead of reaching the OOM killer).
MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))\n"


def _pids_dir(node_id: str, sandbox_id: str) -> Path:
    """The sandbox's cgroup of the pids controller (v1 on a hybrid host, else v2)."""
    layout = cgroups.CgroupLayout.detect()
    return Path(layout.v1.get("pids", layout.v2), cgroups.PARENT, node_id, sandbox_id)


def _refused_forks(pids: Path) -> int:
    """How many forks the kernel refused the cgroup for its pids limit (`max` in pids.events)."""
    events = dict(line.split() for line in (pids / "pids.events").read_text().splitlines())
    return int(events["max"])


async def _sibling_works(fleet, sibling) -> None:
    r = await sibling.exec(["sh", "-c", "echo alive; (true &); wait"], timeout_s=20)
    assert (r.exit_code, r.stdout) == (0, b"alive\n"), r.stderr
    assert await fleet.ping("agent") and await fleet.ping("launcher")
    fresh = await fleet.create(memory_mb=64, host_view=True)
    try:
        r = await fresh.exec(["true"])
        assert r.exit_code == 0
    finally:
        await fresh.destroy()


async def test_a_fork_bomb_is_held_by_the_pids_limit_and_reported(fleet, platform):
    bomb = await fleet.create(memory_mb=128, pids=48, cpu=0.25, labels={"task": "bomb"}, host_view=True)
    sibling = await fleet.create(memory_mb=64, host_view=True)
    seen = Violations(fleet, bomb.id)
    try:
        await seen.started()
        # Nothing forks after the bomb is away (echo is the shell's own): the bomb may fill the
        # limit before a `sleep` here could fork, which failed this exec instead of the bomb.
        r = await bomb.exec(["sh", "-c", f"({FORK_BOMB}) >/dev/null 2>&1 & echo launched"], timeout_s=20)
        assert r.stdout == b"launched\n", r
        v = await seen.wait_for("limit.pids", 0)
        assert v.labels == {"task": "bomb"} and "pids limit 48" in v.attempted, v
        # Held: the kernel refused the bomb forks for its sandbox's limit, and its processes never
        # passed it. Read from the host, in the kernel's own counts: a process started in the
        # sandbox to count them may itself be refused.
        pids = _pids_dir(platform.node_id, bomb.id)
        assert (pids / "pids.max").read_text().strip() == "48"
        assert _refused_forks(pids) > 0 and int((pids / "pids.peak").read_text()) == 48
        await _sibling_works(fleet, sibling)
    finally:
        seen.close()
        await bomb.destroy()  # cgroup.kill takes the whole tree at once
        await sibling.destroy()


async def test_a_memory_bomb_is_oom_killed_inside_its_sandbox_and_reported(fleet):
    bomb = await fleet.create(memory_mb=64, labels={"task": "bomb"}, host_view=True)
    sibling = await fleet.create(memory_mb=64, host_view=True)
    seen = Violations(fleet, bomb.id)
    try:
        await seen.started()
        r = await bomb.exec(["python3", "-S", "-c", MEMORY_BOMB], timeout_s=60)
        assert r.exit_code in (-9, 137), r  # SIGKILL from the OOM killer, inside the sandbox's cgroup
        v = await seen.wait_for("limit.memory", 0)
        assert v.labels == {"task": "bomb"} and "memory limit 64 MiB" in v.attempted, v
        # The sandbox itself lives on (only the bomb was killed) and so do its neighbours.
        r = await bomb.exec(["echo", "still here"], timeout_s=20)
        assert (r.exit_code, r.stdout) == (0, b"still here\n")
        await _sibling_works(fleet, sibling)
    finally:
        seen.close()
        await bomb.destroy()
        await sibling.destroy()

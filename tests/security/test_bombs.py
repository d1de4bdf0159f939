"""Fork and memory bombs inside real sandboxes: the sandbox's own limits hold them (the pids
limit, an OOM kill inside its own memory cgroup), a sibling sandbox and the node carry on,
and the limit's violation event is on the bus within 2 s.
"""

from __future__ import annotations

from tests.security.test_syscall_violations import Violations

FORK_BOMB = "b() { b | b & }; b"
# Touch memory page by page until the kernel stops it (a bytearray of the whole size at once
# may be refused by overcommit accounting instead of reaching the OOM killer).
MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))\n"


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


async def test_a_fork_bomb_is_held_by_the_pids_limit_and_reported(fleet):
    bomb = await fleet.create(memory_mb=128, pids=48, cpu=0.25, labels={"task": "bomb"}, host_view=True)
    sibling = await fleet.create(memory_mb=64, host_view=True)
    seen = Violations(fleet, bomb.id)
    try:
        await seen.started()
        r = await bomb.exec(["sh", "-c", f"({FORK_BOMB}) >/dev/null 2>&1 & sleep 1; echo launched"], timeout_s=20)
        assert r.stdout == b"launched\n", r
        v = await seen.wait_for("limit.pids", 0)  # within 2 s of the exec returning
        assert v.labels == {"task": "bomb"} and "pids limit 48" in v.attempted, v
        # Held: the bomb's sandbox stays at its limit while it keeps trying.
        stats = await bomb.exec(["sh", "-c", "ls -d /proc/[0-9]* | wc -l"], timeout_s=20)
        assert stats.exit_code != 0 or int(stats.stdout) <= 48
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

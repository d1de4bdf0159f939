"""The sandbox init's life as the launcher sees it: start it through the spawner, tell
whether it is alive (a recycled pid never passes for it), kill it, and open a live one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import time

from linuxnode import layered_root, mount_api, names, netns, procfs, userns
from linuxnode.process import rootfs, spawner
from linuxnode.process.model import ExecError, InitProcess, ProcessSpec, RuntimeStartError
from linuxnode.process.protocol import Signal, StartInit, StartInitOnRoot
from linuxnode.process.reports import Report

START_TIMEOUT_S = 10.0


def start(spec: ProcessSpec) -> InitProcess:
    """Start the sandbox's init; returns once it is about to exec catatonit (a few ms)."""
    report_r = _send_start(spec)
    try:
        report = _read_start_report(report_r, START_TIMEOUT_S)
    finally:
        os.close(report_r)
    return _started(spec, report)


async def start_async(spec: ProcessSpec) -> InitProcess:
    """`start` that waits for the init on the event loop instead of blocking it."""
    report_r = _send_start(spec)
    try:
        report = await _read_start_report_async(report_r, START_TIMEOUT_S)
    finally:
        os.close(report_r)
    return _started(spec, report)


def _send_start(spec: ProcessSpec) -> int:
    """Ask the spawner for the init; returns the read end of its report pipe."""
    if not names.is_sandbox_id(spec.sandbox_id):
        raise RuntimeStartError(f"invalid sandbox id {spec.sandbox_id!r}")
    if not re.match(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$", spec.hostname):
        raise RuntimeStartError(f"invalid hostname {spec.hostname!r}")
    if spec.tmp_size_mb < 1 or spec.workspace_size_mb < 1:
        raise RuntimeStartError("tmp_size_mb and workspace_size_mb must be at least 1 (0 means unlimited to tmpfs)")
    if spec.id_host and not userns.RANGE <= spec.id_host <= (1 << 32) - userns.RANGE:
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: id_host {spec.id_host} leaves no whole id range")
    rootfs.plan(spec.tmp_size_mb, spec.workspace_size_mb, spec.hostname, spec.id_host)  # fail here, not in the child
    if spec.rootfs_dir is not None:
        try:
            layered_root.check(spec.rootfs_dir)
        except ValueError as exc:
            raise RuntimeStartError(f"sandbox {spec.sandbox_id}: {exc}") from None
    try:
        netns_fd = netns.open_ns(spec.netns)
    except OSError as exc:
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: open netns {spec.netns}: {exc.strerror}") from None
    own_tree = -1
    try:
        if spec.rootfs_dir is not None and spec.root_tree < 0:
            own_tree = mount_api.clone_tree(spec.rootfs_dir, recursive=True)
    except OSError as exc:
        os.close(netns_fd)
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: clone the root {spec.rootfs_dir}: {exc.strerror}") from None
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        init = dict(cgroup_procs=tuple(spec.cgroup_procs), tmp_size_mb=spec.tmp_size_mb,
                    workspace_size_mb=spec.workspace_size_mb, hostname=spec.hostname, rootfs_dir=spec.rootfs_dir,
                    apparmor=spec.apparmor_profile, id_host=spec.id_host, report=report_w, netns=netns_fd)
        if spec.rootfs_dir is None:
            spawner.send(StartInit(**init))
        else:
            spawner.send(StartInitOnRoot(**init, root_tree=own_tree if own_tree >= 0 else spec.root_tree))
    except BaseException as exc:
        os.close(report_r)
        if isinstance(exc, OSError):
            raise RuntimeStartError(f"sandbox {spec.sandbox_id}: cannot reach the spawner: {exc}") from exc
        raise
    finally:
        os.close(report_w)
        os.close(netns_fd)
        if own_tree >= 0:
            os.close(own_tree)
    return report_r


def _started(spec: ProcessSpec, report: Report) -> InitProcess:
    if report.errors or not report.ready:
        if report.pid is not None and not report.errors:  # hung: a failed init exits by itself
            with contextlib.suppress(OSError):
                spawner.send(Signal(pid=report.pid, signal=int(signal.SIGKILL)))
        why = "; ".join(m for _, m in report.errors) or "init died without a report"
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: {why}")
    info = procfs.read_stat(report.pid)
    if info is None:
        raise RuntimeStartError(f"sandbox {spec.sandbox_id}: init vanished")
    return InitProcess(pid=report.pid, start_time=info.start_time)


async def _readable(fd: int, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(True))
    try:
        return await asyncio.wait_for(ready, timeout_s)
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _start_report(fd: int, timeout_s: float):  # -> Generator[float, bool, Report]
    """Read the init's report; yields the seconds left to wait and is sent whether fd turned
    readable, so the blocking and the event-loop reader share one loop."""
    data, deadline = b"", time.monotonic() + timeout_s
    while True:
        report = Report.parse(data)
        if report.pid is not None and (report.ready or report.errors):
            return report
        left = deadline - time.monotonic()
        if left <= 0 or not (yield left):
            report.errors += ((0, f"init not ready within {timeout_s} s"),)
            return report
        chunk = os.read(fd, 65536)
        if not chunk:
            return report
        data += chunk


def _read_start_report(fd: int, timeout_s: float) -> Report:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    reader = _start_report(fd, timeout_s)
    try:
        left = next(reader)
        while True:
            left = reader.send(bool(poller.poll(left * 1000)))
    except StopIteration as done:
        return done.value


async def _read_start_report_async(fd: int, timeout_s: float) -> Report:
    reader = _start_report(fd, timeout_s)
    try:
        left = next(reader)
        while True:
            left = reader.send(await _readable(fd, left))
    except StopIteration as done:
        return done.value


# -- liveness and kill ------------------------------------------------------------------------------

def is_alive(init: InitProcess) -> bool:
    info = procfs.read_stat(init.pid)
    return info is not None and info.start_time == init.start_time and info.state not in ("Z", "X")


def kill(init: InitProcess, timeout_s: float = 2.0) -> None:
    """SIGKILL the init, which ends its pid namespace, and wait until it has ended."""
    target = _signal_kill(init)
    if target is not None:
        pidfd, ppid = target
        try:
            select.select([pidfd], [], [], timeout_s)
        finally:
            _finish_kill(init, pidfd, ppid)


async def kill_async(init: InitProcess, timeout_s: float = 2.0) -> None:
    """`kill` that waits for the init's end on the event loop instead of blocking it."""
    target = _signal_kill(init)
    if target is not None:
        pidfd, ppid = target
        try:
            await _readable(pidfd, timeout_s)
        finally:
            _finish_kill(init, pidfd, ppid)


def _signal_kill(init: InitProcess) -> tuple[int, int] | None:
    """(pidfd, parent pid) of the init after sending it SIGKILL, or None if it is gone."""
    try:
        pidfd = os.pidfd_open(init.pid)
    except ProcessLookupError:
        return None
    info = procfs.read_stat(init.pid)  # read after pidfd_open: a match proves the pidfd is the init
    if info is None or info.start_time != init.start_time:
        os.close(pidfd)
        return None
    if info.state not in ("Z", "X"):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    return pidfd, info.ppid


def _finish_kill(init: InitProcess, pidfd: int, ppid: int) -> None:
    if ppid == os.getpid():  # ours only if the spawner that started it died
        with contextlib.suppress(ChildProcessError):
            os.waitpid(init.pid, os.WNOHANG)
    os.close(pidfd)


def open_init(init: InitProcess) -> tuple[int, int]:
    """(pidfd, root directory fd) of a live init; ExecError if it is gone or was replaced."""
    try:
        pidfd = os.pidfd_open(init.pid)
    except ProcessLookupError:
        raise ExecError(f"sandbox init {init.pid} is not running") from None
    try:
        root = os.open(f"/proc/{init.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        os.close(pidfd)
        raise ExecError(f"sandbox init {init.pid} is not running") from None
    if not is_alive(init):  # checked after opening both: they belong to this init
        os.close(pidfd)
        os.close(root)
        raise ExecError(f"sandbox init {init.pid} is not running")
    return pidfd, root

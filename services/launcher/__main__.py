"""Composition root of a node's launcher: settings, bus, store, drivers and clients; recover,
serve, heartbeat; on SIGTERM destroy everything and tear down in reverse order."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging

from sandfleet import metrics, runner
from sandfleet.bus import Endpoint
from sandfleet.config import ServiceConfig
from sandfleet.store import SandboxStore
from schemas import health as health_schema
from schemas import node as node_schema
from schemas import pools as pools_schema
from schemas import process as proc_schema
from schemas.node import MAX_FILE_BYTES
from schemas.sandbox import Reason
from services.launcher import (fencing, files, handlers, health, heartbeat, pausing, processes, ptys, recovery, tenancy,
                               tunnels)
from services.launcher import desktop, pool
from services.launcher.clients import LayerCache, NodeAgent
from services.launcher.drivers import Drivers
from services.launcher.keys import LOGGER
from services.launcher.lifecycle import Launcher
from services.launcher.settings import LauncherSettings

log = logging.getLogger(LOGGER)

PR_SET_CHILD_SUBREAPER = 36
LARGE = MAX_FILE_BYTES * 2  # base64 in JSON grows bytes by a third


def endpoints(launcher: Launcher, procs: processes.ProcessTable, forwarding: tunnels.Tunnels,
              pools: pool.WarmPools) -> list[Endpoint]:
    n, h, s = launcher.node_id, functools.partial, node_schema
    return [
        Endpoint("launch", s.subject(n, s.LAUNCH), s.LaunchRequest, h(handlers.launch, launcher), max_bytes=8 << 20),
        Endpoint("claim", s.subject(n, pools_schema.CLAIM), pools_schema.ClaimRequest, pools.claim),
        Endpoint("exec", s.subject(n, s.EXEC), s.ExecRequest, h(handlers.exec_, launcher), max_bytes=LARGE),
        Endpoint("write_file", s.subject(n, s.WRITE_FILE), s.WriteFileRequest, h(handlers.write_file, launcher),
                 max_bytes=LARGE),
        Endpoint("read_file", s.subject(n, s.READ_FILE), s.ReadFileRequest, h(handlers.read_file, launcher)),
        Endpoint("destroy", s.subject(n, s.DESTROY), s.DestroyRequest, h(handlers.destroy, launcher)),
        Endpoint("quarantine", s.subject(n, s.QUARANTINE), s.QuarantineRequest, h(handlers.quarantine, launcher)),
        Endpoint("pause", s.subject(n, s.PAUSE), s.PauseRequest, h(handlers.pause, launcher)),
        Endpoint("resume", s.subject(n, s.RESUME), s.ResumeRequest, h(handlers.resume, launcher)),
        Endpoint("pause_selected", s.subject(n, s.PAUSE_SELECTED), s.SelectedRequest,
                 h(handlers.pause_selected, launcher)),
        Endpoint("resume_selected", s.subject(n, s.RESUME_SELECTED), s.SelectedRequest,
                 h(handlers.resume_selected, launcher)),
        Endpoint("hint", s.subject(n, s.HINT), s.HintRequest, h(handlers.hint, launcher)),
        Endpoint("checkpoint", s.subject(n, s.CHECKPOINT), s.CheckpointRequest, h(handlers.checkpoint, launcher)),
        *_health_endpoints(launcher),
        *_process_endpoints(launcher.node_id, procs),
        *tunnels.endpoints(forwarding),
        *files.endpoints(launcher),
        *ptys.endpoints(launcher.node_id, procs),
        *desktop.endpoints(launcher),
    ]


def _health_endpoints(launcher: Launcher) -> list[Endpoint]:
    n, h, s = launcher.node_id, functools.partial, health_schema
    return [
        Endpoint("set_timeout", s.subject(n, s.SET_TIMEOUT), s.SetTimeoutRequest, h(health.set_timeout, launcher)),
        Endpoint("metrics", s.subject(n, s.METRICS), s.MetricsRequest, h(health.metrics, launcher)),
        Endpoint("node_metrics", s.subject(n, s.NODE_METRICS), s.NodeMetricsRequest, h(health.node_metrics, launcher)),
    ]


def _process_endpoints(n: str, procs: processes.ProcessTable) -> list[Endpoint]:
    h, s, p = functools.partial, node_schema, proc_schema
    return [
        Endpoint("proc_spawn", s.subject(n, p.SPAWN), p.SpawnRequest, h(processes.spawn, procs)),
        Endpoint("proc_read", s.subject(n, p.READ), p.ReadRequest, h(processes.read, procs)),
        Endpoint("proc_write", s.subject(n, p.WRITE), p.WriteRequest, h(processes.write, procs), max_bytes=LARGE),
        Endpoint("proc_signal", s.subject(n, p.SIGNAL), p.SignalRequest, h(processes.signal, procs)),
        Endpoint("proc_wait", s.subject(n, p.WAIT), p.WaitRequest, h(processes.wait, procs)),
        Endpoint("proc_list", s.subject(n, p.LIST), p.ListRequest, h(processes.list_, procs)),
    ]


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    settings = LauncherSettings.from_env()
    # Sandbox inits are double-forked; as subreaper we reap them instead of a PID 1 that may not.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    drivers = await Drivers.open(config.data_dir / "launcher", config.userns, config.node_id)
    criu_status = await asyncio.to_thread(pausing.detect_criu)  # reported in every heartbeat
    log.info("process checkpoints (CRIU): %s", criu_status)
    try:
        async with runner.service_bus("launcher", config) as bus:
            launcher = Launcher(store=await SandboxStore.open(bus), node_id=config.node_id, drivers=drivers,
                                agent=NodeAgent(bus, config.node_id), layers=LayerCache(bus, config.node_id),
                                settings=settings, default_layers=config.default_layers)
            interrupted = await recovery.recover(launcher)
            await pool.give_back_orphans(launcher)  # before any spare of this instance exists
            metrics.RUNNING.set_function(lambda: len(launcher.live))
            metrics.CAPACITY.set_function(lambda: config.capacity)
            metrics.LAUNCH_QUEUE.set_function(lambda: len(launcher.launching) - launcher.building)
            procs = processes.ProcessTable(launcher)
            forwarding = tunnels.Tunnels(bus, launcher)
            await forwarding.listen()
            pools = pool.WarmPools(launcher, bus, config.capacity)
            metrics.WARM_SPARES.set_function(lambda: sum(len(s) for s in pools.spares.values()))
            served = tenancy.guarded(endpoints(launcher, procs, forwarding, pools), tenancy.Owners(launcher.store))
            await bus.serve("launcher", served, queue_group=f"launcher-{config.node_id}")
            tasks = [asyncio.create_task(heartbeat.heartbeat(bus, launcher, config, criu_status, pools)),
                     asyncio.create_task(pools.run()),
                     asyncio.create_task(launcher.expire_loop()),
                     asyncio.create_task(fencing.fence_loop(launcher, settings.fence_s)),
                     asyncio.create_task(procs.sweep_loop())]
            # Not among `tasks`: never cancelled mid-build; a stop ends what it has not built yet.
            relaunching = asyncio.create_task(recovery.relaunch(launcher, interrupted))
            log.info("launcher serving node %s with %s (%d sandboxes re-adopted)", config.node_id, launcher.isolation,
                     len(launcher.live))
            await stop.wait()
            for task in reversed(tasks):
                task.cancel()
            await pools.close()
            await launcher.destroy_all(Reason.NODE_SHUTDOWN)
            await relaunching
            procs.close()
            await forwarding.close()
            await heartbeat.withdraw(bus, config.node_id)
    finally:
        drivers.close()


if __name__ == "__main__":
    runner.run("launcher", main, node_scoped=True)

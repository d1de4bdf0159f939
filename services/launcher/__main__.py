"""Composition root of a node's launcher: recover, serve, heartbeat; destroy everything on SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import secrets
import time

import nats.errors
import nats.js.errors

from sandfleet import runner
from sandfleet.bus import Bus, Endpoint, encode
from sandfleet.config import ServiceConfig
from sandfleet.store import SandboxStore
from schemas import node as node_schema
from sandfleet.errors import SandfleetError
from schemas import layers as layers_schema
from schemas.layers import CacheListing, CacheRequest
from schemas.node import MAX_FILE_BYTES, NodeInfo, NodePressure
from schemas.sandbox import Reason, SandboxSpec
from linuxnode import procfs
from linuxnode import process as process_runtime
from services.launcher import fencing, handlers, pausing
from services.launcher.lifecycle import Launcher
from services.launcher.runtimes import Runtimes, detect_crun

log = logging.getLogger("sandfleet.launcher")

PR_SET_CHILD_SUBREAPER = 36
LARGE = MAX_FILE_BYTES * 2  # base64 in JSON grows bytes by a third


class Intake:
    """Counts what this launcher instance takes, so placement can tell its bookings in transit."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.instance = secrets.token_hex(8)
        self.accepted, self.accepted_cpu, self.accepted_memory_mb = 0, 0.0, 0
        self.starting: dict[str, SandboxSpec] = {}

    async def launch(self, req: node_schema.LaunchRequest) -> node_schema.LaunchReply:
        for item in req.sandboxes:
            self.accepted += 1
            self.accepted_cpu += item.spec.cpu
            self.accepted_memory_mb += item.spec.memory_mb
            self.starting[item.id] = item.spec
        try:
            return await handlers.launch(self.launcher, req)
        finally:
            for item in req.sandboxes:
                self.starting.pop(item.id, None)


async def cached_layers(bus: Bus, node_id: str) -> list[str]:
    try:
        listing = await bus.request(node_schema.subject(node_id, layers_schema.CACHE), CacheRequest(), CacheListing,
                                    timeout=1.0)
    except SandfleetError:
        return []  # no layer-cache on this node (yet): no locality to offer
    return sorted({ref for image in listing.images for ref in (image.digest, *image.names)})


async def heartbeat(bus: Bus, launcher: Launcher, intake: Intake, config: ServiceConfig, criu: str = "") -> None:
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    while True:
        specs = [live.spec for live in launcher.live.values()] + list(intake.starting.values())
        info = NodeInfo(
            id=config.node_id,
            isolation=launcher.isolation,
            capacity=config.capacity,
            running=len(launcher.live),
            cpus=os.cpu_count() or 1,
            memory_mb=memory_mb,
            at=time.time(),
            starting=len(intake.starting),
            allocated_cpu=sum(s.cpu for s in specs),
            allocated_memory_mb=sum(s.memory_mb for s in specs),
            pressure=NodePressure(cpu=procfs.node_pressure("cpu"), memory=procfs.node_pressure("memory")),
            layers=await cached_layers(bus, config.node_id),
            instance=intake.instance,
            accepted=intake.accepted,
            accepted_cpu=intake.accepted_cpu,
            accepted_memory_mb=intake.accepted_memory_mb,
            criu=criu,
        )
        try:
            await kv.put(config.node_id, encode(info))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("heartbeat failed: %s", exc)
        await asyncio.sleep(node_schema.HEARTBEAT_S)


async def main(config: ServiceConfig, stop: asyncio.Event) -> None:
    # Sandbox inits are double-forked; as subreaper we reap them instead of a PID 1 that may not.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    process_runtime.warm_up()  # the forking helper takes ~50 ms to start; not on the first create
    crun = await detect_crun(config.data_dir / "launcher")  # `container` only where crun really runs here
    criu_status = await asyncio.to_thread(pausing.detect_criu)  # reported in every heartbeat
    log.info("process checkpoints (CRIU): %s", criu_status)
    async with runner.service_bus("launcher", config) as bus:
        launcher = Launcher(bus=bus, store=await SandboxStore.open(bus), node_id=config.node_id,
                            runtimes=Runtimes(crun), default_layers=config.default_layers)
        await launcher.recover()
        intake = Intake(launcher)
        sub = functools.partial
        n = config.node_id
        await bus.serve(
            "launcher",
            [
                Endpoint("launch", node_schema.subject(n, node_schema.LAUNCH), node_schema.LaunchRequest,
                         intake.launch, max_bytes=8 << 20),
                Endpoint("exec", node_schema.subject(n, node_schema.EXEC), node_schema.ExecRequest,
                         sub(handlers.exec_, launcher), max_bytes=LARGE),
                Endpoint("write_file", node_schema.subject(n, node_schema.WRITE_FILE), node_schema.WriteFileRequest,
                         sub(handlers.write_file, launcher), max_bytes=LARGE),
                Endpoint("read_file", node_schema.subject(n, node_schema.READ_FILE), node_schema.ReadFileRequest,
                         sub(handlers.read_file, launcher)),
                Endpoint("destroy", node_schema.subject(n, node_schema.DESTROY), node_schema.DestroyRequest,
                         sub(handlers.destroy, launcher)),
                Endpoint("quarantine", node_schema.subject(n, node_schema.QUARANTINE), node_schema.QuarantineRequest,
                         sub(handlers.quarantine, launcher)),
                Endpoint("pause", node_schema.subject(n, node_schema.PAUSE), node_schema.PauseRequest,
                         sub(handlers.pause, launcher)),
                Endpoint("resume", node_schema.subject(n, node_schema.RESUME), node_schema.ResumeRequest,
                         sub(handlers.resume, launcher)),
                Endpoint("pause_selected", node_schema.subject(n, node_schema.PAUSE_SELECTED),
                         node_schema.SelectedRequest, sub(handlers.pause_selected, launcher)),
                Endpoint("resume_selected", node_schema.subject(n, node_schema.RESUME_SELECTED),
                         node_schema.SelectedRequest, sub(handlers.resume_selected, launcher)),
                Endpoint("hint", node_schema.subject(n, node_schema.HINT), node_schema.HintRequest,
                         sub(handlers.hint, launcher)),
                Endpoint("checkpoint", node_schema.subject(n, node_schema.CHECKPOINT), node_schema.CheckpointRequest,
                         sub(handlers.checkpoint, launcher)),
            ],
            queue_group=f"launcher-{n}",
        )
        tasks = [asyncio.create_task(heartbeat(bus, launcher, intake, config, criu_status)),
                 asyncio.create_task(launcher.expire_loop()), asyncio.create_task(fencing.fence_loop(launcher))]
        log.info("launcher serving node %s with %s (%d sandboxes re-adopted)", n, launcher.isolation, len(launcher.live))
        await stop.wait()
        for task in tasks:
            task.cancel()
        await launcher.destroy_all(Reason.NODE_SHUTDOWN)
        kv = await bus.js.key_value(node_schema.KV_BUCKET)
        await kv.delete(n)
    process_runtime.shutdown()
    if crun is not None:
        crun.close()


if __name__ == "__main__":
    runner.run("launcher", main)

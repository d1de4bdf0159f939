"""Composition root of a node's launcher: recover, serve, heartbeat; destroy everything on SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import time

import nats.errors
import nats.js.errors

from sandfleet import runner
from sandfleet.bus import Bus, Endpoint, encode
from sandfleet.config import ServiceConfig
from sandfleet.store import SandboxStore
from schemas import node as node_schema
from schemas.node import MAX_FILE_BYTES, NodeInfo
from schemas.sandbox import Reason
from sandfleet.kernel import process as process_runtime
from services.launcher import handlers
from services.launcher.lifecycle import Launcher
from services.launcher.runtimes import Runtimes, detect_crun

log = logging.getLogger("sandfleet.launcher")

PR_SET_CHILD_SUBREAPER = 36
LARGE = MAX_FILE_BYTES * 2  # base64 in JSON grows bytes by a third


async def heartbeat(bus: Bus, launcher: Launcher, config: ServiceConfig) -> None:
    kv = await bus.js.key_value(node_schema.KV_BUCKET)
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    while True:
        info = NodeInfo(
            id=config.node_id,
            isolation=launcher.isolation,
            capacity=config.capacity,
            running=len(launcher.live),
            cpus=os.cpu_count() or 1,
            memory_mb=memory_mb,
            at=time.time(),
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
    async with runner.service_bus("launcher", config) as bus:
        launcher = Launcher(bus=bus, store=await SandboxStore.open(bus), node_id=config.node_id,
                            runtimes=Runtimes(crun))
        await launcher.recover()
        sub = functools.partial
        n = config.node_id
        await bus.serve(
            "launcher",
            [
                Endpoint("launch", node_schema.subject(n, node_schema.LAUNCH), node_schema.LaunchRequest,
                         sub(handlers.launch, launcher), max_bytes=8 << 20),
                Endpoint("exec", node_schema.subject(n, node_schema.EXEC), node_schema.ExecRequest,
                         sub(handlers.exec_, launcher), max_bytes=LARGE),
                Endpoint("write_file", node_schema.subject(n, node_schema.WRITE_FILE), node_schema.WriteFileRequest,
                         sub(handlers.write_file, launcher), max_bytes=LARGE),
                Endpoint("read_file", node_schema.subject(n, node_schema.READ_FILE), node_schema.ReadFileRequest,
                         sub(handlers.read_file, launcher)),
                Endpoint("destroy", node_schema.subject(n, node_schema.DESTROY), node_schema.DestroyRequest,
                         sub(handlers.destroy, launcher)),
            ],
            queue_group=f"launcher-{n}",
        )
        tasks = [asyncio.create_task(heartbeat(bus, launcher, config)), asyncio.create_task(launcher.expire_loop())]
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

"""The launcher's own settings, read from the environment once by its composition root."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LauncherSettings:
    # Sandboxes built at once (launched, or destroyed at shutdown); more only queue in the agent.
    launch_concurrency: int = 16  # SANDFLEET_LAUNCH_CONCURRENCY
    # How long a launch builds before its sandboxes are marked `starting` (see starting.py).
    starting_grace_s: float = 0.5  # SANDFLEET_STARTING_GRACE_S
    # How often the launcher looks for sandboxes whose records ended elsewhere (see fencing.py).
    fence_s: float = 15.0  # SANDFLEET_FENCE_S
    # The longest life `set_timeout` may give a sandbox, from now (a create's own limit: 7 days).
    max_timeout_s: float = 7 * 24 * 3600.0  # SANDFLEET_MAX_TIMEOUT_S
    # Background processes (services/launcher/processes.py): running at once per sandbox, the
    # output kept per process for readers by default and at most, and the ended ones kept per
    # sandbox (their output and exit stay readable until more end).
    max_processes: int = 32  # SANDFLEET_MAX_PROCESSES
    process_buffer_bytes: int = 1 << 20  # SANDFLEET_PROCESS_BUFFER_BYTES
    max_process_buffer_bytes: int = 16 << 20  # SANDFLEET_MAX_PROCESS_BUFFER_BYTES
    ended_processes_kept: int = 16  # SANDFLEET_ENDED_PROCESSES_KEPT
    # Port-forward tunnels open at once on this node (each one TCP connection), and what each may
    # hold: a window of bytes per direction, so node memory stays under about
    # max_tunnels * 2 * (window + 128 KiB of socket buffers) whatever the readers do.
    max_tunnels: int = 1024  # SANDFLEET_MAX_TUNNELS
    tunnel_window_bytes: int = 256 * 1024  # SANDFLEET_TUNNEL_WINDOW_BYTES
    tunnel_keepalive_s: float = 5.0  # SANDFLEET_TUNNEL_KEEPALIVE_S: a PING after this long quiet
    tunnel_idle_s: float = 30.0  # SANDFLEET_TUNNEL_IDLE_S: a tunnel not heard from this long is reset
    # Uploads and downloads in progress per sandbox; each holds at most a window of chunks.
    transfers_per_sandbox: int = 16  # SANDFLEET_TRANSFERS_PER_SANDBOX
    # File watches per sandbox, events each holds for a slow reader, directories each watches.
    watches_per_sandbox: int = 16  # SANDFLEET_WATCHES_PER_SANDBOX
    watch_buffer: int = 4096  # SANDFLEET_WATCH_BUFFER
    watch_max_dirs: int = 1024  # SANDFLEET_WATCH_MAX_DIRS
    # Warm pools (pool.py): spares built at once (the refill's CPU budget), and the node's memory
    # PSI (`some avg10`, percent) at which every spare is destroyed and none is built; 0: never.
    pool_builds: int = 1  # SANDFLEET_POOL_BUILDS
    pool_memory_psi: float = 10.0  # SANDFLEET_POOL_MEMORY_PSI

    @classmethod
    def from_env(cls) -> LauncherSettings:
        env = os.environ
        return cls(
            launch_concurrency=int(env.get("SANDFLEET_LAUNCH_CONCURRENCY") or cls.launch_concurrency),
            starting_grace_s=float(env.get("SANDFLEET_STARTING_GRACE_S") or cls.starting_grace_s),
            fence_s=float(env.get("SANDFLEET_FENCE_S") or cls.fence_s),
            max_timeout_s=float(env.get("SANDFLEET_MAX_TIMEOUT_S") or cls.max_timeout_s),
            max_processes=int(env.get("SANDFLEET_MAX_PROCESSES") or cls.max_processes),
            process_buffer_bytes=int(env.get("SANDFLEET_PROCESS_BUFFER_BYTES") or cls.process_buffer_bytes),
            max_process_buffer_bytes=int(env.get("SANDFLEET_MAX_PROCESS_BUFFER_BYTES")
                                         or cls.max_process_buffer_bytes),
            ended_processes_kept=int(env.get("SANDFLEET_ENDED_PROCESSES_KEPT") or cls.ended_processes_kept),
            max_tunnels=int(env.get("SANDFLEET_MAX_TUNNELS") or cls.max_tunnels),
            tunnel_window_bytes=int(env.get("SANDFLEET_TUNNEL_WINDOW_BYTES") or cls.tunnel_window_bytes),
            tunnel_keepalive_s=float(env.get("SANDFLEET_TUNNEL_KEEPALIVE_S") or cls.tunnel_keepalive_s),
            tunnel_idle_s=float(env.get("SANDFLEET_TUNNEL_IDLE_S") or cls.tunnel_idle_s),
            transfers_per_sandbox=int(env.get("SANDFLEET_TRANSFERS_PER_SANDBOX") or cls.transfers_per_sandbox),
            watches_per_sandbox=int(env.get("SANDFLEET_WATCHES_PER_SANDBOX") or cls.watches_per_sandbox),
            watch_buffer=int(env.get("SANDFLEET_WATCH_BUFFER") or cls.watch_buffer),
            watch_max_dirs=int(env.get("SANDFLEET_WATCH_MAX_DIRS") or cls.watch_max_dirs),
            pool_builds=int(env.get("SANDFLEET_POOL_BUILDS") or cls.pool_builds),
            pool_memory_psi=float(env.get("SANDFLEET_POOL_MEMORY_PSI") or cls.pool_memory_psi),
        )

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
    # Uploads and downloads in progress per sandbox; each holds at most a window of chunks.
    transfers_per_sandbox: int = 16  # SANDFLEET_TRANSFERS_PER_SANDBOX
    # File watches per sandbox, events each holds for a slow reader, directories each watches.
    watches_per_sandbox: int = 16  # SANDFLEET_WATCHES_PER_SANDBOX
    watch_buffer: int = 4096  # SANDFLEET_WATCH_BUFFER
    watch_max_dirs: int = 1024  # SANDFLEET_WATCH_MAX_DIRS

    @classmethod
    def from_env(cls) -> LauncherSettings:
        env = os.environ
        return cls(
            launch_concurrency=int(env.get("SANDFLEET_LAUNCH_CONCURRENCY") or cls.launch_concurrency),
            starting_grace_s=float(env.get("SANDFLEET_STARTING_GRACE_S") or cls.starting_grace_s),
            fence_s=float(env.get("SANDFLEET_FENCE_S") or cls.fence_s),
            transfers_per_sandbox=int(env.get("SANDFLEET_TRANSFERS_PER_SANDBOX") or cls.transfers_per_sandbox),
            watches_per_sandbox=int(env.get("SANDFLEET_WATCHES_PER_SANDBOX") or cls.watches_per_sandbox),
            watch_buffer=int(env.get("SANDFLEET_WATCH_BUFFER") or cls.watch_buffer),
            watch_max_dirs=int(env.get("SANDFLEET_WATCH_MAX_DIRS") or cls.watch_max_dirs),
        )

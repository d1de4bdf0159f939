"""The endpoint's settings, read once at start from its environment (`sandfleet up` passes its own on)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sandfleet.config import nats_url
from services.fusion.languages import layer_map

DEFAULT_PORT = 8080  # SandboxFusion's own, so a client's default endpoint finds it


@dataclass(frozen=True)
class FusionConfig:
    nats_url: str
    host: str
    port: int
    layers: dict[str, str]
    isolation: str
    memory_mb: int
    concurrency: int

    @classmethod
    def from_env(cls) -> FusionConfig:
        env = os.environ
        return cls(
            nats_url=nats_url(),
            host=env.get("SANDFLEET_FUSION_HOST") or "127.0.0.1",
            port=int(env.get("SANDFLEET_FUSION_PORT") or DEFAULT_PORT),
            layers=layer_map(env.get("SANDFLEET_FUSION_LAYERS", "")),
            isolation=env.get("SANDFLEET_FUSION_ISOLATION") or "process",
            memory_mb=int(env.get("SANDFLEET_FUSION_MEMORY_MB") or 1024),
            concurrency=int(env.get("SANDFLEET_FUSION_CONCURRENCY") or 64),
        )

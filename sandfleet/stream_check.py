"""The end-to-end check of a transfer's bytes (schemas.files.Check), made alike on both sides:
the SDK's uploads and downloads and the launcher's end of them. Each is a running digest fed
chunk by chunk (`update`, `hexdigest`); both release the GIL on large buffers."""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

from schemas.files import Check


class RunningDigest(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def digest(check: Check) -> RunningDigest:
    if check == "sha256":
        return hashlib.sha256()
    if check == "xxh3-128":
        return xxhash.xxh3_128()
    raise ValueError(f"no check {check!r}")

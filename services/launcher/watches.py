"""The file watches of one sandbox: each an inotify watch the event loop reads as it becomes
readable, into a bounded buffer a client drains by long polling (a slow reader loses the
oldest events and is told how many; one that stops polling for `idle_s` loses the watch).
Attached to the sandbox's `Live`, so its end ends them, and a poll waiting then is answered
`ended`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from sandfleet.errors import ServiceError
from schemas.errors import ErrorCode
from schemas.files import FileEvent, WatchEvents
from services.launcher.drivers.base import DirectoryWatch

NAME = "watches"  # its key in Live.attached


@dataclass
class Watch:
    id: str
    source: DirectoryWatch
    idle_s: float
    capacity: int
    buffer: deque = field(default_factory=deque)
    dropped: int = 0
    ended: bool = False
    touched: float = field(default_factory=time.monotonic)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def readable(self) -> None:
        try:
            changes = self.source.changes()
        except OSError:
            changes = [("ended", "", True)]
        for kind, path, is_dir in changes:
            if kind == "overflow":
                self.dropped += 1  # at least one; the kernel does not say how many
            elif kind == "ended":
                self.ended = True
            elif not (self.buffer and self.buffer[-1] == (kind, path, is_dir)):  # a write's modify + close
                if len(self.buffer) >= self.capacity:
                    self.buffer.popleft()
                    self.dropped += 1
                self.buffer.append((kind, path, is_dir))
        if self.ended:
            self.stop()
        self.ready.set()

    def stop(self) -> None:
        if self.source.fd >= 0:
            asyncio.get_running_loop().remove_reader(self.source.fd)
            self.source.close()
        self.ended = True
        self.ready.set()


@dataclass
class Watches:
    per_sandbox: int
    capacity: int
    live: dict[str, Watch] = field(default_factory=dict)
    sweeper: asyncio.Task | None = None

    def add(self, source: DirectoryWatch, idle_s: float) -> Watch:
        if len(self.live) >= self.per_sandbox:
            source.close()
            raise ServiceError(ErrorCode.CAPACITY, f"{len(self.live)} watches open in this sandbox: close one first")
        watch = Watch(id=secrets.token_hex(12), source=source, idle_s=idle_s, capacity=self.capacity)
        self.live[watch.id] = watch
        loop = asyncio.get_running_loop()
        loop.add_reader(source.fd, watch.readable)
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = loop.create_task(self._sweep())
        return watch

    async def next(self, watch_id: str, wait_s: float, max_events: int) -> WatchEvents:
        watch = self.live.get(watch_id)
        if watch is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"no watch {watch_id} (it was closed, or sat idle)")
        watch.touched = time.monotonic()
        if not watch.buffer and not watch.ended and wait_s > 0:
            watch.ready.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(watch.ready.wait(), wait_s)
        watch.touched = time.monotonic()
        events = [FileEvent(kind=k, path=p, is_dir=d) for k, p, d in
                  (watch.buffer.popleft() for _ in range(min(max_events, len(watch.buffer))))]
        dropped, watch.dropped = watch.dropped, 0
        ended = watch.ended and not watch.buffer
        if ended:
            self.live.pop(watch_id, None)
        return WatchEvents(events=events, dropped=dropped, ended=ended)

    def close(self, watch_id: str) -> bool:
        watch = self.live.pop(watch_id, None)
        if watch is None:
            return False
        watch.stop()
        return True

    async def _sweep(self) -> None:
        while self.live:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for watch in [w for w in self.live.values() if now - w.touched > w.idle_s]:
                self.close(watch.id)

    async def end(self) -> None:
        """The sandbox ends: every watch stops; a poll waiting now is answered `ended`."""
        if self.sweeper is not None:
            self.sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sweeper
        for watch in list(self.live.values()):
            watch.stop()
        await asyncio.sleep(0)  # let waiting polls see it
        self.live.clear()

"""A background process's output as the node keeps it for readers: one count of bytes over
stdout and stderr from the process's start, the newest `capacity` bytes of it held, the
oldest dropped first. Pure logic (no I/O): readers pull from an offset and are told how many
bytes they missed; `changed` wakes the readers waiting for more.

Backpressure: while a reader keeps reading (it read within `grace_s`) and is half a buffer
behind, `append` returns a future that the pipes' reader waits on before it reads more, so a
fast command streamed to a live client waits for it (as a pipe would) instead of having most
of its output dropped; a reader that stopped (or never came, from the process's start) holds
nothing back for longer than `grace_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from schemas.process import READER_GRACE_S, Chunk


class OutputBuffer:
    def __init__(self, capacity: int, grace_s: float = READER_GRACE_S) -> None:
        self.capacity = max(1, capacity)
        self.grace_s = grace_s
        self.chunks: deque[Chunk] = deque()
        self.start = 0  # offset of the oldest byte held
        self.end = 0  # bytes written in all
        self.reader_offset = 0  # how far the furthest reader has been handed output
        # When a reader last read (monotonic). A process is born with its reader about to come
        # (a streamed exec reads at once): without this, a fast command's first megabytes would
        # be dropped before the first read arrived.
        self.reader_seen = time.monotonic()
        self._changed: asyncio.Future | None = None
        self._room: asyncio.Future | None = None  # what a paused writer waits on
        self._watch: asyncio.TimerHandle | None = None  # the one timer checking for a reader gone

    @property
    def held(self) -> int:
        return self.end - self.start

    def append(self, stream: int, data: bytes) -> asyncio.Future | None:
        """Keep `data`; returns a future to wait on before appending more (a live reader is
        behind), else None."""
        self.chunks.append(Chunk(stream=stream, offset=self.end, data=data))
        self.end += len(data)
        while self.held > self.capacity:
            oldest = self.chunks[0]
            over = self.held - self.capacity
            if over >= len(oldest.data):
                self.chunks.popleft()
                self.start += len(oldest.data)
            else:  # keep the newest part of the oldest chunk
                self.chunks[0] = Chunk(stream=oldest.stream, offset=oldest.offset + over, data=oldest.data[over:])
                self.start += over
        self.wake()
        return self._hold_back()

    def _hold_back(self) -> asyncio.Future | None:
        if self.end - self.reader_offset < max(1, self.capacity // 2):
            return None
        if time.monotonic() - self.reader_seen >= self.grace_s:
            return None  # nobody is reading: the oldest output goes instead
        if self._room is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # appended outside a loop (a unit test): nothing can wait
                return None
            self._room = loop.create_future()
            if self._watch is None:
                self._watch = loop.call_later(self.grace_s, self._reader_gone)
        return self._room

    def _reader_gone(self) -> None:
        """While a writer waits: released once its reader has not been seen for grace_s."""
        self._watch = None
        if self._room is None:
            return
        idle = time.monotonic() - self.reader_seen
        if idle >= self.grace_s:
            self._release()
        else:
            self._watch = asyncio.get_running_loop().call_later(self.grace_s - idle, self._reader_gone)

    def _release(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def read(self, offset: int, max_bytes: int) -> tuple[list[Chunk], int, int]:
        """(chunks from `offset` up to max_bytes, the next offset, bytes dropped before them); a
        chunk cut to fit is a memoryview of the bytes held (not copied; bytes never change)."""
        dropped = max(0, self.start - offset)
        offset = max(offset, self.start)
        out: list[Chunk] = []
        room = max_bytes
        for chunk in self.chunks:
            stop = chunk.offset + len(chunk.data)
            if stop <= offset:
                continue
            data = chunk.data
            if chunk.offset < offset or len(data) > room:  # a reply's first and last chunk are mostly cut:
                data = memoryview(data)[max(0, offset - chunk.offset):][:room]  # a view, not a copy
            out.append(Chunk(stream=chunk.stream, offset=max(offset, chunk.offset), data=data))
            room -= len(data)
            if room <= 0:
                break
        next_offset = (out[-1].offset + len(out[-1].data)) if out else min(max(offset, self.start), self.end)
        self.reader_seen = time.monotonic()
        self.reader_offset = max(self.reader_offset, next_offset)
        if self._room is not None and self.end - self.reader_offset < max(1, self.capacity // 2):
            self._release()
        return out, next_offset, dropped

    def wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def changed(self, timeout: float) -> None:
        """Until the next append or wake, or `timeout` seconds."""
        self.reader_seen = time.monotonic()  # a reader waiting is a reader reading
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)
        except TimeoutError:
            pass

    def free(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self.chunks.clear()
        self.start = self.end
        self.reader_seen = float("-inf")  # nothing to hold back for any more
        self._release()
        self.wake()

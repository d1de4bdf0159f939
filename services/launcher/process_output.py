"""A background process's output as the node keeps it for readers: one count of bytes over
stdout and stderr from the process's start, the newest `capacity` bytes of it held, the
oldest dropped first. Pure logic (no I/O): readers pull from an offset and are told how many
bytes they missed; `changed` wakes the readers waiting for more."""

from __future__ import annotations

import asyncio
from collections import deque

from schemas.process import Chunk


class OutputBuffer:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.chunks: deque[Chunk] = deque()
        self.start = 0  # offset of the oldest byte held
        self.end = 0  # bytes written in all
        self._changed: asyncio.Future | None = None

    @property
    def held(self) -> int:
        return self.end - self.start

    def append(self, stream: int, data: bytes) -> None:
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

    def read(self, offset: int, max_bytes: int) -> tuple[list[Chunk], int, int]:
        """(chunks from `offset` up to max_bytes, the next offset, bytes dropped before them)."""
        dropped = max(0, self.start - offset)
        offset = max(offset, self.start)
        out: list[Chunk] = []
        room = max_bytes
        for chunk in self.chunks:
            stop = chunk.offset + len(chunk.data)
            if stop <= offset:
                continue
            data = chunk.data[offset - chunk.offset:] if chunk.offset < offset else chunk.data
            data = data[:room]
            out.append(Chunk(stream=chunk.stream, offset=max(offset, chunk.offset), data=data))
            room -= len(data)
            if room <= 0:
                break
        next_offset = (out[-1].offset + len(out[-1].data)) if out else min(max(offset, self.start), self.end)
        return out, next_offset, dropped

    def wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def changed(self, timeout: float) -> None:
        """Until the next append or wake, or `timeout` seconds."""
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)
        except TimeoutError:
            pass

    def free(self) -> None:
        self.chunks.clear()
        self.start = self.end
        self.wake()

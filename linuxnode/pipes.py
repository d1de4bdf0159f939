"""A command's pipes driven by the event loop, shared by the process and container runtimes.

Output is kept up to `max_output` bytes per stream (the rest is read and dropped, so the
command never blocks on a full pipe), stdin is written as fast as the pipe takes it. The
pipes are ours, not asyncio's transports, so output a background process keeps open can be
closed when the exec is over.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runtime's forking helper imports this module and must stay light
    import asyncio


class LoopPipes:
    def __init__(self, loop: asyncio.AbstractEventLoop, outputs: dict[int, bytearray], in_w: int, stdin: bytes,
                 max_output: int, uncapped: frozenset[int] = frozenset()) -> None:
        self.loop, self.max_output, self.uncapped = loop, max_output, uncapped
        self.buffers = outputs
        self.eof = {fd: loop.create_future() for fd in outputs}
        self.truncated = False
        for fd in outputs:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)
        self.stdin, self.in_w = memoryview(stdin), in_w
        if stdin:
            os.set_blocking(in_w, False)
            self._writable()
        else:
            self._close_stdin()

    def on_chunk(self, fd: int) -> bool:
        """Called after each chunk read from fd; True stops reading it (a subclass's hook)."""
        return False

    def _readable(self, fd: int) -> None:
        buf = self.buffers[fd]
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close_reader(fd)
                return
            if fd not in self.uncapped and len(buf) + len(chunk) > self.max_output:
                chunk = chunk[: max(0, self.max_output - len(buf))]
                self.truncated = True
            buf += chunk
            if self.on_chunk(fd):
                self.close_reader(fd)
                return

    def close_reader(self, fd: int) -> None:
        if not self.eof[fd].done():
            self.loop.remove_reader(fd)
            os.close(fd)
            self.eof[fd].set_result(None)

    def _writable(self) -> None:
        try:
            while self.stdin:
                self.stdin = self.stdin[os.write(self.in_w, self.stdin[:65536]):]
        except BlockingIOError:
            self.loop.add_writer(self.in_w, self._writable)
            return
        except OSError:  # the command closed its stdin or exited
            pass
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self.in_w >= 0:
            self.loop.remove_writer(self.in_w)
            os.close(self.in_w)
            self.in_w = -1

    def close_pipes(self) -> None:
        for fd in list(self.eof):
            self.close_reader(fd)
        self._close_stdin()

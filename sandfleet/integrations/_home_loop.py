"""An event loop of its own in a daemon thread, for an adapter whose caller may bring a fresh
loop to every call: SWE-agent wraps each one in `asyncio.run`. A NATS connection (and every
lock and task of a shell session) belongs to the loop it was made on, so the adapter makes
them on its home loop and runs each call there, awaited from whichever loop called."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class HomeLoop:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    async def run(self, coro: Awaitable[T]) -> T:
        """`coro` run on the home loop; cancelling the caller cancels it there."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        """Stop the loop and its thread (from outside it, once its work is done)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def at_home(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """An async method run on its object's `home` (a HomeLoop, or None: the caller's loop)."""

    @functools.wraps(method)
    async def call(self: Any, *args: Any, **kwargs: Any) -> T:
        home: HomeLoop | None = self.home
        if home is None:
            return await method(self, *args, **kwargs)
        return await home.run(method(self, *args, **kwargs))

    return call

"""Every use of nats-py's private attributes (with natspy_bulk.py, the raw paths' own), each with
why public API does not do.

nats-py (2.16) has no batch publish and no way to take a subscription's messages other than
through its per-subscription queue and task; at tens of thousands of messages a batch both
cost most of the time. Its reader takes 32 KiB off the socket a turn. The seams below are what
`Bus.publish_many` and `Bus.subscribe_direct` stand on, and the reader's turn is the raw paths'
too. tests/test_natspy_internals.py checks each against a real nats-server, so a nats-py
upgrade that moves them fails there, loudly, and not in a benchmark."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import nats.aio.client
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("sandfleet.bus")


async def write_frames(nc: Client, frames: bytes) -> None:
    """Hand already-built PUB/HPUB frames to the connection's outgoing buffer.

    `Client._send_command` is what nats-py's own `publish` ends with, after validating the
    subject and encoding the headers of one message (~30 µs); frames built in one pass skip
    that per message. It flushes by itself when the buffer exceeds the client's pending size."""
    await nc._send_command(frames)


async def flush_frames(nc: Client) -> None:
    """Wake the connection's flusher for what `write_frames` queued, without waiting for the
    server's PONG as the public `flush()` does (a round trip per batch for nothing: the
    replies say what arrived). `Client._flush_pending` is what `publish` calls for that."""
    await nc._flush_pending()


def hand_directly(sub: Subscription, handler: Callable[[Msg], None]) -> None:
    """Give each message of `sub` (made without a callback, so nats-py runs no task for it) to
    `handler` as the connection's reader parses it.

    nats-py puts every message on `Subscription._pending_queue` (an asyncio.Queue) for a task
    to take off: several µs of queue hop a message. Replacing that queue with `_Handed` is the
    only way in; it also keeps `Subscription._pending_size`, the bytes nats-py counts as
    queued, at 0, since nothing stays queued."""
    if not (hasattr(sub, "_pending_queue") and hasattr(sub, "_pending_size")):  # else set in vain: no message comes
        raise RuntimeError("this nats-py keeps a subscription's queue elsewhere: see sandfleet/natspy_internals.py")
    sub._pending_queue = _Handed(sub, handler)  # type: ignore[assignment]


class _Handed:
    """What nats-py asks of a subscription's message queue: `put_nowait` (the reader delivering),
    `qsize`/`empty` (pending counts, unsubscribe), `task_done`/`join` (draining). The handler
    runs inside the connection's reader: an exception is logged here, never let through to it."""

    def __init__(self, sub: Any, handler: Callable[[Msg], None]) -> None:
        self._sub, self._handler = sub, handler

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size = 0
        try:
            self._handler(msg)
        except Exception:
            log.exception("handling a message on %s failed", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        pass


def read_per_turn(limit: int) -> None:
    """Let the connection's reader take up to `limit` bytes off the socket per turn of its loop.

    `Client._read_loop` reads `transport.read(DEFAULT_BUFFER_SIZE)`, the module global looked
    up at each read; its 32 KiB is 128 turns and parser passes per 4 MiB raw chunk, a quarter
    of a receiver's CPU. There is no option for it (`Client.connect` takes none)."""
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, limit)

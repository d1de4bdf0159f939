"""Where lifecycle events go: the `EventPublisher` interface, its JetStream implementation, and a null one.

`SandboxStore` hands every event of an accepted transition to its publisher. An event is
stored on `events.v3.sandbox.<tenant>.<node>.<id>.<event>`, de-duplicated by `<id>:<seq>` (a retry, or the
same move judged twice, is stored once). The null publisher is for unit tests of the logic
above and for anything that must change records without telling anyone.
"""

from __future__ import annotations

from typing import Protocol

from sandfleet.bus import Bus, encode
from sandfleet.jetstream import BatchedJetStream
from schemas import events


class EventPublisher(Protocol):
    async def publish(self, event: events.SandboxEvent) -> None:
        """Store one event (again while a clustered bus fails over)."""

    async def publish_many(self, batch: list[events.SandboxEvent], timeout: float) -> None:
        """Store a batch of events; raises if any is refused or unacknowledged within `timeout`."""


def messages(batch: list[events.SandboxEvent]) -> list[tuple[str, bytes, dict[str, str]]]:
    """How each event is stored: its subject, its body, and its de-duplication id `<id>:<seq>`."""
    return [(e.subject, encode(e), {"Nats-Msg-Id": f"{e.sandbox_id}:{e.seq}"})
            for e in batch]


class JetStreamEventPublisher:
    """Events into the events stream: one acked publish each, or fast-ingest batches through
    the `BatchedJetStream` the store also writes records with (one reply subscription)."""

    def __init__(self, bus: Bus, jetstream: BatchedJetStream) -> None:
        self.bus = bus
        self.jetstream = jetstream

    async def publish(self, event: events.SandboxEvent) -> None:
        ((subject, _, headers),) = messages([event])
        await self.bus.publish_durable(subject, event, msg_id=headers["Nats-Msg-Id"])  # with trace context

    async def publish_many(self, batch: list[events.SandboxEvent], timeout: float) -> None:
        await self.jetstream.append_many(messages(batch), timeout)


class NullEventPublisher:
    """Publishes nothing."""

    async def publish(self, event: events.SandboxEvent) -> None:
        pass

    async def publish_many(self, batch: list[events.SandboxEvent], timeout: float) -> None:
        pass

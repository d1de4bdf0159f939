"""The node agent's one violation publisher, without a NATS server (a recording bus stands in
for the bus adapter: what is tested is the logic above it), and the limits watch's shutdown
on the real event loop and a real epoll set."""

from __future__ import annotations

import asyncio

import msgspec

from agents.node.limits_watch import ViolationWatch
from agents.node.violations import ViolationPublisher
from linuxnode import cgroups
from schemas import violations
from schemas.violations import Violation


class RecordingBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Violation, str]] = []

    async def publish_durable(self, subject: str, msg: Violation, msg_id: str) -> None:
        self.sent.append((subject, msg, msg_id))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def publisher(per_second: int = 3) -> tuple[ViolationPublisher, RecordingBus, Clock]:
    bus, clock = RecordingBus(), Clock()
    pub = ViolationPublisher("n1", per_second=per_second, clock=clock)
    pub.bind(bus, store=None)  # labels come from the confine request here, never the store
    return pub, bus, clock


async def test_an_event_carries_the_sandbox_labels_and_goes_on_its_kind_subject():
    pub, bus, _ = publisher()
    pub.labels["sb-1"] = {"task": "t7"}
    assert await pub.publish("sb-1", "file.landlock", "fs.write_file path=/bin", pid=9, command="sh", msg_id="m1")
    subject, event, msg_id = bus.sent[0]
    assert subject == violations.subject("n1", "sb-1", "file.landlock") == "events.v1.violation.n1.sb-1.file_landlock"
    assert (event.labels, event.pid, event.command, event.attempted, msg_id) == (
        {"task": "t7"}, 9, "sh", "fs.write_file path=/bin", "m1")
    assert msgspec.json.decode(msgspec.json.encode(event), type=Violation) == event


async def test_a_flood_is_held_back_per_sandbox_and_the_next_event_counts_what_was_held_back():
    pub, bus, clock = publisher(per_second=3)
    sent = [await pub.publish("sb-1", "syscall.ptrace", "ptrace() refused", msg_id=f"a{i}") for i in range(10)]
    assert sent == [True] * 3 + [False] * 7
    assert await pub.publish("sb-2", "network.connect", "connect 1.2.3.4:80/tcp", msg_id="b")  # its own budget
    clock.now += 1.0
    assert await pub.publish("sb-1", "syscall.ptrace", "ptrace() refused", suppressed=5, msg_id="a10")
    last = bus.sent[-1][1]
    # 7 held back here plus 5 the kernel program held back before this record
    assert last.attempted == "ptrace() refused (after 12 similar attempt(s) not reported one by one)"
    assert await pub.publish("sb-1", "syscall.ptrace", "ptrace() refused", msg_id="a11")
    assert bus.sent[-1][1].attempted == "ptrace() refused"


async def test_without_a_bus_nothing_is_published_and_nothing_raises():
    pub = ViolationPublisher("n1")
    assert not await pub.publish("sb-1", "limit.pids", "fork() refused", msg_id="x")


async def test_closing_the_limits_watch_stops_its_reader_before_the_epoll_set_closes():
    pub, _, _ = publisher()
    watch = ViolationWatch("n1", cgroups.CgroupLayout.detect(), pub)  # no syscall programs: limits only
    watch.start()
    readers = list(watch._tasks)
    await asyncio.sleep(0.05)  # the reader is registered on the loop and waiting
    assert readers and not any(t.done() for t in readers)
    await watch.close()
    # closing the epoll set under a registered reader made its cleanup raise
    # "ValueError: I/O operation on closed epoll object" instead of ending cancelled
    assert all(t.cancelled() for t in readers), [t.exception() for t in readers if not t.cancelled()]

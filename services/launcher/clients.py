"""Typed clients of the node-local services the launcher calls over the bus: the node agent
(a sandbox's confinement: cgroups, netns, BPF, Landlock) and the layer-cache (its composed
root, the node's cache listing, and the layer a checkpoint packs). Each method is one request
with its schema types; errors are the bus adapter's (sandfleet.errors) for the caller to judge.

The calls a launch depends on (confine, compose and their releases) outlive a restart of the
service they ask: the supervisor has a killed agent or layer-cache back within a second or
two, so a call that finds nobody subscribed, or whose request died with the process that had
taken it, asks again until the service answers, and only after `RESTART_WAIT_S` more gives up
with `ServiceDown`. Asking again is safe because each of them is idempotent per sandbox (a
confinement or root that exists is found again, a release of nothing releases nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from sandfleet import errors
from sandfleet.bus import Bus
from sandfleet.layers_client import Layers
from schemas import layers as layers_schema
from schemas import node as node_schema
from schemas.layers import (
    BuildReply,
    CacheListing,
    CacheRequest,
    ComposeRequest,
    ReleaseRootfsReply,
    ReleaseRootfsRequest,
    Rootfs,
)
from schemas.node import Confinement, ConfinedList, ConfineRequest, Empty, NodeSecurity, ReleaseReply, ReleaseRequest
from schemas.sandbox import SandboxSpec

AGENT_TIMEOUT_S = 10.0
COMPOSE_TIMEOUT_S = 60.0  # fetching a layer the node lacks can take a while
# One compose request's wait: a compose asked again joins the one under way for its sandbox
# (the layer-cache composes each sandbox's root once, under a lock), so a short wait costs
# nothing when it is only slow and finds a lost request sooner; COMPOSE_TIMEOUT_S bounds the whole.
COMPOSE_ATTEMPT_S = 15.0
LAYERS_TIMEOUT_S = 30.0
HEARTBEAT_LISTING_TIMEOUT_S = 1.0  # a heartbeat must not wait on a busy layer-cache
RESTART_WAIT_S = 30.0  # past the request's own timeout: the supervisor's longest back-off is 5 s
FIRST_RETRY_S, LONGEST_RETRY_S = 0.1, 1.0
PROBE_EVERY_S = 0.5  # while calls wait: a service restarts in a second or more, so most restarts are seen

T = TypeVar("T")


class ServiceDown(errors.Timeout):
    """A node-local service did not answer, through its restarts, within the call's bound."""


class RestartingService:
    """Calls to one node-local service that may die and be restarted under them.

    A request whose service died is never answered, and would wait out its whole timeout. The
    moment any call finds nobody subscribed, every call sent before it is known to be lost (its
    service is gone and its successor never saw it): they stop waiting and ask again at once,
    instead of each waiting out its timeout. When every call is waiting (a launch's slots all
    held by lost requests) no new call would find that out, so `probe`, if given (a cheap
    request to the same service), is sent now and then while calls wait, to find it out for them."""

    def __init__(self, what: str, probe: Callable[[], Awaitable[object]] | None = None) -> None:
        self.what = what
        self._probe = probe
        self._waiting = 0  # attempts in flight
        self._prober: asyncio.Task[None] | None = None
        self._gone = asyncio.Event()  # set (and replaced) when the service is found gone
        # Since when nobody has answered (loop time; None: it answered last). A service gone
        # longer than a restart takes is not coming back soon: calls then fail at once.
        self._down_since: float | None = None

    async def call(self, ask: Callable[[], Awaitable[T]], budget: float) -> T:
        """`ask()` until it is answered (an error reply is an answer), for at most `budget`
        seconds past the first attempt's start; then `ServiceDown`."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + budget, FIRST_RETRY_S
        while True:
            gone = self._gone
            try:
                answer = await self._attempt(ask, gone)
            except errors.NoResponders as exc:
                self.found_gone()
                last: errors.SandfleetError = exc
                if loop.time() - (self._down_since or loop.time()) > RESTART_WAIT_S:
                    deadline = 0.0  # gone for longer than any restart: no waiting for it
                self._down_since = self._down_since or loop.time()
            except errors.Timeout as exc:
                last = exc
            except _Lost:
                continue  # the service was found gone after this was sent: ask the next one now
            else:
                self._down_since = None
                return answer
            left = deadline - loop.time()
            if left <= 0:
                raise ServiceDown(f"{self.what} did not answer within {budget:g}s: {last.message}",
                                  subject=last.subject) from None
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, LONGEST_RETRY_S)

    def found_gone(self) -> None:
        self._gone.set()
        self._gone = asyncio.Event()

    async def _attempt(self, ask: Callable[[], Awaitable[T]], gone: asyncio.Event) -> T:
        request = asyncio.ensure_future(ask())
        lost = asyncio.ensure_future(gone.wait())
        self._waiting += 1
        if self._probe is not None and self._prober is None:
            self._prober = asyncio.ensure_future(self._watch(self._probe))
        try:
            await asyncio.wait((request, lost), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled: so is its request
            request.cancel()
            raise
        finally:
            self._waiting -= 1
            lost.cancel()
        if request.done():
            return request.result()
        request.cancel()
        raise _Lost


    async def _watch(self, probe: Callable[[], Awaitable[object]]) -> None:
        """Probe the service while calls wait; nobody subscribed frees them all (`found_gone`)."""
        try:
            while self._waiting:
                await asyncio.sleep(PROBE_EVERY_S)
                if not self._waiting:
                    break
                try:
                    await probe()
                except errors.NoResponders:
                    self.found_gone()
                except errors.SandfleetError:
                    pass  # busy, or answering with an error: there, either way
        finally:
            self._prober = None


class _Lost(Exception):
    """A request sent to a service instance that has died since."""


class NodeAgent:
    def __init__(self, bus: Bus, node_id: str) -> None:
        self.bus = bus
        self._confine = node_schema.subject(node_id, node_schema.CONFINE)
        self._release = node_schema.subject(node_id, node_schema.RELEASE)
        self._listing = node_schema.subject(node_id, node_schema.AGENT_LIST)
        # Its cheapest answer (made once at start), not the listing: that lists every sandbox's
        # cgroups and names, and the probe asks twice a second while any call waits (a fill).
        security = node_schema.subject(node_id, node_schema.SECURITY)
        self._service = RestartingService(
            f"the node agent of {node_id}",
            probe=lambda: self.bus.request(security, Empty(), NodeSecurity, timeout=PROBE_EVERY_S * 2))

    async def held(self) -> set[str]:
        """The sandbox ids the agent holds a confinement for."""
        reply = await self._service.call(
            lambda: self.bus.request(self._listing, Empty(), ConfinedList, timeout=AGENT_TIMEOUT_S),
            AGENT_TIMEOUT_S + RESTART_WAIT_S)
        return set(reply.sandbox_ids)

    async def confine(self, sandbox_id: str, spec: SandboxSpec) -> Confinement:
        """The sandbox's confinement, made (or, for one that has it already, found again)."""
        request = ConfineRequest(
            sandbox_id=sandbox_id, isolation=spec.isolation, cpu=spec.cpu, memory_mb=spec.memory_mb, pids=spec.pids,
            allow=list(spec.allow), labels=dict(spec.labels), host_view=spec.host_view, build=spec.build,
        )
        return await self._service.call(
            lambda: self.bus.request(self._confine, request, Confinement, timeout=AGENT_TIMEOUT_S),
            AGENT_TIMEOUT_S + RESTART_WAIT_S)

    async def release(self, sandbox_id: str) -> None:
        """Give the confinement back; its cgroup's processes are killed first."""
        request = ReleaseRequest(sandbox_id=sandbox_id)
        await self._service.call(lambda: self.bus.request(self._release, request, ReleaseReply,
                                                          timeout=AGENT_TIMEOUT_S),
                                 AGENT_TIMEOUT_S + RESTART_WAIT_S)


class LayerCache:
    def __init__(self, bus: Bus, node_id: str) -> None:
        self.bus = bus
        self._compose = node_schema.subject(node_id, layers_schema.ROOTFS_COMPOSE)
        self._release = node_schema.subject(node_id, layers_schema.ROOTFS_RELEASE)
        self._cache = node_schema.subject(node_id, layers_schema.CACHE)
        self._service = RestartingService(f"the layer-cache of {node_id}")

    async def compose(self, sandbox_id: str, layers: list[str], disk_mb: int) -> Rootfs:
        request = ComposeRequest(sandbox_id=sandbox_id, layers=layers, disk_mb=disk_mb)
        return await self._service.call(
            lambda: self.bus.request(self._compose, request, Rootfs, timeout=COMPOSE_ATTEMPT_S),
            COMPOSE_TIMEOUT_S + RESTART_WAIT_S)

    async def release(self, sandbox_id: str) -> None:
        request = ReleaseRootfsRequest(sandbox_id=sandbox_id)
        await self._service.call(
            lambda: self.bus.request(self._release, request, ReleaseRootfsReply, timeout=LAYERS_TIMEOUT_S),
            LAYERS_TIMEOUT_S + RESTART_WAIT_S)

    async def listing(self, timeout: float = LAYERS_TIMEOUT_S, roots: bool = True) -> CacheListing:
        """The node's cached images and (unless not `roots`) the roots it holds, by sandbox."""
        return await self.bus.request(self._cache, CacheRequest(roots=roots), CacheListing, timeout=timeout)

    async def build_from_dir(self, name: str, path: Path, on: str, timeout: float) -> BuildReply:
        """Layer `name` over `on` from a directory of this node: the same cluster build request a
        user's `layer build --dir` makes (sent as a tar through the upload bucket to whichever
        layer-cache takes it: it owns the store), so it is the SDK's layer client that makes it."""
        return await Layers(self.bus).build_dir(name, path, on=on, timeout=timeout)

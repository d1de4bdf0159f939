"""One create is one trace: SDK → placement → launcher → node agent, joined by W3C context in NATS headers."""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sandfleet import telemetry
from sandfleet.layers_client import Layers
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base


async def test_one_create_is_one_trace_across_every_service(fleet, otlp):
    memory = InMemorySpanExporter()
    telemetry.setup("trainer", extra_processor=SimpleSpanProcessor(memory))
    with telemetry.tracer("test").start_as_current_span("trainer.step") as root:
        sb = await fleet.create(memory_mb=64, host_view=True)
    trace_id = format(root.get_span_context().trace_id, "032x")
    await sb.destroy()

    local = {format(s.context.span_id, "016x"): s for s in memory.get_finished_spans()}
    wanted = {"placement", "launcher", "agent"}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        remote = otlp.trace(trace_id)
        known = set(local) | {s.span_id for s in remote}
        # A phase's span ends after the spans inside it, so it may arrive after them: wait for every parent.
        if (wanted <= {s.service for s in remote} and any(s.name.endswith(".confine") for s in remote)
                and all(s.parent_id in known for s in remote)):
            break
        await asyncio.sleep(0.2)
    remote = otlp.trace(trace_id)
    assert wanted <= {s.service for s in remote}, {s.service for s in remote}

    known = set(local) | {s.span_id for s in remote}
    root_id = format(root.get_span_context().span_id, "016x")
    for span in remote:
        assert span.parent_id in known, f"{span.service}:{span.name} has a parent outside the trace"
    by_id = {s.span_id: s for s in remote}

    def chain(span) -> list[str]:
        names = []
        while span.span_id in by_id:
            names.append(f"{span.service}:{span.name}")
            parent = span.parent_id
            if parent not in by_id:
                assert parent in local, parent
                break
            span = by_id[parent]
        return names

    confine = next(s for s in remote if s.service == "agent" and s.name.endswith(".confine"))
    hops = chain(confine)
    assert [h.split(":")[0] for h in hops if ":node.v1" in h or ":sandbox.v1" in h] == ["agent", "launcher", "placement"]
    assert root_id in local


async def test_a_creation_trace_is_found_by_its_sandbox_id(fleet, otlp):
    """The SDK's create span names the sandbox it made, and so does every node hop about it:
    a trace is found by sandbox.id (the canonical key logs carry too)."""
    memory = InMemorySpanExporter()
    telemetry.setup("trainer", extra_processor=SimpleSpanProcessor(memory))
    sb = await fleet.create(memory_mb=64, host_view=True)
    await sb.destroy()
    [create] = [s for s in memory.get_finished_spans() if s.name == "sandbox.create"
                and s.attributes.get(telemetry.SANDBOX_ID) == sb.id]
    assert create.attributes[telemetry.NODE_ID] == sb.node
    trace_id = format(create.context.trace_id, "032x")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        tagged = {s.service for s in otlp.trace(trace_id) if s.attributes.get(telemetry.SANDBOX_ID) == sb.id}
        if {"launcher", "agent"} <= tagged:
            break
        await asyncio.sleep(0.2)
    assert {"launcher", "agent"} <= tagged, tagged


PHASES = {
    "placement": {"placement.decide"},
    "launcher": {"launcher.launch", "launcher.spawn"},
    "agent": {"agent.cgroups", "agent.bpf_attach", "agent.netns"},
    "layer-cache": {"layer.fetch", "layer.mount", "layer.compose_root"},
}


async def test_the_phases_inside_each_hop_are_spans_with_the_sandboxes_attributes(fleet, platform, otlp,
                                                                                 tmp_path_factory):
    """Inside each hop of a create, its phases (the placement decision, the layer fetch, mounts and
    root compose, the cgroups, BPF attach and netns of the confinement, the spawn) are spans of the
    same trace; the launch's span carries the canonical attributes, and the state changes each hop
    made are events on its spans."""
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    layers = Layers(fleet.bus)
    src = tmp_path_factory.mktemp("trace-layer")
    make_busybox_base(src / "base")
    await layers.build_dir("trace-base", src / "base")
    await layers.cache_drop(platform.node_id)  # built here it is cached; dropped, the create fetches it
    memory = InMemorySpanExporter()
    telemetry.setup("trainer", extra_processor=SimpleSpanProcessor(memory))
    with telemetry.tracer("test").start_as_current_span("trainer.step") as root:
        sb = await fleet.create(memory_mb=64, layers=["trace-base"], labels={"tenant": "team-a"})
    trace_id = format(root.get_span_context().trace_id, "032x")
    await sb.destroy()

    def seen() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for span in otlp.trace(trace_id):
            found.setdefault(span.service, set()).add(span.name)
        return found

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(want <= seen().get(s, set()) for s, want in PHASES.items()):
        await asyncio.sleep(0.2)
    for service, want in PHASES.items():
        assert want <= seen().get(service, set()), (service, want - seen().get(service, set()))

    spans = otlp.trace(trace_id)
    [launch] = [s for s in spans if s.name == "launcher.launch"]
    assert launch.attributes[telemetry.SANDBOX_ID] == sb.id and launch.attributes[telemetry.NODE_ID] == sb.node
    assert launch.attributes[telemetry.TENANT] == "team-a"
    assert launch.attributes[telemetry.ISOLATION] == "process"
    assert launch.attributes[telemetry.LAYERS] == ["trace-base"]
    by_id = {s.span_id: s for s in spans}
    for phase in ("launcher.spawn", "layer.fetch", "agent.bpf_attach"):
        [span] = [s for s in spans if s.name == phase]
        assert span.parent_id in by_id, f"{phase} is not inside a hop of the trace"
    states = [e[1]["sandbox.state"] for s in spans for e in s.events if e[0] == "sandbox.state"]
    assert "scheduled" in states and "running" in states, states
    assert ("sandbox.state", {"sandbox.state": "running"}) in launch.events

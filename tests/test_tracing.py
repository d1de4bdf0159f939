"""One create is one trace: SDK → placement → launcher → node agent, joined by W3C context in NATS headers."""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sandfleet import telemetry


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
        if wanted <= {s.service for s in remote} and any(s.name.endswith(".confine") for s in remote):
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

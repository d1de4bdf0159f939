"""Metrics and dashboards for real: a platform run with its own Prometheus (Debian's binary,
scraping every service's endpoint through the supervisor's targets file) under a short
workload — creates on layers and on the host view, execs, a violation a policy kills for, a
layer fetched from the store, a refused request — and then every query of every dashboard,
as Grafana would send it, answered with data by that Prometheus's HTTP API.

The dashboards' JSON is also checked offline: the committed files are what the generator
makes, and each decodes into the Grafana foundation SDK's typed dashboard model (every key a
field of it, every value of the field's type) and encodes back to the same JSON. Grafana
itself is not installable on this machine, so no Grafana renders them here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import typing
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import sandfleet
from sandfleet import errors, metrics
from sandfleet.layers_client import Layers
from tests.conftest import EVENT_DEADLINE_S, NODE_ID, ROOT, assert_nothing_left, start_platform, stop_platform
from tests.kernel import require
from tests.layer_trees import BUSYBOX, make_busybox_base

PM_NODE = f"{NODE_ID}pm"
CONNECT = "import socket; s = socket.socket(); s.connect(('10.1.2.3', 80))"
# What Grafana puts in for its own variables; `$node` is "All".
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "10m", "$node": ".*"}


def _generator():
    spec = importlib.util.spec_from_file_location("sandfleet_dashboards", ROOT / "infra/observability/dashboards.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dashboards = _generator()


def _committed() -> dict[str, dict]:
    return {name: json.loads((dashboards.OUT / f"{name}.json").read_text()) for name in dashboards.DASHBOARDS}


def _queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel, PromQL) for every target of every panel, and every query variable."""
    found = []
    for name, board in _committed().items():
        for panel in board["panels"]:
            found += [(name, panel["title"], t["expr"]) for t in panel.get("targets", [])]
        for variable in board.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                found.append((name, f"${variable['name']}", variable["query"]))
    return found


# -- the dashboards' JSON, offline -----------------------------------------------------------


def test_the_committed_dashboards_are_what_the_generator_makes():
    for name in dashboards.DASHBOARDS:
        assert (dashboards.OUT / f"{name}.json").read_text() == dashboards.render(name), \
            f"{name}.json is stale: run `python infra/observability/dashboards.py`"


def _conforms(value: object, hint: object, where: str) -> None:
    """`value` is of the SDK's declared type `hint`; a model instance is checked field by field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (object, typing.Any) or value is None and (origin is typing.Union and type(None) in args):
        return
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        failures = []
        for option in args:
            try:
                return _conforms(value, option, where)
            except AssertionError as exc:
                failures.append(str(exc))
        raise AssertionError(f"{where}: {value!r} is none of {hint}: {failures}")
    if origin is typing.Literal:
        assert value in args, f"{where}: {value!r} not one of {args}"
        return
    if origin is list:
        assert isinstance(value, list), f"{where}: {value!r} is not a list"
        for i, item in enumerate(value):
            _conforms(item, args[0], f"{where}[{i}]")
        return
    if origin is dict:
        assert isinstance(value, dict), f"{where}: {value!r} is not a dict"
        for key, item in value.items():
            _conforms(key, args[0], f"{where} key")
            _conforms(item, args[1], f"{where}[{key!r}]")
        return
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        # decoded as the raw value: it must be one of the enum's
        assert isinstance(value, hint) or value in {m.value for m in hint}, f"{where}: {value!r} not a {hint.__name__}"
        return
    if hint is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: {value!r} is not a number"
        return
    if isinstance(hint, type) and hint.__module__.startswith("grafana_foundation_sdk"):
        if typing.Protocol in getattr(hint, "__mro__", ()) or hint.__name__ == "Dataquery" and \
                hint.__module__.endswith("variants"):
            assert hasattr(value, "to_json"), f"{where}: {value!r} is not a model"
        elif isinstance(value, dict) and hasattr(hint, "from_json"):  # a field the SDK leaves undecoded
            decoded = hint.from_json(value)
            assert decoded.to_json() == value, f"{where}: keys a {hint.__name__} does not have: {value}"
            value = decoded
        else:
            assert isinstance(value, hint), f"{where}: {type(value).__name__} is not a {hint.__name__}"
        _model(value, where)
        return
    if isinstance(hint, type):
        assert isinstance(value, hint), f"{where}: {value!r} is not a {hint.__name__}"


def _model(obj: object, where: str) -> None:
    """Every field the model's class declares holds a value of the declared type."""
    for attribute, hint in typing.get_type_hints(type(obj)).items():
        _conforms(getattr(obj, attribute), hint, f"{where}.{attribute}")


def test_every_dashboard_is_a_grafana_dashboard_by_the_foundation_sdks_types():
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel
    from grafana_foundation_sdk.models.prometheus import Dataquery

    register_default_plugins()  # panel options and queries decode into their plugins' types
    for name, data in _committed().items():
        board = Dashboard.from_json(data)
        assert json.loads(json.dumps(board, cls=JSONEncoder)) == data, f"{name}: keys the model does not know"
        _model(board, name)
        panels = [p for p in board.panels or [] if isinstance(p, Panel)]
        assert len(panels) >= 4 and all(isinstance(p, (Panel, RowPanel)) for p in board.panels)
        for panel in panels:
            assert panel.targets and all(isinstance(t, Dataquery) for t in panel.targets), (name, panel.title)
            assert panel.datasource.uid == "prometheus"


def test_every_latency_panel_asks_for_exemplars_and_links_to_tempo():
    latency = [(name, p) for name, board in _committed().items() for p in board["panels"]
               if p.get("fieldConfig", {}).get("defaults", {}).get("unit") == "s"]
    assert {name for name, _ in latency} >= {"create-path", "layers"}
    for name, panel in latency:
        assert all(t["exemplar"] for t in panel["targets"]), (name, panel["title"])
        assert any('"datasource":"tempo"' in link["url"] for link in panel["links"]), (name, panel["title"])


def test_every_query_uses_only_metrics_the_platform_declares():
    declared = {i.name for i in metrics.INSTRUMENTS} | {"up"}
    suffixes = ("_bucket", "_count", "_sum")
    for name, panel, expr in _queries():
        used = {word for word in _metric_names(expr)}
        unknown = {m for m in used if m not in declared and not any(m.removesuffix(s) in declared for s in suffixes)}
        assert not unknown, (name, panel, unknown)


def _metric_names(expr: str) -> set[str]:
    import re

    return {m for m in re.findall(r"\b(sandfleet_[a-z_]+|up)\b", expr)}


def test_without_a_collector_the_bus_hops_are_timed_and_trace_context_still_passes_through():
    """A service whose spans go nowhere times its bus hops with `BusHopTracer` (no tracing SDK):
    the same series as the SDK path, and the caller's traceparent reaches the next hop unchanged."""
    import prometheus_client
    from opentelemetry.trace import SpanKind, Status, StatusCode

    from sandfleet import telemetry

    registry = prometheus_client.CollectorRegistry()
    for instrument in (metrics.BUS_REQUESTS, metrics.ERRORS):
        instrument.bind(registry)
    try:
        tracer = metrics.BusHopTracer()
        incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        with tracer.start_as_current_span("node.v1.n1.exec", context=telemetry.extract({"traceparent": incoming}),
                                          kind=SpanKind.SERVER, attributes={telemetry.SUBJECT: "node.v1.n1.exec"}) as hop:
            with tracer.start_as_current_span("launcher.spawn"):  # a phase: nothing recorded, context passes
                with tracer.start_as_current_span("send node.v1.n1.confine", kind=SpanKind.CLIENT) as call:
                    call.set_attribute(telemetry.SUBJECT, "node.v1.n1.confine")
                    assert telemetry.inject()["traceparent"] == incoming
            hop.set_status(Status(StatusCode.ERROR, "no such sandbox"))
            hop.set_attribute(telemetry.ERROR_CODE, "not_found")
        value = registry.get_sample_value
        assert value("sandfleet_bus_request_seconds_count", {"family": "node.v1.*.exec", "side": "server"}) == 1
        assert value("sandfleet_bus_request_seconds_count", {"family": "node.v1.*.confine", "side": "client"}) == 1
        assert value("sandfleet_errors_total", {"code": "not_found"}) == 1
    finally:
        for instrument in (metrics.BUS_REQUESTS, metrics.ERRORS):
            instrument.unbind()


# -- against a real Prometheus scraping a real platform -----------------------------------


@pytest.fixture(scope="module")
def pm_platform(leak_check, otlp, tmp_path_factory):
    require(shutil.which("prometheus") is not None, "Debian's prometheus (make install)")
    env = {"SANDFLEET_PROMETHEUS": "0", "SANDFLEET_PROMETHEUS_SCRAPE_S": "1"}
    p = start_platform(tmp_path_factory.mktemp("metrics"), PM_NODE, otlp, env=env)
    yield p
    stop_platform(p)
    assert_nothing_left(leak_check, p.data_dir, [PM_NODE])


def _prometheus(p) -> str:
    url = p.state()["prometheus"]
    assert url, "the supervisor runs no Prometheus"
    return url


def _api(base: str, path: str, **params: str) -> dict:
    with urllib.request.urlopen(f"{base}{path}?{urllib.parse.urlencode(params)}", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def _query(base: str, expr: str) -> list[dict]:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return _api(base, "/api/v1/query", query=expr)["result"]


async def _until(check, what: str, deadline_s: float = 60.0):
    """`check()`'s first truthy answer; a deadline a loaded machine meets, not a latency figure."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = await asyncio.to_thread(check)
        if found or time.monotonic() > deadline:
            assert found, what
            return found
        await asyncio.sleep(0.5)


async def _has_spare(fleet, key: str) -> bool:
    return any(info.warm.get(key) for info in await fleet.nodes())


async def _until_async(check, what: str, deadline_s: float = 60.0):
    deadline = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
async def workload(pm_platform, tmp_path_factory):
    """What an operator's dashboards should show after a few minutes of a real fleet."""
    require(os.geteuid() == 0, "sandboxes need root")
    require(BUSYBOX.exists(), "busybox-static at /bin/busybox")
    async with sandfleet.connect(pm_platform.url) as fleet:
        layers = Layers(fleet.bus)
        src = tmp_path_factory.mktemp("pm-layer")
        make_busybox_base(src / "base")
        await layers.build_dir("pm-base", src / "base")
        await layers.cache_drop(pm_platform.node_id)  # built here, it is cached: the next create fetches it
        on_layers = [await fleet.create(memory_mb=64, layers=["pm-base"]) for _ in range(2)]
        on_host = await asyncio.gather(*(fleet.create(memory_mb=64, host_view=True) for _ in range(3)))
        for sb in [*on_layers, *on_host]:
            assert (await sb.exec(["true"] if sb in on_host else ["/bin/sh", "-c", "cat /etc/hostname"])).exit_code == 0
        with pytest.raises(errors.NotFound):
            await fleet.get("sb-000000000000")
        pooled = dict(memory_mb=72, host_view=True)  # a shape of its own: a warm pool, one spare, one claim
        key = (await fleet.set_pool(size=1, **pooled)).key
        await _until_async(lambda: _has_spare(fleet, key), "a warm spare")
        on_host.append(await fleet.create(**pooled))
        await fleet.clear_pool(**pooled)
        await fleet.set_policy(task="pm-cheat", action="kill", thresholds={"network": 1})
        cheat = await fleet.create(memory_mb=64, labels={"task": "pm-cheat"}, host_view=True)
        with contextlib.suppress(errors.SandboxEnded):  # the policy may kill it while the command runs
            await cheat.exec(["python3", "-c", CONNECT], timeout_s=10)
        deadline = time.monotonic() + EVENT_DEADLINE_S
        while (await fleet.security_record(cheat.id)).action_state != "done" and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert (await fleet.security_record(cheat.id)).action_state == "done"
        yield fleet
        for sb in [*on_layers, *on_host]:
            await sb.destroy()


async def test_prometheus_scrapes_every_service_of_the_platform(pm_platform, workload):
    base = _prometheus(pm_platform)
    want = {"placement", "agent", "layer-cache", "reclaimer", "launcher", "security-monitor"}

    def up() -> set[str]:
        return {r["metric"]["service"] for r in _query(base, 'up{job="sandfleet"} == 1')}

    await _until(lambda: want <= up(), f"services scraped: {up()}")
    nodes = {r["metric"].get("node") for r in _query(base, "sandfleet_node_capacity_sandboxes")}
    assert nodes == {PM_NODE}
    conf = pm_platform.data_dir / "prometheus" / "prometheus.yml"
    subprocess.run(["promtool", "check", "config", str(conf)], check=True, capture_output=True)


async def test_the_workload_is_counted_where_it_happened(pm_platform, workload):
    base = _prometheus(pm_platform)

    def value(expr: str) -> float:
        result = _query(base, expr)
        return sum(float(r["value"][1]) for r in result)

    expected = {
        'sum(sandfleet_create_seconds_count{outcome="ok", isolation="process"})': 6,
        'sum(sandfleet_launch_seconds_count{outcome="ok"})': 6,
        'sum(sandfleet_violations_total{kind="network.connect"})': 1,
        'sum(sandfleet_policy_actions_total{action="kill", outcome="done"})': 1,
        'sum(sandfleet_errors_total{code="not_found"})': 1,
        'sum(sandfleet_warm_claims_total{result="taken"})': 1,
        'sum(sandfleet_layer_cache_lookups_total{result="miss"})': 1,
        'sum(sandfleet_layer_cache_lookups_total{result="hit"})': 1,
        'sum(sandfleet_layer_cache_bytes{kind="fetched"})': 1,
        'sum(sandfleet_bus_request_seconds_count{family="node.v1.*.exec", side="server"})': 6,
    }
    for expr, at_least in expected.items():
        await _until(lambda: value(expr) >= at_least, f"{expr} = {value(expr)}, wanted >= {at_least}")
    # Per node, never per sandbox: one running series for the node however many sandboxes run.
    assert len(_query(base, "sandfleet_node_running_sandboxes")) == 1
    assert not [r for r in _query(base, '{__name__=~"sandfleet_.*"}') if any(
        v.startswith("sb-") for v in r["metric"].values())]


async def test_latency_histograms_carry_their_traces_as_exemplars(pm_platform, workload):
    base = _prometheus(pm_platform)
    now = time.time()

    def exemplars() -> list[dict]:
        data = _api(base, "/api/v1/query_exemplars", query="sandfleet_create_seconds_bucket",
                    start=str(now - 600), end=str(time.time()))
        return [e for series in data for e in series["exemplars"]]

    found = await _until(exemplars, "no exemplar on sandfleet_create_seconds")
    assert all(len(e["labels"]["trace_id"]) == 32 for e in found)


async def test_every_query_of_every_dashboard_returns_data(pm_platform, workload):
    base = _prometheus(pm_platform)
    queries = _queries()
    assert len(queries) >= 25
    for name, panel, expr in queries:
        if panel.startswith("$"):  # a variable: label_values() is Grafana's, the series it reads must exist
            expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
        await _until(lambda: _query(base, expr), f"{name} / {panel}: no data for {expr}")

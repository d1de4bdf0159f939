"""The platform's Grafana dashboards as code (Grafana's foundation SDK), and the JSON they make.

`python infra/observability/dashboards.py` writes one JSON file per dashboard into
`grafana/dashboards/`, which Grafana's provisioning (grafana/provisioning/dashboards/) loads;
the files are committed, and tests/test_metrics.py checks that regenerating gives the same
bytes, that the JSON decodes into the SDK's typed dashboard model, and that every query of
every panel returns data from a real Prometheus scraping a real platform.

Queries use only the metrics `sandfleet/metrics.py` declares and the `service`/`node` labels
the scrape targets carry. Latency panels ask for exemplars (the trace ids the histograms keep)
and link to Tempo, so a slow bucket opens the traces behind it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from sandfleet import metrics
from schemas import layers as layers_schema
from schemas import node as node_schema

HERE = Path(__file__).resolve().parent
OUT = HERE / "grafana" / "dashboards"
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="prometheus")  # as provisioned (datasources/)
TEMPO_UID = "tempo"
NODE = 'node=~"$node"'
RATE = "$__rate_interval"



def _family(verb: str) -> str:
    """A node subject's family as sandfleet.metrics names it on the series (`node.v1.*.<verb>`)."""
    return metrics.subject_family(node_schema.subject("*", verb))


CONFINE_FAMILY = _family(node_schema.CONFINE)
COMPOSE_FAMILY = _family(layers_schema.ROOTFS_COMPOSE)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


def _target(query: Query, ref: str, exemplar: bool) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(query.expr).ref_id(ref).range()
    if query.legend:
        target = target.legend_format(query.legend)
    return target.exemplar(exemplar)


def _traces_link() -> dashboard.DashboardLink:
    """Tempo's search for the platform's traces, in Explore (exemplar points open one trace)."""
    left = json.dumps({"datasource": TEMPO_UID, "queries": [{"refId": "A", "queryType": "traceqlSearch",
                                                            "query": '{resource.service.name=~".+"}'}],
                       "range": {"from": "${__from}", "to": "${__to}"}}, separators=(",", ":"))
    return dashboard.DashboardLink("Traces in Tempo").url(f"/explore?left={left}").target_blank(True)


def series(title: str, unit: str, *queries: Query, latency: bool = False, width: int = 12,
           description: str = "") -> timeseries.Panel:
    legend = (common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
              .placement(common.LegendPlacement.BOTTOM).show_legend(True))
    tooltip = common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
    panel = (timeseries.Panel().title(title).unit(unit).datasource(PROMETHEUS).span(width).height(8)
             .legend(legend).tooltip(tooltip).line_width(1).fill_opacity(10).show_points(common.VisibilityMode.NEVER))
    if description:
        panel = panel.description(description)
    for i, query in enumerate(queries):
        panel = panel.with_target(_target(query, chr(ord("A") + i), exemplar=latency))
    if latency:
        panel = panel.links([_traces_link()])
    return panel


def single(title: str, unit: str, query: Query, width: int = 6) -> stat.Panel:
    last = common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
    return (stat.Panel().title(title).unit(unit).datasource(PROMETHEUS).span(width).height(4)
            .graph_mode(common.BigValueGraphMode.AREA).reduce_options(last)
            .with_target(_target(query, "A", exemplar=False)))


def quantiles(metric: str, by: str, selector: str = "") -> list[Query]:
    inner = f"sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}]))"
    return [Query(f"histogram_quantile({q}, {inner})", f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.9, 0.99)]


def _board(uid: str, title: str, description: str) -> dashboard.Dashboard:
    node = (dashboard.QueryVariable("node").label("node").datasource(PROMETHEUS)
            .query("label_values(sandfleet_node_running_sandboxes, node)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*"))
    return (dashboard.Dashboard(title).uid(uid).description(description).tags(["sandfleet"])
            .time("now-1h", "now").refresh("30s").timezone("browser").with_variable(node))


def fleet() -> dashboard.Dashboard:
    return (_board("sandfleet-fleet", "sandfleet: fleet overview", "Nodes, sandboxes, creations and errors")
            .with_row(dashboard.Row("Now"))
            .with_panel(single("Running sandboxes", "short", Query(f"sum(sandfleet_node_running_sandboxes{{{NODE}}})")))
            .with_panel(single("Capacity used", "percentunit",
                               Query(f"sum(sandfleet_node_running_sandboxes{{{NODE}}}) / "
                                     f"sum(sandfleet_node_capacity_sandboxes{{{NODE}}})")))
            .with_panel(single("Services up", "short", Query('sum(up{job="sandfleet"})')))
            .with_panel(single("Launch queue", "short", Query(f"sum(sandfleet_launch_queue_depth{{{NODE}}})")))
            .with_row(dashboard.Row("Over time"))
            .with_panel(series("Running and capacity per node", "short",
                               Query(f"sum by (node) (sandfleet_node_running_sandboxes{{{NODE}}})", "running {{node}}"),
                               Query(f"sum by (node) (sandfleet_node_capacity_sandboxes{{{NODE}}})",
                                     "capacity {{node}}")))
            .with_panel(series("Creations by isolation and outcome", "ops",
                               Query(f"sum by (isolation, outcome) (rate(sandfleet_create_seconds_count[{RATE}]))",
                                     "{{isolation}} {{outcome}}")))
            .with_panel(series("Launch queue depth per node", "short",
                               Query(f"sum by (node) (sandfleet_launch_queue_depth{{{NODE}}})", "{{node}}")))
            .with_panel(series("Warm-pool spares and claims", "short",
                               Query(f"sum by (node) (sandfleet_node_warm_spares{{{NODE}}})", "spares {{node}}"),
                               Query(f"sum by (result) (rate(sandfleet_warm_claims_total[{RATE}]))",
                                     "claims {{result}} /s")))
            .with_panel(series("Errors by code", "ops",
                               Query(f"sum by (code, service) (rate(sandfleet_errors_total[{RATE}]))",
                                     "{{service}} {{code}}"))))


def create_path() -> dashboard.Dashboard:
    return (_board("sandfleet-create-path", "sandfleet: create path latency",
                   "From a create request to a running sandbox, hop by hop; exemplars open the trace")
            .with_panel(series("Create latency (placement, request to running)", "s",
                               *quantiles("sandfleet_create_seconds", "isolation"), latency=True, width=24))
            .with_panel(series("Launch latency on the node (queue, confine, root, start)", "s",
                               *quantiles("sandfleet_launch_seconds", "node", NODE), latency=True))
            .with_panel(series("Confine (node agent) and root compose (layer-cache)", "s",
                               *(Query(f"histogram_quantile(0.9, sum by (le, family) (rate("
                                       f'sandfleet_bus_request_seconds_bucket{{side="server", family="{f}"}}[{RATE}])))',
                                       "p90 {{family}}") for f in (CONFINE_FAMILY, COMPOSE_FAMILY)),
                               latency=True))
            .with_panel(series("Bus round trips by subject family (p99, callers' side)", "s",
                               Query(f"histogram_quantile(0.99, sum by (le, family) (rate("
                                     f'sandfleet_bus_request_seconds_bucket{{side="client"}}[{RATE}])))', "{{family}}"),
                               latency=True))
            .with_panel(series("Bus requests handled by subject family", "reqps",
                               Query(f"sum by (family) (rate(sandfleet_bus_request_seconds_count"
                                     f'{{side="server"}}[{RATE}]))', "{{family}}"))))


def security() -> dashboard.Dashboard:
    return (_board("sandfleet-security", "sandfleet: security", "Violations the nodes saw and what policy did")
            .with_panel(series("Violations by kind", "ops",
                               Query(f"sum by (kind) (rate(sandfleet_violations_total{{{NODE}}}[{RATE}]))", "{{kind}}")))
            .with_panel(series("Violations by node", "ops",
                               Query(f"sum by (node) (rate(sandfleet_violations_total{{{NODE}}}[{RATE}]))", "{{node}}")))
            .with_panel(series("Policy actions by action and outcome", "short",
                               Query("sum by (action, outcome) (increase(sandfleet_policy_actions_total[$__range]))",
                                     "{{action}} {{outcome}}")))
            .with_panel(series("Refused requests (invalid, not found, conflict)", "ops",
                               Query(f"sum by (code) (rate(sandfleet_errors_total[{RATE}]))", "{{code}}"))))


def memory() -> dashboard.Dashboard:
    return (_board("sandfleet-memory", "sandfleet: memory and reclaim", "Sandbox memory and what the reclaimer took back")
            .with_panel(series("Sandbox memory per node", "bytes",
                               Query(f"sum by (node) (sandfleet_node_sandbox_memory_bytes{{{NODE}}})", "{{node}}")))
            .with_panel(series("Shared by KSM and paged out to zram", "bytes",
                               Query(f"sum by (node) (sandfleet_node_merged_bytes{{{NODE}}})", "merged {{node}}"),
                               Query(f"sum by (node) (sandfleet_node_swapped_bytes{{{NODE}}})", "swapped {{node}}")))
            .with_panel(series("Reclaimed bytes by action", "Bps",
                               Query(f"sum by (action) (rate(sandfleet_reclaimed_bytes_total{{{NODE}}}[{RATE}]))",
                                     "{{action}}")))
            .with_panel(series("Reclaim actions by action", "ops",
                               Query(f"sum by (action) (rate(sandfleet_reclaim_actions_total{{{NODE}}}[{RATE}]))",
                                     "{{action}}"))))


def layers() -> dashboard.Dashboard:
    lookups = f"sandfleet_layer_cache_lookups_total{{{NODE}}}"
    return (_board("sandfleet-layers", "sandfleet: layers", "The nodes' image caches and what they fetch")
            .with_panel(series("Cache lookups by result", "ops",
                               Query(f"sum by (result) (rate({lookups}[{RATE}]))", "{{result}}")))
            .with_panel(series("Hit ratio", "percentunit",
                               Query(f'sum(increase(sandfleet_layer_cache_lookups_total{{{NODE}, result="hit"}}'
                                     f"[$__range])) / sum(increase({lookups}[$__range]))", "hits")))
            .with_panel(series("Bytes fetched from the store", "bytes",
                               Query(f'sum by (node) (sandfleet_layer_cache_bytes{{{NODE}, kind="fetched"}})',
                                     "{{node}} (lazy and whole)"),
                               Query(f"sum by (node) (increase(sandfleet_layer_fetched_bytes_total{{{NODE}}}"
                                     "[$__range]))", "{{node}} whole images")))
            .with_panel(series("Cache on disk", "bytes",
                               Query(f'sum by (node) (sandfleet_layer_cache_bytes{{{NODE}, kind="disk"}})', "{{node}}")))
            .with_panel(series("Root compose latency", "s", *quantiles(
                "sandfleet_bus_request_seconds", "family", f'side="server", family="{COMPOSE_FAMILY}"'),
                latency=True)))


DASHBOARDS = {"fleet": fleet, "create-path": create_path, "security": security, "memory": memory, "layers": layers}


def render(name: str) -> str:
    built = DASHBOARDS[name]().build()
    return json.dumps(built, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def write(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DASHBOARDS:
        path = out / f"{name}.json"
        path.write_text(render(name))
        written.append(path)
    return written


if __name__ == "__main__":
    for written in write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(written)

"""A Grafana dashboard over the Prometheus exporter's metrics (moescope/prometheus/exporter.py).

    moescope grafana > moescope-dashboard.json          # import it in Grafana
    moescope grafana --provision grafana/               # dashboard + provisioning files for a Grafana server

The panels are declared once in `PANELS` (title, unit, PromQL with its legend) and built into the
dashboard with Grafana's own SDK (`grafana-foundation-sdk`, a dependency on Python 3.11+). Every query names
only metrics and labels the exporter serves; tests/integration/prometheus/test_grafana.py runs each one against a
real Prometheus scraping a probed run. Some panels need the run to record more than the default:
compute time (`compute_time=True` at attach), the cache hit rate (`PrometheusExporter(cache_capacity=C)`
and `routes=True`), the routing drift rate (`routes=True`), drift from the baseline (the
exporter's first `baseline_steps` forwards, or `set_baseline`) and the rank panels
(`PrometheusExporter(placement=...)`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATASOURCE_VARIABLE = "datasource"
DASHBOARD_UID = "moescope-routing"
RATE = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    max: float | None = None


PER_LAYER = "layer {{layer}}"
EXPERT = "layer {{layer}} expert {{expert}}"
TOP_SERIES = 8  # experts drawn in the hottest / coldest panels, over all layers

PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Load spread", "Coefficient of variation of tokens per expert over the exporter's window; "
              "0 is perfectly balanced.", "none",
              (Query("moescope_layer_load_cv", PER_LAYER),)),
    PanelSpec("Hottest expert (max / mean load)", "The busiest expert's tokens over the mean (MaxVio + 1).",
              "none", (Query("moescope_layer_load_max_over_mean", PER_LAYER),)),
    PanelSpec("Hottest experts", f"The {TOP_SERIES} experts with the largest share of their layer's slots over the "
              "exporter's window, over all layers (1/E is an even share). Each layer serves its hot_cold_experts "
              "hottest and coldest experts.", "percentunit",
              (Query(f"topk({TOP_SERIES}, moescope_expert_load_ratio)", EXPERT),), max=1),
    PanelSpec("Coldest experts", f"The {TOP_SERIES} experts with the smallest share of their layer's slots over the "
              "window, over all layers; 0 is a dead expert.", "percentunit",
              (Query(f"bottomk({TOP_SERIES}, moescope_expert_load_ratio)", EXPERT),), max=1),
    PanelSpec("Dead experts", "Routed experts with no token over the window, per layer.", "short",
              (Query("moescope_layer_dead_experts", PER_LAYER),)),
    PanelSpec("Load fairness (Jain's index)", "(sum x)^2 / (n sum x^2) over tokens per expert: 1 is even, k/n "
              "when k of n experts share the load evenly.", "percentunit",
              (Query("moescope_layer_load_fairness_ratio", PER_LAYER),), max=1),
    PanelSpec("Rank balancedness", "Mean / max slots per expert-parallel rank under the exporter's placement "
              "(vLLM's balancedness; TensorRT-LLM's imbalance is 1 / it - 1), per layer and its worst layer; "
              "needs PrometheusExporter(placement=...).", "percentunit",
              (Query("moescope_layer_rank_balancedness_ratio", PER_LAYER),
               Query("min(moescope_layer_rank_balancedness_ratio)", "worst layer")), max=1),
    PanelSpec("Hottest rank's share", "The share of each layer's slots its hottest rank serves (1/R is even; "
              "the rank's id is moescope_layer_hottest_rank).", "percentunit",
              (Query("moescope_layer_hottest_rank_load_ratio", PER_LAYER),), max=1),
    PanelSpec("Router entropy (H / ln E)", "Mean per-token router entropy, normalised by ln(experts): "
              "1 is uniform routing, near 0 a collapsed router.", "percentunit",
              (Query("moescope_layer_router_entropy_ratio", PER_LAYER),), max=1),
    PanelSpec("Dropped tokens", "Tokens no expert processed (capacity) / tokens, over the window.",
              "percentunit", (Query("moescope_layer_dropped_token_ratio", PER_LAYER),)),
    PanelSpec("Dropped tokens per second", "Rate of tokens no expert processed.", "short",
              (Query(f"rate(moescope_layer_dropped_tokens_total[{RATE}])", PER_LAYER),)),
    PanelSpec("Active parameters per token", "Parameters a token uses / all parameters: the model and each "
              "layer's routed experts.", "percentunit",
              (Query("moescope_active_param_ratio", "model"), Query("moescope_layer_active_param_ratio", PER_LAYER))),
    PanelSpec("Drift from baseline (KL)", "KL divergence (nats) of the window's expert load from the "
              "baseline load.", "none", (Query("moescope_layer_load_kl_baseline_nats", PER_LAYER),)),
    PanelSpec("Routing drift rate", "Top-1 expert changes per 1000 adjacent token pairs (needs routes=True).",
              "none", (Query("moescope_layer_routing_drift_per_1000_pairs", PER_LAYER),)),
    PanelSpec("MoE block compute time", "Seconds per forward in each MoE block (compute_time=True): the mean "
              "and the 95th percentile of the windows' per-forward means.", "s",
              (Query(f"rate(moescope_layer_compute_seconds_sum[{RATE}])"
                     f" / rate(moescope_layer_compute_seconds_count[{RATE}])", "mean, " + PER_LAYER),
               Query("histogram_quantile(0.95, sum by (layer, le) "
                     f"(rate(moescope_layer_compute_seconds_bucket[{RATE}])))", "p95, " + PER_LAYER))),
    PanelSpec("Expert cache hit rate", "Share of expert accesses already resident with the exporter's "
              "cache_capacity experts per layer, by policy (needs routes=True).", "percentunit",
              (Query("moescope_layer_expert_cache_hit_ratio", "layer {{layer}} {{policy}}"),), max=1),
    PanelSpec("Forwards per second", "Forward passes the probe recorded.", "short",
              (Query(f"rate(moescope_steps_total[{RATE}])", "forwards/s"),)),
    PanelSpec("Probe rows dropped", "Rows the probe could not keep, per table and reason (a full ring or "
              "queue); 0 in a healthy run.", "short",
              (Query(f"sum by (table, reason) (rate(moescope_probe_records_dropped_total[{RATE}]))",
                     "{{table}}: {{reason}}"),
               Query(f"sum by (table) (rate(moescope_probe_records_written_total[{RATE}]))", "{{table}} written"))),
)


def dashboard_json(title: str = "moescope: MoE routing") -> dict:
    """The dashboard as Grafana's JSON model (a dict), built with grafana-foundation-sdk.

    Raises RuntimeError, saying what to install, when the SDK is missing.
    """
    try:
        from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models.common import (
            LegendDisplayMode,
            LegendPlacement,
            SortOrder,
            TooltipDisplayMode,
        )
        from grafana_foundation_sdk.models.dashboard import DataSourceRef
    except ImportError as e:
        raise RuntimeError("the Grafana dashboard is built with grafana-foundation-sdk, which needs Python 3.11 "
                           "or later: pip install grafana-foundation-sdk") from e
    source = DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE_VARIABLE + "}")
    board = (dashboard.Dashboard(title).uid(DASHBOARD_UID).tags(["moescope", "moe"]).refresh("10s")
             .time("now-30m", "now").description("Routing health of Mixture-of-Experts layers, from the "
                                                "moescope probe's Prometheus exporter.")
             .with_variable(dashboard.DatasourceVariable(DATASOURCE_VARIABLE).label("Prometheus")
                            .type("prometheus")))
    for spec in PANELS:
        panel = (timeseries.Panel().title(spec.title).description(spec.description).unit(spec.unit)
                 .datasource(source).height(8).span(12).min(0)
                 .legend(common.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                         .placement(LegendPlacement.BOTTOM))
                 .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
        if spec.max is not None:
            panel = panel.max(spec.max)
        for ref, query in zip("ABCDEFGH", spec.queries):
            panel = panel.with_target(prometheus.Dataquery().expr(query.expr).legend_format(query.legend)
                                      .ref_id(ref).datasource(source))
        board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def panel_queries(model: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of a dashboard JSON model, in panel order."""
    return [(panel.get("title", ""), target["expr"]) for panel in model.get("panels", [])
            for target in panel.get("targets", []) if target.get("expr")]


def provisioning(folder: Path, prometheus_url: str) -> list[Path]:
    """Write a dashboard and Grafana provisioning files under `folder`; returns the paths written.

    folder/dashboards/moescope.json, folder/provisioning/dashboards/moescope.yaml (a file provider
    reading folder/dashboards) and folder/provisioning/datasources/moescope.yaml (a Prometheus data
    source at `prometheus_url`). Point Grafana's `paths.provisioning` at folder/provisioning.
    """
    import yaml

    folder = Path(folder)
    boards = folder / "dashboards"
    for path in (boards, folder / "provisioning" / "dashboards", folder / "provisioning" / "datasources"):
        path.mkdir(parents=True, exist_ok=True)
    board = boards / "moescope.json"
    board.write_text(json.dumps(dashboard_json(), indent=2) + "\n")
    provider = folder / "provisioning" / "dashboards" / "moescope.yaml"
    provider.write_text(yaml.safe_dump({"apiVersion": 1, "providers": [{
        "name": "moescope", "type": "file", "folder": "moescope", "disableDeletion": False,
        "updateIntervalSeconds": 30, "options": {"path": str(boards.resolve())}}]}, sort_keys=False))
    source = folder / "provisioning" / "datasources" / "moescope.yaml"
    source.write_text(yaml.safe_dump({"apiVersion": 1, "datasources": [{
        "name": "Prometheus (moescope)", "type": "prometheus", "access": "proxy", "url": prometheus_url,
        "isDefault": False}]}, sort_keys=False))
    return [board, provider, source]

"""Live metrics: the Prometheus exporter, its alerting rules and the Grafana board.

`PrometheusExporter` serves per-layer routing health on `/metrics` from the records as they pass
(bounded series: per layer, and the K hottest and coldest experts); `prometheus_rules_yaml` writes a
rule pack as a Prometheus alerting-rules file over its metrics; `dashboard_json` and `provisioning`
build the Grafana board (`moescope grafana`). The names below are imported on first use, so the board's
command does not load the exporter and prometheus_client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core.lazy import lazy_exports

# name -> the module that defines it
_EXPORTS = {
    "PrometheusExporter": "moescope.prometheus.exporter",
    "SIGNAL_METRICS": "moescope.prometheus.exporter",
    "dashboard_json": "moescope.prometheus.grafana",
    "provisioning": "moescope.prometheus.grafana",
    "prometheus_rules": "moescope.prometheus.rules",
    "prometheus_rules_yaml": "moescope.prometheus.rules",
}

__all__ = ["SIGNAL_METRICS", "PrometheusExporter", "dashboard_json", "prometheus_rules", "prometheus_rules_yaml",
           "provisioning"]

if TYPE_CHECKING:
    from moescope.prometheus.exporter import SIGNAL_METRICS, PrometheusExporter
    from moescope.prometheus.grafana import dashboard_json, provisioning
    from moescope.prometheus.rules import prometheus_rules, prometheus_rules_yaml
else:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

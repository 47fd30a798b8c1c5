"""The Prometheus exporter's values, names and cardinality, and the generated rules file."""

from __future__ import annotations

import glob
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from prometheus_client import CollectorRegistry

import moescope
from moescope.alerts.rules import RulesError, default_rules, parse_rules
from moescope.metrics import signals as sig
from moescope.prometheus.exporter import PrometheusExporter
from moescope.prometheus.rules import prom_duration, prometheus_rules, prometheus_rules_yaml
from tests.support.alert_records import BALANCED, EXPERTS, SKEWED, layer_step, step_record
from tests.support.fixtures.servers import promtool


def feed(exporter, loads, layers=(0, 1), **kw):
    exporter.export([step_record(s, [layer_step(layer, load, **kw) for layer in layers])
                     for s, load in enumerate(loads)])


def test_per_layer_values_match_the_signals():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=4, baseline_steps=2)
    feed(exporter, [BALANCED] * 2 + [SKEWED] * 4, dropped=2, capacity_use=0.5)
    def get(name, layer=0):
        return registry.get_sample_value(name, {"layer": str(layer)})

    window = np.array(SKEWED) * 4
    baseline = np.array(BALANCED) * 2
    assert get("moescope_layer_load_max_over_mean") == pytest.approx(sig.max_mean_ratio(window))
    assert get("moescope_layer_load_cv") == pytest.approx(sig.coefficient_of_variation(window))
    assert get("moescope_layer_load_kl_uniform_nats") == pytest.approx(sig.kl_divergence(window, np.ones(EXPERTS)))
    assert get("moescope_layer_load_kl_baseline_nats") == pytest.approx(sig.kl_divergence(window, baseline))
    # the window's latest half: its last 2 of 4 forwards
    assert get("moescope_layer_load_kl_baseline_latest_half_nats") == pytest.approx(
        sig.kl_divergence(np.array(SKEWED) * 2, baseline))
    assert get("moescope_layer_router_entropy_ratio") == pytest.approx(1.5 / np.log(EXPERTS))
    assert get("moescope_layer_tokens_total") == 6 * 128
    assert get("moescope_layer_dropped_tokens_total") == 12
    assert get("moescope_layer_dropped_token_ratio") == pytest.approx(8 / 512)
    assert get("moescope_layer_capacity_use_ratio") == 0.5
    assert get("moescope_layer_active_param_ratio") == pytest.approx(2000 / 100_000)
    assert get("moescope_layer_dead_expert_ratio") == 0.0
    assert registry.get_sample_value("moescope_steps_total") == 6
    assert registry.get_sample_value("moescope_layer_routing_drift_per_1000_pairs", {"layer": "0"}) is None  # no routes
    assert get("moescope_layer_dead_experts") == 0
    jain = window.sum() ** 2 / (EXPERTS * (window ** 2).sum())  # Jain's index, written out
    assert get("moescope_layer_load_fairness_ratio") == pytest.approx(jain)
    assert get("moescope_layer_rank_balancedness_ratio") is None  # no placement given


def test_probe_health_counters_and_bounded_reasons():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry)
    dropped = {("routes", f"reason{i}"): 1 for i in range(30)}
    exporter.observe_probe_stats({"steps": 10, "layer_steps": 20}, {"steps": 3})
    assert registry.get_sample_value("moescope_probe_records_written_total", {"table": "steps"}) == 10
    dropped_total = "moescope_probe_records_dropped_total"
    assert registry.get_sample_value(dropped_total, {"table": "steps", "reason": "unknown"}) == 3
    dropped["steps"] = 3  # the 31st pair, over the cap: summed as "other"
    exporter.observe_probe_stats({"steps": 10}, dropped)
    samples = [s for m in registry.collect() if m.name == "moescope_probe_records_dropped" for s in m.samples]
    assert len(samples) == 16 + 2  # the cap, plus one "other" per table
    assert registry.get_sample_value(dropped_total, {"table": "routes", "reason": "other"}) == 14
    assert registry.get_sample_value(dropped_total, {"table": "steps", "reason": "other"}) == 3


def test_names_follow_conventions_and_new_run_starts_over():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry)
    feed(exporter, [SKEWED] * 3, routes=True)
    names = {m.name for m in registry.collect()}
    assert all(n.startswith("moescope_") for n in names)
    counters = {m.name for m in registry.collect() if m.type == "counter"}
    assert all(s.name.endswith(("_total", "_created"))
               for m in registry.collect() if m.type == "counter" for s in m.samples)
    assert {"moescope_layer_tokens", "moescope_layer_dropped_tokens", "moescope_steps"} <= counters
    ratios = [s.value for m in registry.collect() if m.name.endswith("_ratio") for s in m.samples]
    assert ratios and all(0 <= v <= 1 for v in ratios)  # a _ratio is a share in 0-1
    assert registry.get_sample_value("moescope_layer_routing_drift_per_1000_pairs", {"layer": "0"}) > 0
    assert registry.get_sample_value("moescope_run_info", {"run_id": "run-a", "model_class": ""}) == 1
    exporter.export([step_record(0, [layer_step(0, BALANCED)], run_id="run-b")])
    assert registry.get_sample_value("moescope_layer_tokens_total", {"layer": "0"}) == 128
    assert registry.get_sample_value("moescope_layer_tokens_total", {"layer": "1"}) is None
    labels = {s.labels.get("layer") for m in registry.collect() for s in m.samples}
    assert labels <= {None, "0"}


def test_serves_metrics_on_localhost():
    exporter = PrometheusExporter(registry=CollectorRegistry())
    port = exporter.serve(port=0)
    try:
        feed(exporter, [SKEWED])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'moescope_layer_load_max_over_mean{layer="0"} 4.5' in text
    finally:
        exporter.shutdown()  # what a closing probe session calls: records stop, serving goes on
        exporter.shutdown()
    assert exporter.export([step_record(1, [layer_step(0, SKEWED)])]) is False
    exporter.close()
    exporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_generated_rules_match_the_default_pack_and_pass_promtool(tmp_path):
    pack = default_rules()
    doc = prometheus_rules(pack)
    by_name = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    assert set(by_name) == {r.name for r in pack.rules}
    assert by_name["ExpertLoadSkew"]["expr"] == (
        "moescope_layer_load_max_over_mean > 2.0 and moescope_layer_window_tokens >= 1024.0"
        " unless (moescope_layer_load_kl_baseline_nats > 0.1) unless (moescope_layer_lost_expert_alone_ratio > 0.0)"
        " unless (moescope_layer_load_kl_baseline_latest_half_nats > 0.1)")
    assert by_name["RoutingCooldown"]["expr"] == (
        "moescope_layer_router_entropy_ratio < 0.25 and moescope_layer_capacity_use_ratio > 0.95"
    )
    assert by_name["RankImbalance"]["expr"] == "moescope_layer_rank_balancedness_ratio < 0.8"
    assert by_name["LoadBiasedAgainstUniform"]["for"] == "300s"
    assert by_name["DeadExpert"]["labels"]["severity"] == "critical"
    assert by_name["ExpertLoadSkew"]["keep_firing_for"] == "300s"
    assert prom_duration(1.5) == "1500ms"
    path = tmp_path / "moescope.rules.yml"
    path.write_text(prometheus_rules_yaml(pack))
    assert yaml.safe_load(path.read_text()) == doc
    check = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                           check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(pack.rules)} rules found" in check.stdout


def test_rules_on_signals_without_a_metric_are_refused():
    pack = parse_rules("rules:\n  - name: X\n    expr: switch_entropy < 0.1\n")
    with pytest.raises(RulesError, match="switch_entropy.*no Prometheus metric"):
        prometheus_rules(pack)


def test_a_probe_session_feeds_its_own_write_and_drop_counts(tmp_path):
    import torch

    import moescope
    from moescope.core.exporters import InMemoryExporter
    from tests.support.zoo import tiny_model

    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry)
    memory = InMemoryExporter()
    model = tiny_model("mixtral")
    with moescope.attach(model, store=tmp_path, routes=True, exporters=[exporter, memory],
                      window=1) as session:
        with torch.no_grad():
            model(torch.randint(0, 128, (2, 4)))
            model(torch.randint(0, 128, (2, 4)))
        session.flush()
        written = lambda table: registry.get_sample_value("moescope_probe_records_written_total", {"table": table})  # noqa: E731
        assert written("steps") == 2 and written("layer_steps") == 2 * 2 and written("routes") == 2 * 2 * 8
    session.processor.emit(memory.records[0])  # too late: dropped, and counted with its reason
    closed = {"table": "routes", "reason": "closed"}
    assert registry.get_sample_value("moescope_probe_records_dropped_total", closed) == 16


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_a_scrape_after_the_session_block_answers_with_the_last_values_until_close(tmp_path):
    import torch

    from tests.support.zoo import tiny_model

    exporter = PrometheusExporter(registry=CollectorRegistry())
    port = exporter.serve(port=0)
    model = tiny_model("mixtral")
    try:
        with moescope.attach(model, store=tmp_path, exporters=[exporter], run_id="first"):
            with torch.no_grad():
                model(torch.randint(0, 128, (2, 4)))
                model(torch.randint(0, 128, (2, 4)))
        after = scrape(port)  # the attach example's `with` block is over: the endpoint still answers
        assert after['moescope_layer_tokens_total{layer="0"}'] == 2 * 2 * 4  # two forwards of 2 x 4 tokens
        step_rows = sum(pq.read_metadata(f).num_rows for f in glob.glob(f"{tmp_path}/steps/**/*.parquet",
                                                                         recursive=True))
        assert step_rows >= 1 and after['moescope_probe_records_written_total{table="steps"}'] == step_rows

        # the same exporter serves the next session of the process, starting over for its run
        with moescope.attach(model, store=tmp_path, exporters=[exporter], run_id="second"):
            with torch.no_grad():
                model(torch.randint(0, 128, (2, 4)))
        second = scrape(port)
        assert second['moescope_layer_tokens_total{layer="0"}'] == 2 * 4
        assert second['moescope_run_info{model_class="MixtralForCausalLM",run_id="second"}'] == 1
    finally:
        exporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_steps_counter_counts_forwards_of_windowed_records():
    import torch

    from moescope import probe
    from moescope.core.exporters import InMemoryExporter
    from tests.support.zoo import tiny_model

    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry)
    memory = InMemoryExporter()
    model = tiny_model("mixtral")
    with probe.attach(model, exporters=[exporter, memory], window=4, window_s=None), torch.no_grad():
        for _ in range(8):
            model(torch.randint(0, 128, (2, 4)))
    assert len(memory.records) == 2  # two windows of four forwards
    assert registry.get_sample_value("moescope_steps_total") == 8

"""`moescope demo --quick` end to end: both incidents, their alerts, and a store the dashboard can read.

The printed headline figures are recomputed here from the raw Parquet files with pyarrow and
numpy, not through the store's queries.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow.dataset as ds
import pytest
from sklearn.metrics import normalized_mutual_info_score

from store import Store


def _table(root, name):
    return ds.dataset(str(root / name), format="parquet", exclude_invalid_files=True).to_table().to_pandas()


def test_both_incidents_reached_the_webhook(demo):
    root, out, summary = demo
    received = Counter(summary["alerts_received"])
    assert received["firing:RoutingDriftFromBaseline"] >= 1
    assert received["firing:TrustGateChanged"] >= 1 and received["resolved:TrustGateChanged"] >= 1
    assert received["firing:ExpertUnhealthy"] >= 1
    assert "webhook <- [firing] RoutingDriftFromBaseline" in out
    assert "webhook <- [firing] TrustGateChanged" in out


def test_drift_fired_only_after_the_shift(demo):
    root, _, _ = demo
    alerts = _table(root, "alerts")
    steps = _table(root, "steps")
    phase = {int(s): dict(t)["phase"] for s, t in zip(steps.step, steps.tags) if "phase" in dict(t)}
    fired = alerts[(alerts.alertname == "RoutingDriftFromBaseline") & (alerts.state == "firing")]
    assert len(fired) >= 1
    assert {phase[int(s)] for s in fired.step} == {"shift"}


def test_the_corrupted_expert_was_masked_then_lifted(demo):
    root, _, summary = demo
    layer, expert = summary["corrupted"]["layer"], summary["corrupted"]["expert"]
    events = _table(root, "trust_gate_events").sort_values("ts")
    mine = events[(events.layer == layer) & (events.expert == expert)]
    assert mine.new_weight.tolist() == [0.0, 1.0]
    # no other expert was gated: the policy acted on the fault alone
    assert len(events) == 2
    # masked: finite and much closer to the clean model than the corrupted one was
    assert summary["masked_finite"] and summary["masked_error"] < min(0.5, summary["corrupt_error"] / 2)
    assert summary["recovered_error"] == 0.0
    health = _table(root, "expert_health")
    during = health[(health.layer == layer) & (health.expert == expert) & (health.step_start >= mine.step.iloc[0] - 8)
                    & (health.step_start < mine.step.iloc[0])]
    assert during.score.min() < 40


def test_headline_figures_recomputed_from_the_raw_files(demo):
    root, out, summary = demo
    steps = _table(root, "steps")
    layer_steps = _table(root, "layer_steps")
    layers = _table(root, "layers")
    runs = _table(root, "runs")
    total = int(runs.total_params.iloc[0])
    routed = int(runs.routed_expert_params.iloc[0])
    ppe = dict(zip(layers.layer, layers.params_per_expert))
    per_step = {}
    for row in layer_steps.itertuples():  # the active fraction from the loads alone
        kept = np.asarray(row.expert_load)[: int(layers.num_experts.iloc[0])].sum()
        per_step.setdefault(int(row.step), 0.0)
        per_step[int(row.step)] += kept / row.tokens * ppe[row.layer]
    by_domain: dict[str, list] = {}
    for row in steps.itertuples():
        tags = dict(row.tags)
        if "domain" in tags and tags.get("phase") != "check":
            by_domain.setdefault(tags["domain"], []).append(((total - routed) + per_step[int(row.step)], row.tokens))
    for domain, rows in by_domain.items():
        active = sum(a * t for a, t in rows) / sum(t for _, t in rows)
        assert summary["active_fraction_by_domain"][domain] == pytest.approx(active / total, rel=1e-9)
        assert f"{domain:>6}: this model used {100 * active / total:.2f}%" in out
    # Specialisation: NMI(expert; domain) over every kept top-k slot of the baseline phase, by
    # scikit-learn over one label pair per slot of the raw routes rows (the Clusters page's figure).
    routes = _table(root, "routes")
    base = routes[[dict(t).get("phase") == "baseline" for t in routes.tags]]
    for layer, nmi in enumerate(summary["specialisation_by_layer"]):
        rows = base[base.layer == layer]
        domains, experts = [], []
        for tags, ids, kept in zip(rows.tags, rows.expert_ids, rows.kept):
            for expert, k in zip(ids, kept):
                if k:
                    domains.append(dict(tags)["domain"])
                    experts.append(int(expert))
        assert nmi == pytest.approx(normalized_mutual_info_score(domains, experts), abs=1e-12)
    assert ", ".join(f"{v:.3f}" for v in summary["specialisation_by_layer"]) in out
    assert max(summary["specialisation_by_layer"]) > 0.15, "the trained demo model should route by domain"


def test_store_holds_what_the_dashboard_needs(demo):
    root, _, _ = demo
    store = Store(root)
    run = store.latest_run()
    counts = {t: int(store.sql(f'SELECT count(*) AS n FROM "{t}" WHERE run_id = ?', [run]).n[0])
              for t in ("steps", "layer_steps", "routes", "router_inputs", "kv_cache", "expert_health",
                        "trust_gate_events", "alerts")}
    assert all(n > 0 for n in counts.values()), counts
    generate_steps = store.sql("SELECT count(*) AS n FROM steps WHERE run_id = ? AND tags['phase'] = 'generate'",
                               [run]).n[0]
    assert generate_steps > 0

"""`moescope demo --quick` end to end: both incidents, their alerts, and a store the dashboard can read.

The printed headline figures are recomputed here from the raw Parquet files with pyarrow and
numpy, not through the store's queries.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from probe import find_moe_layers
from probe.adapters import experts_arguments
from probe.gate import TrustGate
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


def _check_forwards(root) -> tuple[list[int], pd.DataFrame]:
    """The demo's four check forwards of one batch (clean, corrupted, masked, restored), in order,
    and their raw routes rows."""
    routes = _table(root, "routes")
    check = routes[[dict(t).get("phase") == "check" for t in routes.tags]]
    steps = sorted(int(s) for s in check.step.unique())
    assert len(steps) == 4, steps
    return steps, check


def _batch_from_routes(rows: pd.DataFrame, pad_id: int) -> dict[str, torch.Tensor]:
    """The input ids a forward saw, rebuilt from its routes (token id at each row and position); the
    demo pads on the right with the pad token, so the attention mask is where the ids are not it."""
    first = rows[rows.layer == 0]
    ids = np.zeros((first.sequence.max() + 1, first.position.max() + 1), dtype=np.int64)
    ids[first.sequence.to_numpy(), first.position.to_numpy()] = first.token_id.to_numpy()
    ids = torch.from_numpy(ids)
    return {"input_ids": ids, "attention_mask": (ids != pad_id).long()}


def _routes_by_layer(rows: pd.DataFrame) -> dict[int, np.ndarray]:
    rows = rows.sort_values(["layer", "sequence", "position"])
    return {int(layer): np.sort(np.stack(part.expert_ids.to_numpy()), axis=1) for layer, part in rows.groupby("layer")}


def _run_with_routes(model, batch) -> tuple[torch.Tensor, dict[int, np.ndarray]]:
    """The model's logits on `batch`, and the expert ids each MoE layer's experts module really received
    (read by a hook of our own on every MoE layer, whatever the family)."""
    got = {}

    def keep(index: int):
        def hook(module, args, kwargs):
            ids = experts_arguments(args, kwargs)[0]
            got[index] = np.sort(ids.reshape(-1, ids.shape[-1]).numpy(), axis=1)
        return hook

    hooks = [layer.experts.register_forward_pre_hook(keep(layer.index), with_kwargs=True)
             for layer in find_moe_layers(model)]
    try:
        with torch.no_grad():
            logits = model(**batch).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, got


def test_the_check_figures_recomputed_from_the_model_and_the_raw_routes(demo):
    """masked_finite, masked_error, corrupt_error and recovered_error, recomputed: the check batch is
    rebuilt from its routes rows; the shipped model is run on it clean, with the gated expert's weights
    scaled as the demo scales them, and so corrupted with that expert masked by a trust gate of our own
    (probe.gate, checked against brute force in tests/probe/test_gate.py). Every run must route as the
    recorded check forward did, and the errors must be the summary's."""
    from moescope.demo import CORRUPTION_SCALE
    from moescope.demo import _expert_tensors as demo_expert_tensors
    from moescope.demo_data import load_demo_model

    root, _, summary = demo
    model, tokenizer = load_demo_model()
    steps, check = _check_forwards(root)
    batches = [_batch_from_routes(check[check.step == s], tokenizer.pad_token_id) for s in steps]
    assert all(torch.equal(b["input_ids"], batches[0]["input_ids"]) for b in batches)  # one batch, four times
    recorded = [_routes_by_layer(check[check.step == s]) for s in steps]
    events = _table(root, "trust_gate_events").sort_values("ts")
    layer, expert = int(events.layer.iloc[0]), int(events.expert.iloc[0])
    assert summary["corrupted"] == {"layer": layer, "expert": expert}

    batch = batches[0]
    clean, routes = _run_with_routes(model, batch)
    assert sorted(routes) == sorted(recorded[0])
    for i in routes:
        np.testing.assert_array_equal(routes[i], recorded[0][i])  # the rebuilt batch is the one the demo checked
    moe = find_moe_layers(model)[layer]
    with torch.no_grad():
        for weights in demo_expert_tensors(model, layer):  # the tensors the demo corrupts, scaled as it does
            weights[expert] *= CORRUPTION_SCALE
    corrupted, routes = _run_with_routes(model, batch)
    assert all(np.array_equal(routes[i], recorded[1][i]) for i in recorded[1])
    assert summary["corrupt_error"] == pytest.approx(float((corrupted - clean).norm() / clean.norm()), rel=1e-3)

    gate = TrustGate([moe])
    handles = gate.install()
    try:
        gate.set(layer, expert, 0.0, "as the demo's policy did")
        masked, routes = _run_with_routes(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    assert all(np.array_equal(routes[i], recorded[2][i]) for i in recorded[2])
    assert not (recorded[2][layer] == expert).any()  # the gated expert got no token of the check batch
    assert summary["masked_finite"] is bool(masked.isfinite().all()) is True
    assert summary["masked_error"] == pytest.approx(float((masked - clean).norm() / clean.norm()), rel=1e-3)
    # restored: the demo's last check routed every token exactly as the clean one, so its output is the clean one
    assert all(np.array_equal(recorded[3][i], recorded[0][i]) for i in recorded[0])
    assert summary["recovered_error"] == 0.0


def test_the_alerts_received_are_the_outbox_deliveries(demo):
    """alerts_received against the outbox's own record of what it delivered to the receiver, and
    against the receiver's printed lines."""
    import sqlite3

    root, out, summary = demo
    path = root / ".moescope" / "alerts-outbox.sqlite"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        bodies = [json.loads(body) for (body,) in db.execute(
            "SELECT body FROM deliveries WHERE state = 'delivered' ORDER BY id")]
    delivered = Counter(f"{b['status']}:{b['alert']['name']}" for b in bodies)
    assert Counter(summary["alerts_received"]) == delivered
    printed = Counter(f"{status}:{name}" for status, name in re.findall(r"webhook <- \[(\w+)\] (\w+)", out))
    assert printed == delivered

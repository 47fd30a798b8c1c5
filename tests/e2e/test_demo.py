"""`moescope demo --quick` end to end: both incidents, their alerts, and a store the dashboard can read.

The printed headline figures are recomputed here from the raw Parquet files with pyarrow and
numpy, not through the store's queries.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from moescope.demo.rollout import ROLLOUT_SUFFIXES
from moescope.probe import find_moe_layers
from moescope.probe.adapters import experts_arguments
from moescope.probe.trust_gate import TrustGate
from moescope.store import Store
from tests.support.paths import REPO


def _table(root, name):
    """The story run's rows of a table: the rollout's runs (moescope.demo.rollout, runs of their own) left out."""
    files = [str(path) for path in sorted((root / name).glob("run_id=*/*.parquet"))
             if not path.parent.name.endswith(ROLLOUT_SUFFIXES)]
    return ds.dataset(files, format="parquet", exclude_invalid_files=True).to_table().to_pandas()


def test_both_incidents_reached_the_webhook(demo):
    root, out, summary = demo
    received = Counter(summary["alerts_received"])
    assert received["firing:RoutingDriftFromBaseline"] >= 1
    assert received["firing:TrustGateChanged"] >= 1 and received["resolved:TrustGateChanged"] >= 1
    assert received["firing:ExpertUnhealthy"] >= 1
    # an idle expert is not a sick one: the shift is the drift alert's news, and the one expert found
    # unhealthy is the corrupted one (issue 50: the shift used to page 10 idle or shy experts)
    alerts = _table(root, "alerts")
    unhealthy = alerts[(alerts.alertname == "ExpertUnhealthy") & (alerts.state == "firing")]
    corrupted = (summary["corrupted"]["layer"], summary["corrupted"]["expert"])
    assert list(zip(unhealthy.layer, unhealthy.expert)) == [corrupted]
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
    # Over kept slots: the capacity caps each expert at a quarter of a sequence's slots, so a domain's
    # favourite expert (arithmetic's takes every one of its first choices in the middle layers) keeps
    # only part of its tokens, which flattens this figure: 0.035-0.063 per layer on the quick demo.
    # The model card gives the router's top-1 figure, before the capacity: 0.17-0.61.
    assert max(summary["specialisation_by_layer"]) > 0.05, "the trained demo model should route by domain"


def _fraction_by_position(root, buckets: int, phase: str) -> tuple[int, dict[int, list[float]]]:
    """(bucket width, bucket -> each token's active fraction) by a loop over the raw routes rows of
    one phase: a token's share is the parameters outside the routed experts plus params_per_expert
    for every slot it kept, in every layer; positions in `buckets` equal buckets of the longest input."""
    routes = _table(root, "routes")
    layers = _table(root, "layers")
    runs = _table(root, "runs")
    total, routed = int(runs.total_params.iloc[0]), int(runs.routed_expert_params.iloc[0])
    ppe = dict(zip(layers.layer, layers.params_per_expert))
    experts = dict(zip(layers.layer, layers.num_experts))
    used: dict[tuple, float] = {}
    position_of: dict[tuple, int] = {}
    seen: Counter = Counter()
    for row in routes.itertuples():
        if dict(row.tags).get("phase") != phase:
            continue
        key = (int(row.step), int(row.rank), int(row.token))
        kept = sum(1 for e, k in zip(row.expert_ids, row.kept) if k and e < experts[row.layer])
        used[key] = used.get(key, 0.0) + kept * ppe[row.layer]
        position_of[key] = int(row.position)
        seen[key] += 1
    assert set(seen.values()) == {len(layers)}, "every token has a route in every layer"
    width = math.ceil((max(position_of.values()) + 1) / buckets)
    by_bucket: dict[int, list[float]] = {}
    for key, value in used.items():
        by_bucket.setdefault(position_of[key] // width, []).append((total - routed + value) / total)
    return width, by_bucket


def test_active_fraction_by_position_recomputed_from_the_raw_routes(demo):
    from moescope.demo.story import LENGTH

    root, out, summary = demo
    width, buckets = _fraction_by_position(root, 4, "baseline")
    assert width == LENGTH // 4
    figures = summary["active_fraction_by_position"]
    assert [b["position_start"] for b in figures] == [i * width for i in sorted(buckets)]
    for b, i in zip(figures, sorted(buckets)):
        assert b["tokens"] == len(buckets[i])
        assert b["active_fraction"] == pytest.approx(float(np.mean(buckets[i])), rel=1e-9)
    last = figures[-1]
    assert f"past position {last['position_start']} it drifts to {100 * last['active_fraction']:.1f}%" in out
    ranked = sorted(((d, f) for d, f in summary["active_fraction_by_domain"].items() if d != "mixed"),
                    key=lambda item: -item[1])
    said = [f"{'arithmetic' if d == 'math' else d} {100 * f:.1f}%" for d, f in ranked]
    said[0] = said[0].replace(" ", " used ", 1) + " of its parameters per token"
    assert (", ".join(said) + "; past position").lower() in out.lower()
    # The demo model drops at capacity, later positions first: the share falls from the first quarter to the last.
    assert figures[0]["active_fraction"] > figures[-1]["active_fraction"] + 0.02


def test_the_overview_shows_the_swing_by_batch_by_tag_and_by_position(demo, monkeypatch):
    """The dashboard's Overview on the demo's store, filtered to the baseline phase: its by-position
    chart holds the loop's figures (eight buckets), its by-tag chart one bar per domain, and its
    per-batch chart a fraction that moves."""
    from streamlit.testing.v1 import AppTest

    from moescope.dashboard import settings

    root, _, summary = demo
    monkeypatch.setenv(settings.ENV_STORE, str(root))
    monkeypatch.setenv(settings.ENV_ALLOW_WRITES, "0")
    monkeypatch.delenv(settings.ENV_TOKENIZER, raising=False)
    at = AppTest.from_file(str(Path(REPO) / "dashboard" / "app.py"), default_timeout=240)
    at.run()
    at.sidebar.selectbox(key="ms_tag_key").set_value("phase").run()
    at.sidebar.selectbox(key="ms_tag_value").set_value("baseline").run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    charts = {spec["layout"]["title"]["text"]: spec for spec in (json.loads(c.proto.spec)
                                                                  for c in at.get("plotly_chart"))}
    width, buckets = _fraction_by_position(root, 8, "baseline")
    bars = charts["Active-parameter fraction by position"]["data"][0]
    # percent, rounded to 6 decimals by the figure
    np.testing.assert_allclose(_values(bars["y"]), [100 * np.mean(buckets[i]) for i in sorted(buckets)], atol=1e-6)
    assert bars["x"][-1].startswith(f"{max(buckets) * width}–")
    by_tag = charts["Active-parameter fraction by domain"]["data"][0]
    # the sidebar's filter applies (issue 33): the domains of the baseline phase's steps, not the run's
    steps = _table(root, "steps")
    baseline = {dict(tags).get("domain") for tags in steps.tags if dict(tags).get("phase") == "baseline"}
    assert sorted(by_tag["x"]) == sorted(baseline - {None})
    assert set(baseline) < set(summary["active_fraction_by_domain"]) | {None}  # mixed is the generate phase's
    per_batch = _values(charts["Active-parameter fraction per batch"]["data"][-1]["y"])
    assert per_batch.max() - per_batch.min() > 0.5, "the fraction should move from batch to batch (percent)"


def _values(encoded) -> np.ndarray:
    """A Plotly JSON array: a plain list, or a typed array ({"dtype", "bdata": base64})."""
    if isinstance(encoded, dict):
        return np.frombuffer(base64.b64decode(encoded["bdata"]), dtype=np.dtype(encoded["dtype"])).astype(float)
    return np.asarray(encoded, dtype=float)


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


def _batch_from_routes(rows: pd.DataFrame) -> dict[str, torch.Tensor]:
    """The input ids a forward saw, rebuilt from its routes (token id at each row and position); the
    demo's inputs fill every position (no padding), so the attention mask is all ones."""
    first = rows[rows.layer == 0]
    ids = np.full((first.sequence.max() + 1, first.position.max() + 1), -1, dtype=np.int64)
    ids[first.sequence.to_numpy(), first.position.to_numpy()] = first.token_id.to_numpy()
    assert (ids >= 0).all(), "every position of the check batch has a route"
    ids = torch.from_numpy(ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


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
    (probe.gate, checked against brute force in tests/unit/probe/test_trust_gate.py). Every run must route as the
    recorded check forward did, and the errors must be the summary's."""
    from moescope.demo.data import load_demo_model
    from moescope.demo.story import CORRUPTION_SCALE
    from moescope.demo.story import _expert_tensors as demo_expert_tensors

    root, _, summary = demo
    model, _ = load_demo_model()
    steps, check = _check_forwards(root)
    batches = [_batch_from_routes(check[check.step == s]) for s in steps]
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
        # the notifications posted: a transition sent alone, or a group's (its transitions wait in rows
        # of their own, role 'member', and are posted inside it)
        bodies = [json.loads(body) for (body,) in db.execute(
            "SELECT body FROM deliveries WHERE state = 'delivered' AND role != 'member' ORDER BY id")]
    alerts = [a for b in bodies for a in (b["alerts"] if b["schema"] == "moescope.alert-group/v1" else [b])]
    delivered = Counter(f"{a['status']}:{a['alert']['name']}" for a in alerts)
    assert Counter(summary["alerts_received"]) == delivered
    assert summary["notifications_received"] == len(bodies)
    assert summary["notifications_repeated"] == 0  # each notification posted once (issue 50: 36 became 37-43)
    printed = Counter(f"{status}:{name}" for status, name in re.findall(r"webhook <- \[(\w+)\] (\w+)", out))
    notified = Counter(f"{b['status']}:{(b['alerts'][0] if 'alerts' in b else b)['alert']['name']}" for b in bodies)
    assert printed == notified  # a line per notification


def _figures(summary: dict) -> dict:
    """What the demo measured, without what names this run (store, fingerprints) or times it; floats
    to 12 digits (DuckDB's parallel sums may add in another order: the last bits differ)."""
    def rounded(value):
        if isinstance(value, float):
            return float(f"{value:.12g}")
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    figures = {k: v for k, v in summary.items() if k not in ("store", "seconds", "alerts_received",
                                                             "alerts_delivered", "notifications_received")}
    figures["alerts"] = sorted((d["status"], d["name"], d["step"]) for d in summary["alerts_delivered"])
    # the rollout's figures, not its run ids (new ones each run)
    figures["rollout"] = {k: v for k, v in summary["rollout"].items() if k not in ("engine_run", "mismatch_run")}
    figures["rollout"]["mismatch_line"] = summary["rollout"]["mismatch_line"].replace(summary["rollout"]["engine_run"],
                                                                                      "ENGINE")
    return rounded(figures)


def test_the_same_seed_tells_the_same_story_on_a_loaded_machine(demo, tmp_path):
    """Issue 24: the demo's windows, phases and rule spans are counted in forwards, so a second run
    with both cores busy (two spinning processes beside it) gives the very same figures and alerts,
    at the same steps, as the first."""
    root, _, summary = demo
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        result = subprocess.run([sys.executable, "-m", "moescope.cli", "demo", "--quick", "--store",
                                 str(tmp_path / "again")], capture_output=True, text=True, timeout=900)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "demo_summary.json").read_text())
    assert _figures(again) == _figures(summary)
    steps = _table(root, "steps").sort_values("step")
    steps_again = _table(tmp_path / "again", "steps").sort_values("step")
    assert steps.step.tolist() == steps_again.step.tolist()
    assert steps.tokens.tolist() == steps_again.tokens.tolist()


def test_the_commands_the_demo_prints_run_as_printed(demo):
    """A newcomer copies the printed commands into a shell whose PATH does not hold the virtual
    environment (it is not activated): they must run as printed."""
    root, out, _ = demo
    shell_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(root.parent)}
    query = next(line for line in out.splitlines() if line.startswith("try:  ")).removeprefix("try:  ")
    result = subprocess.run(["bash", "-c", query], capture_output=True, text=True, env=shell_env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "expert_ids" in result.stdout
    dashboard = out.splitlines()[out.splitlines().index("Open the dashboard on this store:") + 1].strip()
    result = subprocess.run(["bash", "-c", dashboard.replace(" dashboard ", " dashboard --help ", 1)],
                            capture_output=True, text=True, env=shell_env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "usage: moescope dashboard" in result.stdout


def test_the_demo_prints_its_routing_jitter(demo):
    """Issue 24: the demo shows one line of the jitter check (measured against the model's own router
    outputs in tests/unit/analyses/test_jitter.py): repeats of the fp32 demo model change nothing."""
    _, out, summary = demo
    line = summary["jitter"]
    assert line in out and line.startswith("Routing jitter")
    assert "kept-slot specialisation NMI(expert; domain)" in out  # the Clusters page's name for its figure
    assert "repeat 0.00%" in line and "bfloat16" in line and "batch=" in line


def test_the_placement_page_shows_placements_that_differ(demo, monkeypatch):
    """Issue 47 part 4: on the demo's store the Placement page opens where its placements part (8
    experts: 4 ranks of two), its default line is the contiguous layout's balancedness by a loop over
    the raw rows, and EPLB fitted on the first window beats it on every later window."""
    from tests.support.pages import app_for, assert_clean, open_page

    root, _, _ = demo
    at = open_page(app_for(monkeypatch, str(root)), "views/placement.py")
    assert_clean(at)
    assert at.number_input(key="pl_ranks").value == 4
    run_id = at.sidebar.selectbox(key="ms_run").value
    rows = ds.dataset(str(root / "layer_steps" / f"run_id={run_id}"), format="parquet",
                      exclude_invalid_files=True).to_table().to_pandas()
    spec = json.loads(next(c for c in at.get("plotly_chart") if c.key == "pl_over_time").proto.spec)
    lines = {t["name"]: dict(zip(_values(t["x"]).astype(int).tolist(), _values(t["y"]).astype(float).tolist()))
             for t in spec["data"]}
    for start, line_value in lines["default"].items():
        part = rows[rows.step // 32 * 32 == start]
        means = peaks = 0.0
        for _, layer in part.groupby("layer"):
            per_rank = np.sum([np.asarray(v, dtype=float) for v in layer.expert_load], axis=0).reshape(4, 2).sum(1)
            means, peaks = means + per_rank.mean(), peaks + per_rank.max()
        assert abs(line_value - means / peaks) < 1e-9
    later = [s for s in lines["default"] if s > min(lines["default"])]
    assert later and all(lines["eplb"][s] > lines["default"][s] for s in later), lines
    assert not any("same balancedness" in i.value for i in at.info)

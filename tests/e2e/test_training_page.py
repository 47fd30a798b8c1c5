"""The Training page and `alerts.training.training_report`, on a real training run.

A tiny random Mixtral with expert capacity trains for a few optimizer steps in a plain loop under
`moescope.training.watch(..., cooldown="auto")` (a rule set to fire at once, so both routers
cool). The loop keeps what the model itself says at each step: its `aux_loss`, its router logits
(for transformers' `load_balancing_loss_func` and `router_z_loss_func`, and the router entropy)
and the gradients torch computed. The report and the page's charts must carry exactly those
numbers; dead experts must equal a loop over the raw `layer_steps` / `train_steps` Parquet rows
(read with pyarrow), and the cooldown bands and table the raw `routing_cooldown_events` rows.
A second run in the same store, recorded with plain `moescope.attach`, has no training steps.
"""

from __future__ import annotations

import base64
import glob
import json
import math
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

import moescope
import moescope.training as training
from moescope.analyses.training_report import LAYER_COLUMNS, training_report
from moescope.dashboard import figures as fg
from moescope.store.store import Store
from tests.support.pages import app_for, assert_clean, open_page
from tests.support.training import EXPERTS, TOP_K, VOCAB, tiny_mixtral

PAGE = "views/training.py"
TRAIN_RUN, PLAIN_RUN = "train-run", "plain-run"
STEPS, LR, FACTOR = 8, 0.1, 0.1


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    from moescope.alerts.cooldown_policy import CooldownConfig
    from moescope.demo.capacity import install_capacity

    root = str(tmp_path_factory.mktemp("training") / "store")
    model = install_capacity(tiny_mixtral(), capacity_factor=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    config = CooldownConfig(thresholds={"router_entropy": 2.0, "capacity_use": 0.0}, for_duration="0s", window=1,
                            period_steps=2, min_gap_steps=100, max_share=1.0)
    monitor = training.watch(model, optimizer, store=root, cooldown="auto", cooldown_config=config,
                             run_id=TRAIN_RUN)
    g = torch.Generator().manual_seed(3)
    own_aux, logits, grads = [], [], []
    try:
        for _ in range(STEPS):
            ids = torch.randint(0, VOCAB, (1, 3), generator=g)  # 3 tokens: a few experts idle each step
            out = model(input_ids=ids, labels=ids)
            own_aux.append(float(out.aux_loss.detach()))
            logits.append([t.detach() for t in out.router_logits])
            out.loss.backward()
            grads.append([[float(torch.sqrt(sum(p.grad[e].double().pow(2).sum() for p in experts.parameters())))
                           for e in range(EXPERTS)] for experts in (d.mlp.experts for d in model.model.layers)])
            optimizer.step()
            optimizer.zero_grad()
    finally:
        monitor.close()
    plain_model = tiny_mixtral(seed=1)
    plain = moescope.attach(plain_model, store=root, run_id=PLAIN_RUN)  # the newest run: no training steps
    try:
        with torch.no_grad():
            plain_model(torch.randint(0, VOCAB, (2, 5), generator=g))
    finally:
        plain.close()
    return {"root": root, "aux": own_aux, "logits": logits, "grads": grads}


def raw(root: str, table: str, run_id: str = TRAIN_RUN) -> pd.DataFrame:
    files = sorted(glob.glob(os.path.join(root, table, f"run_id={run_id}", "part-*.parquet")))
    assert files, f"no {table} rows were written"
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def brute_dead(root: str, window: int) -> dict[tuple[int, int], float]:
    """(optimizer step, layer) -> share of the 4 experts with no kept slot in the optimizer steps
    (k - window, k], by a plain loop over the raw rows."""
    load = {(int(r.step), int(r.layer)): np.asarray(r.expert_load) for r in raw(root, "layer_steps").itertuples()}
    updates = raw(root, "train_steps")
    out = {}
    for r in updates.itertuples():
        recent = updates[(updates.layer == r.layer) & (updates.optimizer_step > r.optimizer_step - window)
                         & (updates.optimizer_step <= r.optimizer_step)]
        total = np.zeros(EXPERTS)
        for s in recent.step:
            total += load[(int(s), int(r.layer))][:EXPERTS]
        out[(int(r.optimizer_step), int(r.layer))] = np.count_nonzero(total == 0) / EXPERTS
    return out


def cooled(root: str) -> dict[int, tuple[int, int]]:
    """layer -> (optimizer steps done at the cooldown's start, at its end), from the raw events."""
    events = raw(root, "routing_cooldown_events")
    starts = {int(r.layer): int(r.step) for r in events.itertuples() if r.action == "start"}
    ends = {int(r.layer): int(r.step) for r in events.itertuples() if r.action == "end"}
    assert set(starts) == set(ends) == {0, 1}
    return {layer: (starts[layer], ends[layer]) for layer in starts}


def entropy(layer_logits: torch.Tensor) -> float:
    """Mean over tokens of the router's softmax entropy, over ln E."""
    p = torch.softmax(layer_logits.double(), dim=-1)
    return float((-(p * torch.log(p)).sum(-1)).mean()) / math.log(EXPERTS)


def array(value) -> np.ndarray:
    """A trace array as Plotly's JSON holds it (base64 typed arrays, or plain lists)."""
    if isinstance(value, dict) and "bdata" in value:
        out = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        return out.reshape([int(n) for n in str(value["shape"]).split(",")]) if "shape" in value else out
    return np.asarray(value, dtype=np.float64)


def charts(at) -> dict[str, dict]:
    """The page's Plotly charts as their JSON specs, by title."""
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return {s["layout"]["title"]["text"]: s for s in specs}


def trace(spec: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    (found,) = [t for t in spec["data"] if t.get("name") == name]
    return array(found["x"]), array(found["y"])


def test_report_is_the_models_own_numbers(trained):
    with Store(trained["root"]) as store:
        report = training_report(store, TRAIN_RUN, dead_window=2)
        latest = training_report(store, TRAIN_RUN, dead_window=2, last_steps=3)
        plain = training_report(store, PLAIN_RUN)
    assert report.recorded and report.optimizer_steps == STEPS
    assert list(report.steps.optimizer_step) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(report.steps.aux_loss, trained["aux"], rtol=1e-5)  # the model's own aux_loss
    np.testing.assert_allclose(report.steps.z_loss, [float(router_z_loss_func(torch.cat(step).unsqueeze(0)))
                                                     for step in trained["logits"]], rtol=1e-5)
    for row in report.layers.itertuples():
        layer_logits = trained["logits"][row.optimizer_step - 1][row.layer]
        assert row.aux_loss == pytest.approx(float(load_balancing_loss_func((layer_logits,), EXPERTS, TOP_K)),
                                             rel=1e-5)
        assert row.z_loss == pytest.approx(float(router_z_loss_func(layer_logits.unsqueeze(0))), rel=1e-5)
        assert row.router_entropy == pytest.approx(entropy(layer_logits), rel=1e-5)
        np.testing.assert_allclose(row.expert_grad_norm, trained["grads"][row.optimizer_step - 1][row.layer],
                                   rtol=1e-5)
    for window in (2, 64):
        with Store(trained["root"]) as store:
            frame = training_report(store, TRAIN_RUN, dead_window=window).layers
        expected = brute_dead(trained["root"], window)
        assert {(int(r.optimizer_step), int(r.layer)): r.dead_expert_fraction
                for r in frame.itertuples()} == pytest.approx(expected)
    assert report.layers.dead_expert_fraction.max() > 0  # the window of 2 sees idle experts
    spans = cooled(trained["root"])
    for row in report.layers.itertuples():  # the lr the router was updated with: cooled by the factor
        start, end = spans[row.layer]
        assert row.router_lr == pytest.approx(LR * FACTOR if start < row.optimizer_step <= end else LR)
    assert sorted(zip(report.cooldowns.layer, report.cooldowns.start_step, report.cooldowns.end_step)) == [
        (layer, *spans[layer]) for layer in (0, 1)]
    assert report.cooldowns.ended.all()
    # the latest 3 steps only; their dead-expert window still reaches back before the first shown
    assert list(latest.steps.optimizer_step) == [STEPS - 2, STEPS - 1, STEPS]
    assert latest.first_optimizer_step == STEPS - 2 and latest.optimizer_steps == STEPS
    np.testing.assert_allclose(latest.layers.dead_expert_fraction,
                               report.layers[report.layers.optimizer_step >= STEPS - 2].dead_expert_fraction)
    assert not plain.recorded and plain.layers.empty and plain.steps.empty
    with Store(trained["root"]) as store, pytest.raises(ValueError, match="at least 1"):
        training_report(store, TRAIN_RUN, dead_window=0)


def test_page_draws_the_reports_numbers_and_the_cooldowns(monkeypatch, trained):
    at = open_page(app_for(monkeypatch, trained["root"]), PAGE)
    at.sidebar.selectbox(key="ms_run").set_value(TRAIN_RUN).run()
    at.slider(key="tr_dead_window").set_value(2).run()
    assert_clean(at)
    assert not at.warning, [w.value for w in at.warning]
    assert at.title[0].value == "Training"
    shown = charts(at)
    assert len(shown) == 6, list(shown)
    steps = np.arange(1, STEPS + 1)

    x, y = trace(shown["Load-balancing aux loss"], "all layers (pooled)")
    np.testing.assert_array_equal(x, steps)
    np.testing.assert_allclose(y, trained["aux"], rtol=1e-5)  # the model's own aux_loss, on the chart
    dead = brute_dead(trained["root"], 2)
    spans = cooled(trained["root"])
    for layer in (0, 1):
        layer_logits = [step[layer] for step in trained["logits"]]
        _, y = trace(shown["Load-balancing aux loss"], f"layer {layer}")
        np.testing.assert_allclose(y, [float(load_balancing_loss_func((t,), EXPERTS, TOP_K)) for t in layer_logits],
                                   rtol=1e-5)
        _, y = trace(shown["Router z-loss"], f"layer {layer}")
        np.testing.assert_allclose(y, [float(router_z_loss_func(t.unsqueeze(0))) for t in layer_logits], rtol=1e-5)
        _, y = trace(shown["Router entropy"], f"layer {layer}")
        np.testing.assert_allclose(y, [entropy(t) for t in layer_logits], rtol=1e-5)
        _, y = trace(shown["Dead experts over the last 2 optimizer steps"], f"layer {layer}")
        np.testing.assert_allclose(y, [dead[(int(k), layer)] for k in steps])
        start, end = spans[layer]
        _, y = trace(shown["Router learning rate in force"], f"layer {layer}")
        np.testing.assert_allclose(y, [LR * FACTOR if start < k <= end else LR for k in steps])
    assert shown["Router learning rate in force"]["layout"]["yaxis"]["type"] == "log"
    # each cooldown shaded over the updates it cooled, on every per-layer chart
    for title in ("Load-balancing aux loss", "Router z-loss", "Router entropy", "Router learning rate in force"):
        bands = sorted((s["x0"], s["x1"]) for s in shown[title]["layout"]["shapes"])
        assert bands == sorted((spans[layer][0] + 0.5, spans[layer][1] + 0.5) for layer in (0, 1)), title
    heat = shown["Layer 0: expert gradient norms per optimizer step"]["data"][0]
    np.testing.assert_allclose(array(heat["z"]), np.array([step[0] for step in trained["grads"]]).T, rtol=1e-5)
    events = raw(trained["root"], "routing_cooldown_events")
    table = at.dataframe[0].value
    assert len(table) == len(events)
    assert sorted(zip(table["optimizer step"], table.layer, table.action, table.reason)) == sorted(
        zip(events.step, events.layer, events.action, events.reason))
    assert {m.label: m.value for m in at.metric}["Aux loss, all layers (latest)"] == f"{trained['aux'][-1]:.4f}"

    at.selectbox(key="tr_layer").set_value(1).run()  # one layer: its lines and heatmap, plus the pooled loss
    assert_clean(at)
    shown = charts(at)
    assert [t["name"] for t in shown["Load-balancing aux loss"]["data"]] == ["layer 1", "all layers (pooled)"]
    assert [(s["x0"], s["x1"]) for s in shown["Router entropy"]["layout"]["shapes"]] == [
        (spans[1][0] + 0.5, spans[1][1] + 0.5)]
    heat = shown["Layer 1: expert gradient norms per optimizer step"]["data"][0]
    np.testing.assert_allclose(array(heat["z"]), np.array([step[1] for step in trained["grads"]]).T, rtol=1e-5)
    assert set(at.dataframe[0].value.layer) == {1}


def test_a_run_without_training_steps_says_how_to_record_one(monkeypatch, trained, tmp_path):
    at = open_page(app_for(monkeypatch, trained["root"]), PAGE)  # the newest run is the plain one
    assert_clean(at)
    assert at.sidebar.selectbox(key="ms_run").value == PLAIN_RUN
    assert not at.get("plotly_chart")
    (info,) = at.info
    assert "not recorded with `moescope.training`" in info.value
    assert "moescope.training.watch(model, optimizer, store=...)" in info.value
    at = open_page(app_for(monkeypatch, str(tmp_path / "not-yet")), PAGE)
    assert_clean(at)
    assert any("no store" in i.value.lower() for i in at.info)
    # train_steps without the routing records of their forwards (not written yet, or lost): said, not a crash
    import shutil

    root = str(tmp_path / "store")
    shutil.copytree(trained["root"], root)
    shutil.rmtree(os.path.join(root, "layer_steps", f"run_id={TRAIN_RUN}"))
    at = open_page(app_for(monkeypatch, root), PAGE)
    at.sidebar.selectbox(key="ms_run").set_value(TRAIN_RUN).run()
    assert_clean(at)
    assert not at.get("plotly_chart")
    assert any(f"{STEPS} optimizer steps in `train_steps`" in i.value for i in at.info)


def test_figures_say_why_they_are_empty_and_skip_cooldowns_that_cooled_nothing():
    empty = pd.DataFrame(columns=LAYER_COLUMNS)
    assert fg.training_figure(empty, "aux_loss", "t", "y").layout.annotations
    rows = pd.DataFrame({"optimizer_step": [1, 2, 3], "step": [0, 1, 2], "step_end": [0, 1, 2], "layer": [0, 0, 0],
                         "aux_loss": [1.0, 1.1, 1.2], "expert_grad_norm": [None, None, None]})
    spans = pd.DataFrame({"layer": [0, 0, 1], "start_step": [1, 2, 1], "end_step": [1, 3, 3],
                          "ended": [True, False, True]})
    fig = fg.training_figure(rows, "aux_loss", "t", "y", cooldowns=spans)
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(2.5, 3.5)]  # layer 1 is not drawn; 1..1 cooled nothing
    assert "still on" in fig.layout.annotations[0].text
    assert "no expert gradient norm" in fg.expert_grad_heatmap(rows, 0).layout.annotations[0].text


@pytest.mark.integration
def test_training_page_in_a_real_browser(trained, tmp_path):
    from playwright.sync_api import sync_playwright

    from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, running_dashboard, settle
    from tests.support.realparts import require_program

    require_program(CHROMIUM, package="chromium")
    with running_dashboard(trained["root"], tmp_path) as url:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                viewport={"width": 1500, "height": 2400})
            try:
                page = context.pages[0] if context.pages else context.new_page()
                page.goto(f"{url}/training")
                page.wait_for_selector("h1:has-text('Training')")
                page.get_by_text("not recorded with moescope.training", exact=False).wait_for(timeout=240_000)
                # the sidebar's run picker: choose the training run
                page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').first.click()
                page.get_by_role("option", name=TRAIN_RUN, exact=False).click()
                settle(page, 6)
                assert page.locator('[data-testid="stException"]').count() == 0
                drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(gd =>
                    gd.data && gd.data.length > 0 && gd.querySelector('.main-svg .trace, .main-svg .hm')).length""")
                assert drawn == 6
                bands = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(
                    gd => (gd.layout.shapes || []).length)""")
                assert bands[:4] == [2, 2, 2, 2]  # both layers' cooldowns on the per-layer line charts
                os.makedirs(SCREENSHOTS, exist_ok=True)
                page.screenshot(path=os.path.join(SCREENSHOTS, "training.png"), full_page=True)
            finally:
                context.close()


SCREENSHOTS = os.environ.get("MOESCOPE_SCREENSHOTS") or os.path.join(os.path.dirname(__file__), "screenshots")

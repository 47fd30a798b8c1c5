"""Every page run by Streamlit's AppTest against a store the probe recorded on a real model."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import moescope
from tests.support.pages import app_for, assert_clean, open_page
from tests.support.zoo import tiny_model

PAGES = {  # page -> plotly charts it draws on the recorded store
    "views/overview.py": 5, "views/heatmaps.py": 3, "views/clusters.py": 3, "views/drift.py": 3,
    "views/health.py": 0, "views/compare.py": 3,
}








def table(root: str, name: str, run_id: str) -> pd.DataFrame:
    files = sorted(glob.glob(os.path.join(root, name, f"run_id={run_id}", "part-*.parquet")))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_the_recorded_store(monkeypatch, recorded, page):
    at = open_page(app_for(monkeypatch, recorded["root"]), page)
    assert_clean(at)
    assert not at.warning, [w.value for w in at.warning]
    assert len(at.get("plotly_chart")) >= PAGES[page]
    assert at.title[0].value  # the page's own title, not an empty state
    assert at.sidebar.selectbox(key="ms_run").value == recorded["runs"][-1]  # newest run first


def test_overview_headline_numbers(monkeypatch, recorded):
    run_id = recorded["runs"][-1]
    steps = table(recorded["root"], "steps", run_id)
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/overview.py")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Tokens"] == f"{steps.tokens.sum():,}"
    assert metrics["Forwards"] == str(len(steps))
    active = (steps.active_param_fraction * steps.tokens).sum() / steps.tokens.sum()
    assert metrics["Active parameters / token"] == f"{active:.2%}"
    assert any(f"used {active:.2%} of its parameters per token" in m.value for m in at.markdown)
    alerts = table(recorded["root"], "alerts", run_id).sort_values("ts", kind="stable")
    firing = (alerts.groupby("fingerprint").tail(1).state == "firing").sum()
    assert metrics["Alerts firing now"] == str(firing)


def test_overview_second_figures_are_captions_not_delta_chips(monkeypatch, recorded):
    # st.metric's delta draws an up-arrow chip that reads as a change; H / ln E and the drop rate are not.
    run_id = recorded["runs"][-1]
    layer_steps = table(recorded["root"], "layer_steps", run_id)
    experts = tiny_model("mixtral").config.num_local_experts  # the recorded model's router choices
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/overview.py")
    assert_clean(at)
    assert {m.label: m.delta for m in at.metric if m.delta} == {}
    captions = [c.value for c in at.caption]
    nats = (layer_steps.router_entropy_mean * layer_steps.tokens).sum() / layer_steps.tokens.sum()
    assert f"H / ln E = {nats / np.log(experts):.3f}" in captions
    rate = layer_steps.dropped_tokens.sum() / layer_steps.tokens.sum()
    assert f"{rate:.2%} of layer-tokens" in captions


def test_tag_filter_narrows_the_numbers(monkeypatch, recorded):
    run_id = recorded["runs"][-1]
    steps = table(recorded["root"], "steps", run_id)
    math_tokens = sum(t for t, tags in zip(steps.tokens, steps.tags) if dict(tags)["domain"] == "math")
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/overview.py")
    at.sidebar.selectbox(key="ms_tag_key").set_value("domain").run()
    at.sidebar.selectbox(key="ms_tag_value").set_value("math").run()
    assert_clean(at)
    assert {m.label: m.value for m in at.metric}["Tokens"] == f"{math_tokens:,}"


def test_heatmaps_list_the_tokens_of_the_hottest_expert_then_of_any_cell(monkeypatch, recorded):
    run_id = recorded["runs"][-1]
    routes = table(recorded["root"], "routes", run_id)
    load = np.zeros((2, 8))
    for layer, ids, kept in zip(routes.layer, routes.expert_ids, routes.kept):
        np.add.at(load[layer], ids[kept], 1)
    share = load / load.sum(axis=1, keepdims=True)
    hot_layer, hot_expert = np.unravel_index(np.argmax(share), share.shape)
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/heatmaps.py")
    assert_clean(at)
    assert at.selectbox(key="hm_layer").value == hot_layer
    assert at.selectbox(key="hm_expert").value == hot_expert

    at.selectbox(key="hm_layer").set_value(1).run()
    at.selectbox(key="hm_expert").set_value(5).run()
    at.select_slider(key="hm_limit").set_value(500).run()
    assert_clean(at)
    shown = at.dataframe[0].value
    expected = routes[(routes.layer == 1) & routes.expert_ids.map(lambda ids: 5 in ids)]
    assert 0 < len(expected) <= 500
    assert sorted(zip(shown.step, shown.sequence, shown.position)) == sorted(
        zip(expected.step, expected.sequence, expected.position))
    assert set(shown.token) == {f"#{i}" for i in expected.token_id}  # no tokenizer: ids
    assert all(f"«#{t}»" in c for t, c in zip(shown["token id"], shown.context))
    assert all("domain=" in t for t in shown.tags)


def test_compare_two_tag_values(monkeypatch, recorded):
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/compare.py")
    at.radio(key="cp_mode").set_value("two tag values").run()
    at.selectbox(key="cp_tag").set_value("domain").run()
    assert_clean(at)
    frame = at.dataframe[0].value
    assert list(frame.columns) == ["A: domain=code", "B: domain=math"]
    assert frame.notna().all().all()


def test_gate_control_only_with_allow_writes(monkeypatch, recorded, tmp_path):
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/health.py")
    assert_clean(at)
    assert not at.get("form") and not any("Manual gate control" in s.value for s in at.subheader)

    import shutil

    root = str(tmp_path / "store")
    shutil.copytree(recorded["root"], root)
    at = open_page(app_for(monkeypatch, root, allow_writes=True), "views/health.py")
    assert_clean(at)
    assert any("Manual gate control" in s.value for s in at.subheader)
    at.number_input(key="he_req_expert").set_value(3)
    at.slider(key="he_req_weight").set_value(0.25)
    at.text_input(key="he_req_reason").set_value("looks dead in the heatmap")
    at.button[0].click().run()  # the form's submit button
    assert_clean(at)
    assert any("Requested weight 0.25" in s.value for s in at.success)
    written = table(root, "trust_gate_requests", recorded["runs"][-1])
    assert written[["layer", "expert", "action", "weight", "reason"]].values.tolist() == [
        [0, 3, "override", 0.25, "looks dead in the heatmap"]]


def test_gate_control_waits_for_the_runs_layers(monkeypatch, tmp_path):
    # A run whose `layers` rows are not in the store (yet) has no expert to name: the form's layer
    # picker was empty and a request raised TypeError from the page.
    import shutil

    from tests.support.zoo import tiny_model

    root = str(tmp_path / "store")
    moescope.attach(tiny_model("mixtral"), store=root, run_id="no-layers").close()
    shutil.rmtree(os.path.join(root, "layers"))
    at = open_page(app_for(monkeypatch, root, allow_writes=True), "views/health.py")
    assert_clean(at)
    assert any("Manual gate control" in s.value for s in at.subheader)
    assert not at.get("form")
    assert any("no MoE layer recorded yet" in i.value for i in at.info)


@pytest.mark.parametrize("page", list(PAGES))
def test_missing_store_is_a_friendly_state(monkeypatch, tmp_path, page):
    at = open_page(app_for(monkeypatch, str(tmp_path / "not-yet")), page)
    assert_clean(at)
    assert any("no store" in i.value.lower() for i in at.info)


def test_empty_store_and_empty_run(monkeypatch, tmp_path):
    import moescope
    from tests.support.zoo import tiny_model

    empty = tmp_path / "empty"
    empty.mkdir()
    for page in PAGES:
        at = open_page(app_for(monkeypatch, str(empty)), page)
        assert_clean(at)
        assert any("holds no run" in i.value for i in at.info), page

    root = str(tmp_path / "idle")
    moescope.attach(tiny_model("mixtral"), store=root).close()  # a run with no forward pass
    for page in PAGES:
        at = open_page(app_for(monkeypatch, root), page)
        assert_clean(at)
        assert not at.warning, (page, [w.value for w in at.warning])
        assert at.info or at.success, page


def test_live_store_shows_new_steps_on_the_next_run(monkeypatch, tmp_path):
    import torch

    from tests.support.zoo import tiny_model

    root = str(tmp_path / "live")
    model = tiny_model("mixtral")
    session = moescope.attach(model, store=root, routes=True, run_id="live-run", flush_interval_s=0.05)
    try:
        def forwards(n: int) -> None:
            with torch.no_grad():
                for _ in range(n):
                    model(torch.randint(0, 128, (2, 8)))
            assert session.flush(30)

        forwards(3)
        at = open_page(app_for(monkeypatch, root), "views/overview.py")
        assert_clean(at)
        assert {m.label: m.value for m in at.metric}["Forwards"] == "3"
        forwards(4)  # the run goes on while the dashboard is open
        at.run()
        assert_clean(at)
        assert {m.label: m.value for m in at.metric}["Forwards"] == "7"
        assert {m.label: m.value for m in at.metric}["Tokens"] == f"{7 * 16:,}"
    finally:
        session.close()


def test_the_token_tables_gate_weight_has_four_decimals(monkeypatch, recorded):
    """Issue 33, part 7: the gate weight was drawn with every digit of its float, clipped to ".0000000009"."""
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/heatmaps.py")
    assert_clean(at)
    config = json.loads(at.dataframe[0].proto.columns)
    assert config["gate weight"]["type_config"]["format"] == "%.4f"

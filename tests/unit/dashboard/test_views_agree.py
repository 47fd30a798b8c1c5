"""Every number each view shows, against a loop over the raw Parquet rows; same label, same number.

Two recorded runs of held-back families, each a long prefill then many one-token decode steps
(where an unweighted mean of per-step means goes wrong): LongCat-Flash (8 routed + 2 zero experts,
uneven loads) and Switch Transformers with an expert capacity of 2 (tokens dropped). Views:
`moescope summary`, the Overview, Heatmaps and Compare pages through AppTest, and the Prometheus
gauges of an exporter that saw the whole run. The expected values come from the per-token rows
(routes: which experts each token chose and whether a slot was kept; router logits: every token's
softmax), read with pyarrow and reduced with numpy, never through the store's queries.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
from prometheus_client import CollectorRegistry
from streamlit.testing.v1 import AppTest

import moescope
from moescope.cli.summary import format_summary
from moescope.dashboard import settings
from moescope.prometheus.exporter import PrometheusExporter
from tests.support.paths import REPO
from tests.support.zoo import tiny_model

APP = os.path.join(REPO, "dashboard", "app.py")
PREFILL, DECODE = 24, 30


def _record(root: str, family: str, run_id: str, forward) -> CollectorRegistry:
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=10_000)  # the window spans the whole run
    model = tiny_model(family, **({"expert_capacity": 2} if family == "switch_transformers" else {}))
    with torch.no_grad():  # sharper routers than random init: entropies differ between tokens
        for name, param in model.named_parameters():
            if "router.classifier" in name:
                param.mul_(40.0)
    g = torch.Generator().manual_seed(7)
    with moescope.attach(model, store=root, routes=True, router_logits=True, window=1, run_id=run_id,
                         exporters=[exporter]) as session, torch.no_grad():
        with session.tag(phase="prefill"):
            forward(model, torch.randint(1, 128, (2, PREFILL), generator=g))
        with session.tag(phase="decode"):
            for _ in range(DECODE):  # one token again and again: its entropy is not the prompt's mean
                forward(model, torch.full((1, 1), 7))
    exporter.close()
    return registry


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("agree") / "store")
    registries = {
        "longcat": _record(root, "longcat_flash", "longcat", lambda m, ids: m(input_ids=ids)),
        # the decoder sees the long prompt once, then one token per step; the encoder the prompt every time
        "switch": _record(root, "switch_transformers", "switch",
                          lambda m, ids: m(input_ids=torch.ones((1, 12), dtype=torch.long),
                                           decoder_input_ids=ids)),
    }
    return {"root": root, "registries": registries}


def _rows(root: str, table: str, run_id: str):
    return ds.dataset(os.path.join(root, table, f"run_id={run_id}"), format="parquet").to_table().to_pandas()


def expected(root: str, run_id: str) -> dict:
    """Per layer and for the run, every figure the views show, from the per-token rows."""
    layers = _rows(root, "layers", run_id).set_index("layer")
    routes, logits = _rows(root, "routes", run_id), _rows(root, "router_logits", run_id)
    per_layer = {}
    for layer, info in layers.iterrows():
        width = int(info.num_experts + info.zero_experts)
        load = np.zeros(width)
        dropped = 0
        mine = routes[routes.layer == layer]
        for ids, kept in zip(mine.expert_ids, mine.kept):
            dropped += int(not any(kept))
            for expert, k in zip(ids, kept):
                load[expert] += k
        entropies = []
        for row in logits[logits.layer == layer].logits:
            p = np.exp(np.asarray(row, float) - max(row))
            p /= p.sum()
            entropies.append(-sum(x * math.log(x) for x in p if x > 0))
        assert len(entropies) == len(mine)  # every token's logits were recorded
        routed = load[: int(info.num_experts)]
        per_layer[int(layer)] = dict(
            tokens=len(mine), load=load, routed=routed, slots=load.sum(), cv=routed.std() / routed.mean(),
            max_mean=routed.max() / routed.mean(), dead=int((routed == 0).sum()), dead_fraction=(routed == 0).mean(),
            hottest=int(routed.argmax()), token_share=routed.max() / len(mine), slot_share=routed.max() / load.sum(),
            entropy=np.mean(entropies), entropy_norm=np.mean(entropies) / math.log(width),
            entropy_per_token=entropies, width=width, dropped=dropped, drop_rate=dropped / len(mine))
    tokens = sum(v["tokens"] for v in per_layer.values())
    every = [(h, v["width"]) for v in per_layer.values() for h in v["entropy_per_token"]]
    hot = max(per_layer, key=lambda layer: per_layer[layer]["slot_share"])
    steps = _rows(root, "steps", run_id)
    return dict(
        layers=per_layer, layer_tokens=tokens, steps=len(steps), step_tokens=int(steps.tokens.sum()),
        cv=sum(v["cv"] * v["tokens"] for v in per_layer.values()) / tokens,
        entropy=np.mean([h for h, _ in every]), entropy_norm=np.mean([h / math.log(w) for h, w in every]),
        dropped=sum(v["dropped"] for v in per_layer.values()),
        drop_rate=sum(v["dropped"] for v in per_layer.values()) / tokens, hot_layer=hot)


@pytest.fixture(scope="module")
def truth(runs) -> dict:
    return {run_id: expected(runs["root"], run_id) for run_id in ("longcat", "switch")}


def test_the_stores_are_what_the_test_needs(runs, truth):
    cat, switch = truth["longcat"], truth["switch"]
    assert all(v["width"] == 10 for v in cat["layers"].values())  # 8 routed + 2 zero experts
    assert all(v["load"][8:].sum() > 0 for v in cat["layers"].values())  # the zero experts were chosen
    assert switch["dropped"] > 0  # capacity 2 drops tokens
    # decode-heavy: the unweighted mean of per-forward means is far from the token-weighted one, for
    # entropy and for the drop rate, so a view that averaged per-step figures would fail below
    layer_steps = _rows(runs["root"], "layer_steps", "longcat")
    assert abs(layer_steps.router_entropy_mean.mean() - cat["entropy"]) > 0.05
    layer_steps = _rows(runs["root"], "layer_steps", "switch")
    assert abs((layer_steps.dropped_tokens / layer_steps.tokens).mean() - switch["drop_rate"]) > 0.05


def _summary_lines(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and (cells[0].isdigit() or cells[0] == "all") and len(cells) >= 7:
            out[cells[0]] = cells
    return out


@pytest.mark.parametrize("run_id", ["longcat", "switch"])
def test_summary_equals_the_raw_rows(runs, truth, run_id):
    want = truth[run_id]
    lines = _summary_lines(format_summary(runs["root"], run_id))
    for layer, v in want["layers"].items():
        cells = lines[str(layer)]
        assert cells == [str(layer), f"{v['tokens']:,}", f"{v['max_mean']:.2f}", f"{v['cv']:.2f}", str(v["dead"]),
                         f"{v['entropy']:.3f}", f"{v['entropy_norm']:.3f}", f"{v['dropped']:,}",
                         f"{100 * v['drop_rate']:.2f}"]
    assert lines["all"] == ["all", f"{want['layer_tokens']:,}", f"{want['cv']:.2f}", f"{want['entropy']:.3f}",
                            f"{want['entropy_norm']:.3f}", f"{want['dropped']:,}", f"{100 * want['drop_rate']:.2f}"]


@pytest.mark.parametrize("run_id", ["longcat", "switch"])
def test_prometheus_gauges_equal_the_raw_rows_and_the_summary(runs, truth, run_id):
    registry, want = runs["registries"][run_id], truth[run_id]
    for layer, v in want["layers"].items():
        label = {"layer": str(layer)}

        def gauge(name: str) -> float:
            return registry.get_sample_value(name, label)

        assert gauge("moescope_layer_router_entropy_ratio") == pytest.approx(v["entropy_norm"], rel=1e-5, abs=1e-6)
        assert gauge("moescope_layer_dropped_token_ratio") == pytest.approx(v["drop_rate"])
        assert gauge("moescope_layer_dead_expert_ratio") == pytest.approx(v["dead_fraction"])  # routed experts only
        assert gauge("moescope_layer_load_cv") == pytest.approx(v["cv"])
        assert gauge("moescope_layer_load_max_over_mean") == pytest.approx(v["max_mean"])
        assert registry.get_sample_value("moescope_layer_tokens_total", label) == v["tokens"]
        assert registry.get_sample_value("moescope_layer_dropped_tokens_total", label) == v["dropped"]
    # same label, same number: the summary's H/ln E column is the gauge, to its printed precision
    lines = _summary_lines(format_summary(runs["root"], run_id))
    for layer in want["layers"]:
        gauge = registry.get_sample_value("moescope_layer_router_entropy_ratio", {"layer": str(layer)})
        assert lines[str(layer)][6] == f"{gauge:.3f}"


def _app(monkeypatch, root: str) -> AppTest:
    monkeypatch.setenv(settings.ENV_STORE, root)
    monkeypatch.setenv(settings.ENV_ALLOW_WRITES, "0")
    monkeypatch.delenv(settings.ENV_TOKENIZER, raising=False)
    return AppTest.from_file(APP, default_timeout=240)


@pytest.mark.parametrize("run_id", ["longcat", "switch"])
def test_overview_equals_the_raw_rows_and_the_summary(monkeypatch, runs, truth, run_id):
    want = truth[run_id]
    at = _app(monkeypatch, runs["root"])
    at.run()
    at.sidebar.selectbox(key="ms_run").set_value(run_id).run()
    assert not at.exception and not at.error
    metrics = {m.label: m for m in at.metric}
    assert metrics["Tokens"].value == f"{want['step_tokens']:,}"
    assert metrics["Forwards"].value == str(want["steps"]) == str(1 + DECODE)
    assert metrics["Load spread (CV)"].value == f"{want['cv']:.3f}"
    assert metrics["Router entropy"].value == f"{want['entropy']:.3f} nats"
    captions = [c.value for c in at.caption]  # a tile's second figure is a caption under it, not a delta chip
    assert f"H / ln E = {want['entropy_norm']:.3f}" in captions
    assert metrics["Dropped tokens"].value == f"{want['dropped']:,}"
    assert f"{want['drop_rate']:.2%} of layer-tokens" in captions
    assert metrics["Alerts firing now"].value == "0"
    hot = want["layers"][want["hot_layer"]]
    text = next(m.value for m in at.markdown if m.value.startswith("Hottest expert"))
    assert (f"layer {want['hot_layer']}, expert {hot['hottest']}**, chosen by {hot['token_share']:.1%} of the "
            f"layer's tokens ({int(hot['routed'].max()):,} of {hot['tokens']:,}), {hot['slot_share']:.1%} of its "
            "routing slots") in text
    # same label, same number: the summary's 'all' row
    lines = _summary_lines(format_summary(runs["root"], run_id))
    assert metrics["Router entropy"].value.split()[0] == lines["all"][3]


def test_heatmaps_start_at_the_overviews_hottest_expert(monkeypatch, runs, truth):
    want = truth["longcat"]
    at = _app(monkeypatch, runs["root"])
    at.run()
    at.sidebar.selectbox(key="ms_run").set_value("longcat").run()
    at.switch_page("views/heatmaps.py").run()
    assert not at.exception and not at.error
    assert at.selectbox(key="hm_layer").value == want["hot_layer"]
    assert at.selectbox(key="hm_expert").value == want["layers"][want["hot_layer"]]["hottest"]


def test_compare_equals_the_raw_rows(monkeypatch, runs, truth):
    at = _app(monkeypatch, runs["root"])
    at.run()
    at.switch_page("views/compare.py").run()
    at.selectbox(key="cp_run_a").set_value("longcat").run()
    at.selectbox(key="cp_run_b").set_value("switch").run()
    assert not at.exception and not at.error
    table = at.dataframe[0].value
    for column, run_id in zip(table.columns, ("longcat", "switch")):
        want = truth[run_id]
        assert run_id[-8:] in column
        values = table[column]
        assert values["load CV (token-weighted over layers)"] == pytest.approx(want["cv"])
        assert values["router entropy (nats)"] == pytest.approx(want["entropy"], rel=1e-5, abs=1e-6)
        assert values["router entropy H / ln E"] == pytest.approx(want["entropy_norm"], rel=1e-5, abs=1e-6)
        assert values["dropped tokens (% of layer-tokens)"] == pytest.approx(100 * want["drop_rate"])

"""`moescope summary`'s per-layer figures, recomputed from the raw route and logit rows."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

import moescope
from moescope.analyses.summary import format_summary, layer_rows
from moescope.store import Store
from tests.support.zoo import tiny_model


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("summary")
    model = tiny_model("switch_transformers", expert_capacity=2)  # small capacity: some tokens drop
    g = torch.Generator().manual_seed(3)
    with moescope.attach(model, store=root, routes=True, router_logits=True) as session, torch.no_grad():
        for step in range(4):
            ids = torch.randint(0, 128, (2 + step % 2, 6), generator=g)
            with session.tag(domain="a" if step < 2 else "b"):
                model(input_ids=ids, decoder_input_ids=ids)
    return root, session.run.run_id, session.layers


def _rows(root, table):
    return ds.dataset(str(root / table), format="parquet").to_table().to_pandas()


def test_layer_figures_from_the_raw_rows(recorded):
    root, run_id, layers = recorded
    routes, logits = _rows(root, "routes"), _rows(root, "router_logits")
    rows = {r["layer"]: r for r in layer_rows(Store(root), run_id)}
    for layer in layers:
        mine = routes[routes.layer == layer.index]
        load = np.zeros(layer.num_experts)
        dropped = 0
        for ids, kept in zip(mine.expert_ids, mine.kept):
            dropped += int(not any(kept))
            for expert, k in zip(ids, kept):
                load[expert] += k
        entropies = []
        for row in logits[logits.layer == layer.index].logits:
            p = np.exp(np.asarray(row, float) - max(row))
            p /= p.sum()
            entropies.append(-sum(x * math.log(x) for x in p if x > 0))
        got = rows[layer.index]
        assert got["tokens"] == len(mine)
        assert got["max_over_mean"] == pytest.approx(load.max() / load.mean())
        assert got["load_cv"] == pytest.approx(load.std() / load.mean())
        assert got["dead_experts"] == int((load == 0).sum())
        assert got["entropy"] == pytest.approx(np.mean(entropies), rel=1e-5)
        assert got["entropy_norm"] == pytest.approx(np.mean(entropies) / math.log(layer.num_experts), rel=1e-5)
        assert got["dropped_tokens"] == dropped
    assert sum(r["dropped_tokens"] for r in rows.values()) > 0, "capacity 2 should drop tokens"


def test_printed_summary_shows_those_figures_and_the_active_fraction(recorded):
    root, run_id, _ = recorded
    text = format_summary(root, run_id)
    for r in layer_rows(Store(root), run_id):
        assert f"{r['max_over_mean']:>9.2f} {r['load_cv']:>8.2f} {r['dead_experts']:>5}" in text
    steps = _rows(root, "steps")
    active = (steps.active_params * steps.tokens).sum() / steps.tokens.sum()
    total = int(steps.total_params.iloc[0])
    assert f"active parameters per token {active:,.0f} = {100 * active / total:.1f}% of the model" in text
    b = steps[[dict(t).get("domain") == "b" for t in steps.tags]]
    share = (b.active_param_fraction * b.tokens).sum() / b.tokens.sum()
    assert f"domain=b: {len(b):,} forwards, active fraction {100 * share:.2f}%" in text


def test_an_imported_run_says_not_recorded_where_the_dashboard_does(tmp_path):
    """Issue 24: `summary` of an imported run showed "0 parameters", "dropped 0" and a 0.00% drop rate
    where the dashboard says "not recorded by this source": the same words in both."""
    import json

    from moescope.ingest.importers import import_files

    rng = np.random.default_rng(0)
    body = {"id": "r0", "model": "test-moe", "prompt_token_ids": list(range(6)),
            "prompt_routed_experts": [[sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(2)]
                                      for _ in range(6)],
            "choices": [{"index": 0, "token_ids": [7, 8, 9],
                         "routed_experts": [[sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(2)]
                                            for _ in range(2)]}]}
    path = tmp_path / "responses.jsonl"
    path.write_text(json.dumps(body) + "\n")
    root = tmp_path / "store"
    run = import_files("vllm", [str(path)], str(root), num_experts=8).run_id
    text = format_summary(root, run)
    assert "parameter counts not recorded by this source (vllm)" in text
    assert "active parameters per token not recorded by this source (vllm)" in text
    assert "router entropy and dropped tokens not recorded by this source (vllm)" in text
    assert " 0 parameters" not in text and "0.00" not in text
    table = [line.split() for line in text.splitlines()
             if line.split()[:1] in (["0"], ["1"], ["all"]) and "forwards," not in line]
    assert len(table) == 3 and all(row[-2:] == ["—", "—"] for row in table)
    assert [int(row[1].replace(",", "")) for row in table[:2]] == [8, 8]  # tokens per layer: 6 + 2 rows

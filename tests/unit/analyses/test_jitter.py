"""Routing jitter against the model's own router outputs.

The oracle here runs the model itself under each condition (its own padding, position ids, a
deep copy cast with `.to(dtype)`, a deep copy switched to another attention), reads the router
logits the model returns (`output_router_logits=True`) and takes the top-k with `torch.topk` as
Mixtral's router does; counts, margins and weight changes are then plain loops over tokens.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from moescope.analyses.jitter import BASELINE, MARGIN_EDGES, JitterError, jitter
from moescope.core.runs import current_host
from tests.support.deltafiles import snapshot_rows
from tests.support.jitter import LENGTHS, near_tied_mixtral, token_lists
from tests.support.zoo import tiny_model


def oracle(model, inputs, batch_size: int = 1, side: str = "right") -> list[list[tuple]]:
    """Per input, per layer: (logits, ids, weights) of its real tokens from the model's own router
    logits, top-k by torch.topk over the softmax and renormalised, as Mixtral's router does."""
    k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for first in range(0, len(inputs), batch_size):
            batch = inputs[first:first + batch_size]
            length = max(map(len, batch))
            ids = torch.zeros((len(batch), length), dtype=torch.long)
            mask = torch.zeros((len(batch), length), dtype=torch.long)
            for row, seq in enumerate(batch):
                start = length - len(seq) if side == "left" else 0
                ids[row, start:start + len(seq)] = torch.tensor(seq)
                mask[row, start:start + len(seq)] = 1
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's rule, written out
            result = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True,
                           use_cache=False)
            for row, seq in enumerate(batch):
                start = length - len(seq) if side == "left" else 0
                per_layer = []
                for logits in result.router_logits:
                    mine = logits.reshape(len(batch), length, -1)[row, start:start + len(seq)]
                    top, chosen = torch.topk(torch.softmax(mine.float(), dim=-1), k, dim=-1)
                    per_layer.append((mine.float().numpy(), chosen.numpy(), (top / top.sum(-1, keepdim=True)).numpy()))
                out.append(per_layer)
    return out


def expected(base, other, layers: int) -> dict[int, dict]:
    """Per layer, from two oracle runs: counts, the changed tokens and the largest weight change,
    token by token."""
    figures = {}
    for layer in range(layers):
        set_changed = top1_changed = 0
        max_weight, listed = 0.0, {}
        changed_margins, kept_margins = [], []
        for seq, (a_run, b_run) in enumerate(zip(base, other)):
            a_logits, a_ids, a_w = a_run[layer]
            b_logits, b_ids, b_w = b_run[layer]
            for pos in range(len(a_ids)):
                a_set, b_set = set(a_ids[pos].tolist()), set(b_ids[pos].tolist())
                # of the chosen experts, the highest logit; a tie (bfloat16 rounds logits together) goes to
                # the earlier slot, the router's own order
                a_top = max(a_ids[pos].tolist(), key=lambda e: a_logits[pos][e])
                b_top = max(b_ids[pos].tolist(), key=lambda e: b_logits[pos][e])
                ordered = sorted(a_logits[pos].tolist(), reverse=True)
                margin = ordered[len(a_set) - 1] - ordered[len(a_set)]
                a_weights = dict(zip(a_ids[pos].tolist(), a_w[pos].tolist()))
                b_weights = dict(zip(b_ids[pos].tolist(), b_w[pos].tolist()))
                for expert in a_set | b_set:
                    max_weight = max(max_weight, abs(a_weights.get(expert, 0.0) - b_weights.get(expert, 0.0)))
                set_changed += a_set != b_set
                top1_changed += a_top != b_top
                (changed_margins if a_set != b_set else kept_margins).append(margin)
                if a_set != b_set or a_top != b_top:
                    listed[(seq, pos)] = (a_set != b_set, a_top != b_top, margin)
        figures[layer] = dict(set_changed=set_changed, top1_changed=top1_changed, max_weight=max_weight,
                              listed=listed, changed_margins=changed_margins, kept_margins=kept_margins)
    return figures


def histogram(margins: list[float]) -> list[int]:
    counts = [0] * len(MARGIN_EDGES)
    for margin in margins:
        counts[max(i for i, edge in enumerate(MARGIN_EDGES) if margin >= edge)] += 1
    return counts


def assert_matches(report, condition: str, want: dict[int, dict], tokens: int) -> None:
    rows = report.layers[report.layers.condition == condition].set_index("layer")
    assert sorted(rows.index) == sorted(want)
    for layer, figures in want.items():
        row = rows.loc[layer]
        assert row.tokens == tokens
        assert (row.set_changed, row.top1_changed) == (figures["set_changed"], figures["top1_changed"]), condition
        assert row.kept_changed == figures["set_changed"]  # dropless: the processed experts are the chosen ones
        np.testing.assert_allclose(row.max_weight_change, figures["max_weight"], rtol=1e-6, atol=1e-12)
        assert list(row.changed_by_margin) == histogram(figures["changed_margins"])
        assert list(row.unchanged_by_margin) == histogram(figures["kept_margins"])
        listed = report.tokens[(report.tokens.condition == condition) & (report.tokens.layer == layer)]
        got = {(int(r.sequence), int(r.position)): (bool(r.set_changed), bool(r.top1_changed)) for r in
               listed.itertuples()}
        assert got == {key: value[:2] for key, value in figures["listed"].items()}
        for r in listed.itertuples():
            np.testing.assert_allclose(r.topk_margin, figures["listed"][(r.sequence, r.position)][2], rtol=1e-9)


@pytest.fixture(scope="module")
def measured():
    model = near_tied_mixtral()
    inputs = token_lists()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    report = jitter(model, inputs, batch_size=4, other_batch_size=3)
    return model, inputs, before, report


def test_bfloat16_flips_exactly_the_tokens_the_oracle_flips(measured):
    model, inputs, _, report = measured
    base = oracle(model, inputs)
    cast = oracle(copy.deepcopy(model).to(torch.bfloat16), inputs)
    want = expected(base, cast, 2)
    assert sum(f["set_changed"] for f in want.values()) > 0  # the condition was built to flip
    assert_matches(report, "bfloat16", want, sum(LENGTHS))
    flipped = report.tokens[(report.tokens.condition == "bfloat16") & report.tokens.set_changed]
    assert flipped.topk_margin.max() < 0.01  # flips sit at margins under bfloat16's rounding


@pytest.mark.parametrize("condition,batch,side,dtype,attention,compared_with", [
    ("repeat", 1, "right", None, None, (1, "right")),
    ("batch=4", 4, "right", None, None, (1, "right")),
    ("batch=4,left_pad", 4, "left", None, None, (4, "right")),
    ("batch=3", 3, "right", None, None, (1, "right")),
    ("float16", 1, "right", torch.float16, None, (1, "right")),
    ("attn=sdpa", 1, "right", None, "sdpa", (1, "right")),
])
def test_every_condition_equals_the_oracle(measured, condition, batch, side, dtype, attention, compared_with):
    model, inputs, _, report = measured
    variant = model
    if dtype is not None or attention is not None:
        variant = copy.deepcopy(model)
        if dtype is not None:
            variant.to(dtype)
        if attention is not None:
            variant.set_attn_implementation(attention)
    want = expected(oracle(model, inputs, *compared_with), oracle(variant, inputs, batch, side), 2)
    assert_matches(report, condition, want, sum(LENGTHS))
    row = report.layers[report.layers.condition == condition].iloc[0]
    assert row.baseline == ("batch=4" if condition.endswith("left_pad") else BASELINE)
    assert (row.batch_size, row.padding_side) == (batch, side)


def test_the_model_is_given_back_as_it_came(measured):
    model, _, before, _ = measured
    after = model.state_dict()
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert model.config._attn_implementation == "eager" and not model.training


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_fp32_repeats_change_nothing(family):
    model = tiny_model(family)
    inputs = token_lists(1)[:4]
    report = jitter(model, inputs, conditions=("repeat",))
    with torch.no_grad():
        routers = model(input_ids=torch.tensor([inputs[0]]), output_router_logits=True).router_logits
    assert len(report.layers) == len([t for t in routers if t is not None and t.numel()])  # every MoE layer
    assert (report.layers.tokens == sum(LENGTHS[:4])).all()
    assert (report.layers[["set_changed", "top1_changed", "kept_changed", "listed"]] == 0).all().all()
    assert (report.layers.max_weight_change == 0.0).all()
    assert report.tokens.empty


def test_results_land_in_the_store_as_measured(measured, tmp_path):
    model, inputs, _, _ = measured
    store = tmp_path / "store"
    report = jitter(model, inputs, batch_size=4, other_batch_size=3, conditions=("repeat", "dtype"),
                    dtypes=("bfloat16",), store=str(store), run_id="jit1", tags={"case": "near-tied"})
    want = expected(oracle(model, inputs), oracle(copy.deepcopy(model).to(torch.bfloat16), inputs), 2)
    rows = snapshot_rows(store, "jitter").to_pylist()
    assert {(r["run_id"], r["condition"], r["layer"]) for r in rows} == {
        ("jit1", c, layer) for c in ("repeat", "bfloat16") for layer in (0, 1)}
    for r in rows:
        figures = want[r["layer"]] if r["condition"] == "bfloat16" else None
        assert r["tokens"] == sum(LENGTHS)
        assert r["set_changed"] == (figures["set_changed"] if figures else 0)
        assert r["top1_changed"] == (figures["top1_changed"] if figures else 0)
        assert r["changed_by_margin"] == (histogram(figures["changed_margins"]) if figures else [0] * len(MARGIN_EDGES))
        assert r["margin_kind"] == "logit" and r["margin_edges"] == list(MARGIN_EDGES)
        assert r["dtype"] == ("bfloat16" if figures else "float32")
    tokens = snapshot_rows(store, "jitter_tokens").to_pylist()
    assert {(t["layer"], t["sequence"], t["position"]) for t in tokens} == {
        (layer, *key) for layer, figures in want.items() for key in figures["listed"]}
    for t in tokens:
        assert t["token_id"] == inputs[t["sequence"]][t["position"]]
        start = t["context_start"]
        assert t["context_ids"] == inputs[t["sequence"]][start:t["position"] + 5] and start <= t["position"]
    [run] = snapshot_rows(store, "runs").to_pylist()
    assert (run["run_id"], run["source"], run["model_class"], dict(run["tags"])) == (
        "jit1", "jitter", "MixtralForCausalLM", {"case": "near-tied"})
    # the model's own counts: every parameter, and those of its experts' modules (the routed experts)
    experts = [module for name, module in model.named_modules() if name.endswith(".mlp.experts")]
    assert run["total_params"] == sum(p.numel() for p in model.parameters())
    assert run["routed_expert_params"] == sum(p.numel() for module in experts for p in module.parameters()) > 0
    assert (run["rank"], run["world_size"], run["host"]) == (0, 1, current_host())
    layers = sorted(snapshot_rows(store, "layers").to_pylist(), key=lambda row: row["layer"])
    assert [(row["run_id"], row["layer"], row["module"], row["family"], row["num_experts"], row["top_k"],
             row["zero_experts"], row["params_per_expert"], row["expert_capacity"], row["rank"]) for row in layers] == [
        ("jit1", i, f"model.layers.{i}.mlp", "mixtral", model.config.num_local_experts,
         model.config.num_experts_per_tok, 0, sum(p.numel() for p in experts[i].parameters())
         // model.config.num_local_experts, None, 0) for i in range(2)]
    assert report.run_id == "jit1"


def test_the_store_query_gives_the_raw_rows_fractions(measured, tmp_path):
    from moescope.store import Store

    model, inputs, _, _ = measured
    jitter(model, inputs, conditions=("dtype",), dtypes=("bfloat16",), store=str(tmp_path), run_id="q")
    raw = snapshot_rows(tmp_path, "jitter").to_pylist()
    with Store(tmp_path) as store:
        frame = store.jitter_layers("q")
        listed = store.jitter_tokens("q", condition="bfloat16", layer=1)
    for r in raw:
        row = frame[(frame.condition == r["condition"]) & (frame.layer == r["layer"])].iloc[0]
        assert row.set_changed_fraction == r["set_changed"] / r["tokens"]
        assert row.top1_changed_fraction == r["top1_changed"] / r["tokens"]
    raw_tokens = [t for t in snapshot_rows(tmp_path, "jitter_tokens").to_pylist() if t["layer"] == 1]
    assert listed.topk_margin.tolist() == sorted(t["topk_margin"] for t in raw_tokens)


def test_bad_inputs_say_what_to_do():
    model = tiny_model("mixtral")
    with pytest.raises(JitterError, match="tokenizer"):
        jitter(model, ["a text"])
    with pytest.raises(JitterError, match="no inputs"):
        jitter(model, [])
    with pytest.raises(JitterError, match="unknown condition"):
        jitter(model, [[1, 2]], conditions=("sideways",))
    with pytest.raises(JitterError, match="encoder-decoder"):
        jitter(tiny_model("switch_transformers"), [[1, 2, 3]])


def test_padding_conditions_feed_the_model_what_they_say():
    """What the model received, read by a hook of the test's own: batches of 4 padded on the right,
    then the same batches on the left, position ids counted from each row's first real token."""
    model = near_tied_mixtral()
    inputs = token_lists()
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        {k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "position_ids")}), with_kwargs=True)
    try:
        jitter(model, inputs, conditions=("left_padding",), batch_size=4)
    finally:
        handle.remove()
    alone, right, left = seen[:8], seen[8:10], seen[10:12]
    assert len(seen) == 12 and all(s["input_ids"].shape == (1, len(x)) for s, x in zip(alone, inputs))
    for side, forwards in (("right", right), ("left", left)):
        for number, forward in enumerate(forwards):
            batch = inputs[4 * number:4 * number + 4]
            length = max(map(len, batch))
            for row, seq in enumerate(batch):
                pad = [0] * (length - len(seq))
                real = [1] * len(seq)
                assert forward["attention_mask"][row].tolist() == (real + pad if side == "right" else pad + real)
                where = forward["attention_mask"][row].bool()
                assert forward["input_ids"][row][where].tolist() == seq
                assert forward["position_ids"][row][where].tolist() == list(range(len(seq)))


def test_top1_is_the_chosen_expert_of_highest_logit_whatever_the_slot_order():
    """Families that take their top-k unsorted (DeepSeek-V3) list a token's experts in any order:
    swapped slots are neither a new set nor a new top-1; the top-1 follows the logits."""
    from moescope.analyses.jitter import compare_layer
    from moescope.probe.capture import LayerRouting

    logits = np.array([[0.1, 0.9, 0.5, 0.0], [0.1, 0.9, 0.5, 0.0]], dtype=np.float32)
    base = LayerRouting(logits, np.array([[1, 0], [1, 2]]), np.array([[0.6, 0.4], [0.5, 0.5]], np.float32),
                        np.ones((2, 2), bool))
    other = LayerRouting(logits, np.array([[0, 1], [2, 0]]), np.array([[0.4, 0.6], [0.5, 0.5]], np.float32),
                         np.array([[True, True], [True, False]]))
    figures = compare_layer(base, other, 2)
    assert figures["set_changed"].tolist() == [False, True]
    assert figures["top1_changed"].tolist() == [False, True]  # token 1: expert 1 before, expert 2 (0.5 > 0.1) after
    assert figures["kept_changed"].tolist() == [False, True]
    assert figures["max_weight_change"] == 0.5  # token 1: expert 1's 0.5 vanished
    np.testing.assert_allclose(figures["topk_margin"], [0.4, 0.4], rtol=1e-6)  # 0.5 - 0.1: the 2nd minus the 3rd


def test_margin_bins_hold_their_lower_edge():
    from moescope.analyses.jitter import margin_histogram

    counts = margin_histogram(np.array([0.0, 1e-4, 9.99e-5, 0.5, 3.0, np.inf]))
    want = [0] * len(MARGIN_EDGES)
    for index in (0, 1, 0, MARGIN_EDGES.index(0.3), MARGIN_EDGES.index(3.0), len(MARGIN_EDGES) - 1):
        want[index] += 1
    assert counts.tolist() == want

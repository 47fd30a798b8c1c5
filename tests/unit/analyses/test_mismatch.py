"""Engine vs reference routing, against the model's own router outputs and a brute-force loop.

The engine is a STAND-IN (tests/support/engine_standin.py: vLLM and SGLang cannot run here): the
same near-tied Mixtral cast to bfloat16 and run in left-padded batches of three, its routing
written in vLLM's and SGLang's response formats and read back by the real importers. The oracle
is the float32 model run on each sequence alone, read from `output_router_logits`; every expected
figure is a plain loop over the two routings, compared with the raw Parquet rows the check wrote.
"""

from __future__ import annotations

import numpy as np
import pytest

from moescope.analyses.jitter import MARGIN_EDGES
from moescope.analyses.mismatch import MismatchError, mismatch
from moescope.ingest.importers import import_files
from tests.support.deltafiles import snapshot_rows
from tests.support.engine_standin import (
    engine_standin,
    fed,
    routed,
    sglang_responses,
    token_sequences,
    vllm_responses,
)
from tests.support.jitter import near_tied_mixtral

K = 2
BUCKETS = [0, 16, 32, 64, 128]  # the check's first position buckets, written out


@pytest.fixture(scope="module")
def setup():
    model = near_tied_mixtral()
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    sequences = {key: fed(requests[key[0]][0], requests[key[0]][1][key[1]]) for key in keys}
    engine = dict(zip(keys, engine_standin(model, [sequences[key] for key in keys])))
    oracle = {key: routed(model, [sequences[key]])[0] for key in keys}
    return model, requests, sequences, engine, oracle


def _margin_bin(value: float) -> int:
    return max(i for i, edge in enumerate(MARGIN_EDGES) if value >= edge)


def _bucket(position: int) -> str:
    low = max(edge for edge in BUCKETS if position >= edge)
    return f"{low}-{BUCKETS[BUCKETS.index(low) + 1] - 1}"


def brute_force(compared: list[tuple[tuple, int, int]], sequences, engine, oracle, layers: int,
                tag: str | None = None) -> dict:
    """Figures keyed (grouping, group_name, layer or None) from (key, first, end) spans of positions
    compared: a loop over tokens and layers; `tag` (key=value) a tag every step carries."""
    figures: dict = {}
    pairs_listed = {}

    def add(group, layer, set_changed, top1_changed, slots, margin):
        f = figures.setdefault(group + (layer,), dict(pairs=0, set_changed=0, top1_changed=0, slots_changed=0,
                                                       by_count=[0] * (K + 1), changed=[0] * len(MARGIN_EDGES),
                                                       unchanged=[0] * len(MARGIN_EDGES), tokens=0,
                                                       tokens_set_changed=0, tokens_top1_changed=0))
        f["pairs"] += 1
        f["set_changed"] += set_changed
        f["top1_changed"] += top1_changed
        f["slots_changed"] += slots
        f["by_count"][slots] += 1
        f["changed" if set_changed else "unchanged"][_margin_bin(margin)] += 1

    for key, first, end in compared:
        ref_ids, logits = oracle[key]
        for position in range(first, end):
            groups = [("all", "all"), ("position", _bucket(position))] + ([("tag", tag)] if tag else [])
            any_set = any_top1 = False
            for layer in range(layers):
                e = [int(v) for v in engine[key][position, layer]]
                r = [int(v) for v in ref_ids[position, layer]]
                row = logits[position, layer]
                ref_top1 = max(r, key=lambda expert: row[expert])
                ordered = sorted(row, reverse=True)
                margin = ordered[K - 1] - ordered[K]
                set_changed, top1_changed = set(e) != set(r), e[0] != ref_top1
                slots = K - len(set(e) & set(r))
                any_set |= set_changed
                any_top1 |= top1_changed
                for group in groups:
                    for lay in (layer, None):
                        add(group, lay, set_changed, top1_changed, slots, margin)
                    f = figures[group + (layer,)]
                    f["tokens"] += 1
                    f["tokens_set_changed"] += set_changed
                    f["tokens_top1_changed"] += top1_changed
                if set_changed or top1_changed:
                    pairs_listed[(key, position, layer)] = (margin, e, r)
            for group in groups:
                f = figures[group + (None,)]
                f["tokens"] += 1
                f["tokens_set_changed"] += any_set
                f["tokens_top1_changed"] += any_top1
    return {"figures": figures, "listed": pairs_listed}


def check_rows(rows: list[dict], want: dict) -> None:
    got = {(r["grouping"], r["group_name"], r["layer"]): r for r in rows}
    assert set(got) == set(want["figures"])
    for key, f in want["figures"].items():
        r = got[key]
        assert (r["pairs"], r["tokens"], r["set_changed"], r["top1_changed"], r["slots_changed"],
                r["tokens_set_changed"], r["tokens_top1_changed"]) == (
            f["pairs"], f["tokens"], f["set_changed"], f["top1_changed"], f["slots_changed"], f["tokens_set_changed"],
            f["tokens_top1_changed"]), key
        assert r["changed_by_count"] == f["by_count"], key
        assert (r["changed_by_margin"], r["unchanged_by_margin"]) == (f["changed"], f["unchanged"]), key


def test_vllm_responses_of_a_bfloat16_engine_match_a_brute_force_loop(setup, tmp_path):
    model, requests, sequences, engine, oracle = setup
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, engine))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    report = mismatch(model, store=tmp_path / "store", run="engine", batch_size=1, run_id="mm")

    # vLLM routes a prompt once: its rows are compared in choice 0, each choice's own rows after it
    compared = []
    for r, (prompt, generated) in enumerate(requests):
        for c in range(len(generated)):
            compared.append(((r, c), 0 if c == 0 else len(prompt), len(sequences[(r, c)])))
    want = brute_force(compared, sequences, engine, oracle, layers=2)
    overall = want["figures"][("all", "all", None)]
    assert 0 < overall["set_changed"] < overall["pairs"]  # the stand-in does flip some, not all
    check_rows(snapshot_rows(tmp_path / "store", "mismatch").to_pylist(), want)
    assert report.token_share == overall["tokens_set_changed"] / overall["tokens"]
    assert report.decision_share == overall["set_changed"] / overall["pairs"]

    # every listed pair is one that differs, its margin the one from the model's own logits
    listed = snapshot_rows(tmp_path / "store", "mismatch_tokens").to_pylist()
    assert len(listed) == len(want["listed"])
    for t in listed:
        key = (t["step"], t["sequence"])  # one step per request; choice c is sequence c
        margin, e, r = want["listed"][(key, t["position"], t["layer"])]
        np.testing.assert_allclose(t["topk_margin"], margin, rtol=1e-6)
        assert (t["engine_ids"], sorted(t["reference_ids"])) == (e, sorted(r))
        assert t["token_id"] == sequences[key][t["position"]]
        assert t["context_ids"] == sequences[key][t["context_start"]:t["position"] + 5]

    # the results are a run of their own, naming the engine's
    run = snapshot_rows(tmp_path / "store", "runs").to_pylist()
    mm = next(row for row in run if row["run_id"] == "mm")
    assert mm["source"] == "mismatch" and dict(mm["tags"])["engine_run"] == "engine"


def test_replay_arrays_are_the_engines_routing_with_a_shared_prompt_filled_in(setup, tmp_path):
    model, requests, sequences, engine, oracle = setup
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, engine))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    report = mismatch(model, store=tmp_path / "store", run="engine", batch_size=4, write=False)
    assert len(report.replay) == len(sequences)
    for seq in report.replay:
        key = (seq.step, seq.sequence)
        prompt = requests[key[0]][0]
        want = np.concatenate([engine[(key[0], 0)][:len(prompt)], engine[key][len(prompt):]])
        assert seq.expert_ids.dtype == np.int16 and seq.expert_ids.shape == (len(sequences[key]), 2, K)
        np.testing.assert_array_equal(seq.expert_ids, want)
        assert seq.token_ids.tolist() == sequences[key]
        assert seq.own_from == (0 if key[1] == 0 else len(prompt))


def test_sglang_responses_with_the_prompt_ids_given_beside_them(setup, tmp_path):
    model, requests, sequences, engine, oracle = setup
    path = tmp_path / "sglang.jsonl"
    path.write_text(sglang_responses(requests, engine))
    import_files("sglang", [str(path)], tmp_path / "store", run_id="engine", num_layers=2, top_k=K,
                 tags={"policy": "v3"})
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    with pytest.raises(MismatchError, match="--token-ids"):
        mismatch(model, store=tmp_path / "store", run="engine", write=False)
    given = {(step, 0): sequences[key] for step, key in enumerate(keys)}  # a step per request, in file order
    mismatch(model, store=tmp_path / "store", run="engine", token_ids=given, batch_size=1, run_id="mm")
    # SGLang runs every request's prompt: each is compared whole
    want = brute_force([(key, 0, len(sequences[key])) for key in keys], sequences, engine, oracle, layers=2,
                       tag="policy=v3")
    check_rows(snapshot_rows(tmp_path / "store", "mismatch").to_pylist(), want)


def test_an_engine_that_routes_like_the_reference_shows_no_mismatch(setup, tmp_path):
    model, requests, sequences, engine, oracle = setup
    same = {key: ids for key, (ids, _) in oracle.items()}
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, same))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    report = mismatch(model, store=tmp_path / "store", run="engine", batch_size=1, write=False)
    assert report.decision_share == 0 and report.token_share == 0 and report.tokens.empty


def test_batched_reference_feeds_each_token_the_position_the_engine_gave_it(setup, tmp_path):
    """Read by a hook of the test's own: right-padded batches of four, every real token at its
    position in its sequence, and the whole position tensor the one transformers' generate builds
    from the same mask (pads at 0)."""
    import torch

    model, requests, sequences, engine, oracle = setup
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, engine))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        {k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "position_ids")}), with_kwargs=True)
    try:
        mismatch(model, store=tmp_path / "store", run="engine", batch_size=4, write=False)
    finally:
        handle.remove()
    assert len(seen) == 2
    fed_rows = [row for forward in seen for row in zip(forward["input_ids"], forward["attention_mask"],
                                                        forward["position_ids"])]
    by_ids = {tuple(seq): seq for seq in sequences.values()}
    assert len(fed_rows) == len(sequences)
    for ids, mask, positions in fed_rows:
        real = mask.bool()
        assert tuple(ids[real].tolist()) in by_ids
        assert positions[real].tolist() == list(range(int(real.sum())))
    for forward in seen:
        want = model._prepare_position_ids_for_generation(forward["input_ids"],
                                                          {"attention_mask": forward["attention_mask"]})
        assert torch.equal(forward["position_ids"], want)


def test_engine_layers_numbered_among_every_hidden_layer_map_to_the_moe_layers():
    """DeepSeek-V3's first layer is dense: SGLang numbers its MoE layers 1 and 2, the probe 0 and 1."""
    from moescope.analyses.mismatch import layer_map
    from moescope.probe.adapters import find_moe_layers
    from tests.support.zoo import tiny_model

    model = tiny_model("deepseek_v3")
    layers = find_moe_layers(model)
    assert [layer.index for layer in layers] == [0, 1]
    assert layer_map([1, 2], layers, model.config.num_hidden_layers) == {0: 0, 1: 1}
    assert layer_map([0, 1], layers, model.config.num_hidden_layers) == {0: 0, 1: 1}
    assert layer_map([2], layers, model.config.num_hidden_layers, "hidden") == {1: 0}
    with pytest.raises(MismatchError, match="is it the engine's model"):
        layer_map([5], layers, model.config.num_hidden_layers)


def test_prefix_cache_hits_are_skipped_unless_their_ids_are_given(setup, tmp_path):
    """vLLM marks a prompt's cached rows -1 and the import leaves them out with their token ids: the
    sequences that need them are skipped and counted, and re-run once their ids are given, the
    cached rows not compared (the engine has no routing for them)."""
    model, requests, sequences, engine, oracle = setup
    cached = dict(engine)
    cached[(0, 0)] = engine[(0, 0)].copy()
    cached[(0, 0)][:3] = -1
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, cached))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    report = mismatch(model, store=tmp_path / "store", run="engine", batch_size=1, write=False)
    assert sum(report.skipped.values()) == 2 and all("--token-ids" in reason for reason in report.skipped)
    assert {(s.step, s.sequence) for s in report.replay} == set(sequences) - {(0, 0), (0, 1)}

    given = {(0, 0): sequences[(0, 0)], (0, 1): sequences[(0, 1)]}
    mismatch(model, store=tmp_path / "store", run="engine", token_ids=given, batch_size=1, run_id="mm")
    compared = []
    for r, (prompt, generated) in enumerate(requests):
        for c in range(len(generated)):
            compared.append(((r, c), (3 if r == 0 else 0) if c == 0 else len(prompt), len(sequences[(r, c)])))
    want = brute_force(compared, sequences, cached, oracle, layers=2)
    check_rows(snapshot_rows(tmp_path / "store", "mismatch").to_pylist(), want)


def _vllm_run(setup, tmp_path) -> tuple:
    """The stand-in's routing imported from vLLM responses, and the (key, first, end) spans it compares."""
    model, requests, sequences, engine, oracle = setup
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, engine))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    compared = [((r, c), 0 if c == 0 else len(prompt), len(sequences[(r, c)]))
                for r, (prompt, generated) in enumerate(requests) for c in range(len(generated))]
    return tmp_path / "store", compared


def test_the_share_of_expert_slots_that_differ_is_of_the_pairs_k_slots(setup, tmp_path):
    """slots_changed_fraction (the command's, the report's and the stored figures' "experts differ") counts
    the engine's experts the reference did not choose over pairs x k slots, not over pairs (issue 46 part 6)."""
    import pandas as pd

    from moescope.store import Store

    model, requests, sequences, engine, oracle = setup
    store, compared = _vllm_run(setup, tmp_path)
    report = mismatch(model, store=store, run="engine", batch_size=1, run_id="mm")
    want = brute_force(compared, sequences, engine, oracle, layers=2)["figures"]
    with Store(store) as opened:
        stored = opened.mismatch_layers("mm")  # what the dashboard's Mismatch page shows
    for frame in (report.groups, stored):
        assert len(frame) == len(want)
        for row in frame.itertuples():
            f = want[(row.grouping, row.group_name, None if pd.isna(row.layer) else int(row.layer))]
            assert row.slots_changed_fraction == pytest.approx(f["slots_changed"] / (f["pairs"] * K))
    assert want[("all", "all", None)]["slots_changed"] > 0  # a mix-up of the denominators shows


@pytest.mark.parametrize("max_listed", [1, 3])
def test_max_listed_bounds_the_listed_pairs_of_each_layer(setup, tmp_path, max_listed):
    """At most max_listed differing pairs per layer over the whole run, the first ones in the engine's
    order of sequences, not max_listed for each sequence (issue 46 part 6)."""
    model, requests, sequences, engine, oracle = setup
    store, compared = _vllm_run(setup, tmp_path)
    report = mismatch(model, store=store, run="engine", batch_size=1, write=False, max_listed=max_listed)
    differing = brute_force(compared, sequences, engine, oracle, layers=2)["listed"]
    for layer in range(2):
        in_layer = [(key, position) for key, position, lay in differing if lay == layer]
        with_a_difference = {key for key, _ in in_layer}
        assert len(with_a_difference) > 1 and len(in_layer) > max_listed  # per sequence would list more
        listed = report.tokens[report.tokens.layer == layer]
        assert len(listed) == max_listed
        assert all(((t.step, t.sequence), t.position) in in_layer for t in listed.itertuples())
    assert report.overall().listed == 2 * max_listed


def test_max_sequences_compares_that_many_sequences(setup, tmp_path):
    model, requests, sequences, engine, oracle = setup
    store, _ = _vllm_run(setup, tmp_path)
    report = mismatch(model, store=store, run="engine", batch_size=1, write=False, max_sequences=1)
    assert [(s.step, s.sequence) for s in report.replay] == [(0, 0)]  # request 0's first choice: step 0
    want = brute_force([((0, 0), 0, len(sequences[(0, 0)]))], sequences, engine, oracle, layers=2)
    assert report.overall().pairs == want["figures"][("all", "all", None)]["pairs"] == len(sequences[(0, 0)]) * 2

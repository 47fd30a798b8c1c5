"""The log-prob gap attributed to routing, against engine STAND-INs whose only difference is known.

vLLM and SGLang cannot run here: the engines are STAND-INs (tests/support/engine_standin.py) — the
reference Mixtral itself, each sequence alone, with (a) one router layer perturbed (it chooses its
first and third expert; weights by Mixtral's own rule from the same scores), or (b) cast to
bfloat16 with identical routing. Their routing and log-probs are written as vLLM completions
responses and read back by the real importer. Every expected figure is a plain loop over the
tokens: the reference's log-probs from its own logits (each sequence alone, float32), the engine's
from the stand-in, k3 / |Δ| / Δ² / extreme shares by hand, compared with the raw Parquet rows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import moescope
from tests.support.deltafiles import snapshot_rows
from tests.support.engine_standin import first_and_third, logprob_engine, routing_sensitive_mixtral, standin_run

PERTURBED = 1  # the router layer the first stand-in perturbs


def _reference(model, full, first):
    """Per key: the reference's own routing (tokens, layers, k) and log-probs of tokens first.., each
    sequence alone in float32: the stand-in with nothing changed."""
    return dict(zip(full, standin_run(model, list(full.values()), [first[k] for k in full])))


def _k3(d):
    return math.exp(-d) - 1 + d


def _brute(deltas):
    n = len(deltas)
    return dict(tokens=n, k3_mean=sum(_k3(d) for d in deltas) / n, abs_mean=sum(abs(d) for d in deltas) / n,
                sq_mean=sum(d * d for d in deltas) / n,
                extreme_2=sum(abs(d) > math.log(2) for d in deltas) / n,
                extreme_5=sum(abs(d) > math.log(5) for d in deltas) / n)


def _rows(root, routing, left_out=None):
    rows = snapshot_rows(root, "mismatch_logprob_gap").to_pylist()
    return {(r["grouping"], r["group_name"]): r for r in rows
            if r["routing"] == routing and r["left_out_layer"] == left_out}


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    model = routing_sensitive_mixtral()
    tmp = tmp_path_factory.mktemp("perturbed")
    root, requests, full, routing, logprobs = logprob_engine(model, str(tmp), choose={PERTURBED: first_and_third})
    first = {k: len(requests[k[0]][0]) for k in full}
    report = moescope.mismatch(model, store=root, run="engine", run_id="mm", per_layer=True,
                               batch_size=1)  # each sequence alone, as the oracle runs it
    return model, root, requests, full, routing, logprobs, first, report


def test_every_figure_is_a_loop_over_the_tokens(perturbed):
    model, root, requests, full, routing, logprobs, first, _ = perturbed
    own = _reference(model, full, first)
    deltas, flips = [], []
    for key in full:
        ref_ids, ref_logp = own[key]
        for j, value in enumerate(logprobs[key]):
            p = first[key] + j
            deltas.append(ref_logp[j] - value)
            flips.append(sum(set(routing[key][p - 1, layer].tolist()) != set(ref_ids[p - 1, layer].tolist())
                             for layer in range(routing[key].shape[1])))
    rows = _rows(root, "reference")
    expected = _brute(deltas)
    for name, value in expected.items():
        assert rows[("all", "all")][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert expected["k3_mean"] > 1e-4  # the perturbed router moves log-probs: there is a gap to attribute
    for bucket, members in (("0", [d for d, f in zip(deltas, flips) if f == 0]),
                            ("1", [d for d, f in zip(deltas, flips) if f == 1])):
        if members:
            assert rows[("flips", bucket)]["tokens"] == len(members)
            assert rows[("flips", bucket)]["k3_mean"] == pytest.approx(_brute(members)["k3_mean"], rel=1e-6, abs=1e-9)
    assert sum(r["tokens"] for (g, _), r in rows.items() if g == "flips") == len(deltas)


def test_replay_closes_a_gap_that_only_routing_made(perturbed):
    *_, report = perturbed
    own, replay = report.gap.figures("reference"), report.gap.figures("replay")
    assert own.k3_mean > 1e-4
    assert replay.k3_mean < 1e-9  # float32 noise: the engine is the reference routed as the engine routed
    assert replay.abs_mean < 1e-4
    assert report.gap.removed_share == pytest.approx(1.0, abs=1e-5)


def test_per_layer_names_the_perturbed_layer(perturbed):
    _, root, *_, report = perturbed
    carried = report.gap.carried()
    assert int(carried.layer.iloc[0]) == PERTURBED
    assert carried.carried_share.iloc[0] == pytest.approx(1.0, abs=1e-4)
    assert carried.carried_share.iloc[1:].abs().max() < 1e-4
    but_perturbed = _rows(root, "replay-but-layer", PERTURBED)[("all", "all")]
    assert but_perturbed["k3_mean"] == pytest.approx(report.gap.figures("reference").k3_mean, rel=1e-4)
    assert f"layer {PERTURBED} (100%)" in report.gap.line()


def test_precision_alone_replay_changes_nothing(tmp_path):
    model = routing_sensitive_mixtral()
    with torch.no_grad():  # decisive routers: top-2 margins far beyond bfloat16's resolution
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(100)
    root, requests, full, routing, logprobs = logprob_engine(model, str(tmp_path), dtype=torch.bfloat16)
    first = {k: len(requests[k[0]][0]) for k in full}
    own = _reference(model, full, first)
    assert all(np.array_equal(np.sort(routing[k], -1), np.sort(own[k][0][:len(full[k]) - 1], -1)) for k in full), \
        "the stand-in must route as the reference does for this oracle"
    report = moescope.mismatch(model, store=root, run="engine", run_id="mm", batch_size=1)
    own_row, replay_row = _rows(root, "reference")[("all", "all")], _rows(root, "replay")[("all", "all")]
    deltas = [own[k][1][j] - v for k in full for j, v in enumerate(logprobs[k])]
    assert own_row["k3_mean"] == pytest.approx(_brute(deltas)["k3_mean"], rel=1e-4)  # float32 noise of Δ ~ 1e-7
    assert own_row["k3_mean"] > 0  # bfloat16 moves log-probs
    for name in ("k3_mean", "abs_mean", "sq_mean", "extreme_2", "extreme_5"):
        assert replay_row[name] == pytest.approx(own_row[name], rel=1e-5, abs=1e-12), name
    assert abs(report.gap.removed_share) < 1e-4

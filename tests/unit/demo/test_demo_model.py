"""The committed demo model, its training script, its data and the specialisation measure.

The active-parameter figures of the model card are recomputed here from the model's own router
logits (`output_router_logits`) by a plain loop over each sequence's (token, slot) assignments,
not through `moescope.demo.capacity`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from moescope.demo import data as demo_data
from moescope.demo import specialisation
from moescope.demo import train as train_demo
from moescope.demo.capacity import CapacityMoeBlock, capacity_blocks
from moescope.demo.data import DOMAINS, demo_model_path, domain_documents, domain_texts, domain_windows, load_demo_model
from moescope.metrics.signals import normalized_mutual_information

# The published shape, as the model card states it.
CLAIMED_SHAPE = {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 192, "num_local_experts": 8,
                 "num_experts_per_tok": 2, "vocab_size": 2048}
# Texts per domain for the specialisation figures: the same set the model card reports.
CARD_TEXTS_PER_DOMAIN = 60
# Measured on the committed checkpoint (see its README), trained vs random weights per layer:
# 0.169/0.062, 0.546/0.091, 0.607/0.143, 0.299/0.148. The first layer routes mostly by token
# identity and leads random weights by 0.11; the others by 0.15 or more. The thresholds sit below
# those figures so they hold for the committed weights and fail for an untrained model.
NMI_MARGIN_EVERY_LAYER = 0.1
NMI_MARGIN_MEAN = 0.25
# The active-parameter fraction (shares of all parameters), measured: code 31.06%, prose 30.14%,
# math 27.13% (3.93 points apart; issue 14 asks for 3), and 35.06% -> 24.94% from the first
# quarter of a 128-token input to the last.
DOMAIN_GAP_MIN = 0.03
POSITION_DRIFT_MIN = 0.05


@pytest.fixture(scope="module")
def demo() -> tuple:
    torch.set_num_threads(2)
    return load_demo_model()


@pytest.fixture(scope="module")
def card_texts() -> dict[str, list[str]]:
    return {domain: domain_texts(domain, CARD_TEXTS_PER_DOMAIN, seed=0) for domain in DOMAINS}


@pytest.fixture(scope="module")
def demo_report(demo, card_texts) -> specialisation.SpecialisationReport:
    model, tokenizer = demo
    return specialisation.measure_specialisation(model, tokenizer, card_texts, random_seed=0)


def test_committed_checkpoint_loads_offline_with_the_claimed_shape(demo, monkeypatch):
    from transformers import MixtralForCausalLM, PreTrainedTokenizerFast

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = demo
    assert isinstance(model, MixtralForCausalLM)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    for name, value in CLAIMED_SHAPE.items():
        assert getattr(model.config, name) == value, name
    assert len(tokenizer) == model.config.vocab_size
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    weights = demo_model_path() / "model.safetensors"
    assert weights.stat().st_size < 15 * 2**20
    assert not model.training
    # Loading again through the plain transformers entry point works the same, offline, but dropless.
    again = MixtralForCausalLM.from_pretrained(demo_model_path(), local_files_only=True)
    assert torch.equal(again.model.layers[0].mlp.gate.weight, model.model.layers[0].mlp.gate.weight)
    assert not capacity_blocks(again)


def test_the_checkpoint_runs_with_the_capacity_it_was_trained_with(demo):
    model, _ = demo
    summary = json.loads((demo_model_path() / "training_summary.json").read_text())
    factor = summary["recipe"]["capacity_factor"]
    assert json.loads((demo_model_path() / "config.json").read_text())["capacity_factor"] == factor
    blocks = capacity_blocks(model)
    assert len(blocks) == CLAIMED_SHAPE["num_hidden_layers"]
    assert all(isinstance(b, CapacityMoeBlock) and b.capacity_factor == factor for b in blocks)
    card = (demo_model_path() / "README.md").read_text()
    assert f"capacity_factor: {factor}" in card and "from_pretrained" in card


def test_committed_model_has_learnt_each_domain(demo):
    model, tokenizer = demo
    summary = json.loads((demo_model_path() / "training_summary.json").read_text())
    # A model that learnt nothing sits at log(vocab) ~ 7.6 nats per token; measured 4.0 or less.
    assert all(loss < 4.5 for loss in summary["held_out_loss"].values()), summary["held_out_loss"]
    ids = tokenizer("41 + 8 = 49\n12 + 30 =", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    continuation = tokenizer.decode(generated[0, ids.shape[1]:])
    assert continuation.strip()[:1].isdigit(), continuation


def test_tokenizer_splits_numbers_into_digits(demo):
    _, tokenizer = demo
    text = "3141 + 59 = 3200\nx = f(2026)"
    pieces = [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert all(sum(ch.isdigit() for ch in piece) <= 1 for piece in pieces), pieces
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == list("314159" "3200" "2026")


def test_tokenizer_round_trips_text(demo):
    _, tokenizer = demo
    samples = [domain_texts(domain, 3, seed=5)[i] for domain in DOMAINS for i in range(3)]
    samples += ["  leading spaces, tabs\tand\nnewlines\n\n", "naïve café – ünïcode ✓ 漢字 🙂", ""]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_trained_routing_is_far_more_specialised_than_random(demo_report):
    assert len(demo_report.trained_nmi) == CLAIMED_SHAPE["num_hidden_layers"]
    pairs = list(zip(demo_report.trained_nmi, demo_report.random_nmi))
    for layer, (trained, random_weights) in enumerate(pairs):
        assert trained > random_weights + NMI_MARGIN_EVERY_LAYER, (layer, trained, random_weights)
    assert np.mean(demo_report.trained_nmi) > np.mean(demo_report.random_nmi) + NMI_MARGIN_MEAN
    # The goal: the middle layers route by domain, NMI 0.3 or more.
    assert min(demo_report.trained_nmi[1:-1]) >= 0.3, demo_report.trained_nmi


def test_model_card_figures_are_reproduced(demo_report):
    figures = json.loads((demo_model_path() / "training_summary.json").read_text())["specialisation"]
    assert figures["texts_per_domain"] == CARD_TEXTS_PER_DOMAIN
    assert figures["tokens_per_domain"] == demo_report.tokens_per_domain
    np.testing.assert_allclose(figures["trained_nmi"], demo_report.trained_nmi, atol=2e-3)
    np.testing.assert_allclose(figures["random_nmi"], demo_report.random_nmi, atol=2e-3)
    card = (demo_model_path() / "README.md").read_text()
    for trained, random_weights in zip(figures["trained_nmi"], figures["random_nmi"]):
        assert f"| {trained:.3f} | {random_weights:.3f} |" in card


def test_hooked_top1_matches_the_models_own_router_logits(demo):
    model, tokenizer = demo
    texts = {domain: domain_texts(domain, 2, seed=9, max_chars=120) for domain in DOMAINS}
    counts = specialisation.domain_expert_counts(model, tokenizer, texts)
    expected = np.zeros_like(counts)
    for domain_index, domain_texts_ in enumerate(texts.values()):
        for text in domain_texts_:
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                router_logits = model(input_ids=ids, output_router_logits=True).router_logits
            for layer, logits in enumerate(router_logits):
                expected[layer, domain_index] += np.bincount(logits.argmax(-1).numpy(), minlength=counts.shape[2])
    np.testing.assert_array_equal(counts, expected)


def _kept_slots(logits: np.ndarray, factor: float, top_k: int) -> np.ndarray:
    """Slots each token of ONE sequence kept in one layer, from that layer's router logits (seq, E):
    top-k of the softmax, every first choice placed before any second choice, earlier positions
    first, at most ceil(factor * seq * k / E) per expert."""
    seq, experts = logits.shape
    capacity = math.ceil(factor * seq * top_k / experts)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]  # softmax keeps the logits' order
    taken = [0] * experts
    kept = np.zeros(seq, dtype=np.int64)
    for slot in range(top_k):
        for position in range(seq):
            expert = order[position, slot]
            if taken[expert] < capacity:
                taken[expert] += 1
                kept[position] += 1
    return kept


@pytest.fixture(scope="module")
def brute_force_fractions(demo) -> dict[str, np.ndarray]:
    """Per domain, (inputs, positions) share of all parameters each token of the card's inputs used,
    from the model's own router logits and the parameter counts of its modules."""
    model, tokenizer = demo
    summary = json.loads((demo_model_path() / "training_summary.json").read_text())
    recipe, profile = summary["recipe"], summary["active_fraction"]
    total = sum(p.numel() for p in model.parameters())
    per_expert = [sum(p.numel() for p in layer.mlp.experts.parameters()) // recipe["num_local_experts"]
                  for layer in model.model.layers]
    shared = total - recipe["num_local_experts"] * sum(per_expert)
    fractions = {}
    for domain in DOMAINS:
        rows = domain_windows(tokenizer, domain, profile["windows_per_domain"], profile["length"], seed=0)
        out = []
        for row in rows:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([row]), output_router_logits=True).router_logits
            used = np.full(len(row), float(shared))
            for layer_logits, params in zip(logits, per_expert):
                used += _kept_slots(layer_logits.numpy(), recipe["capacity_factor"],
                                    recipe["num_experts_per_tok"]) * params
            out.append(used / total)
        fractions[domain] = np.array(out)
    return fractions


def test_active_fraction_figures_are_reproduced_by_brute_force(demo, brute_force_fractions):
    model, _ = demo
    profile = json.loads((demo_model_path() / "training_summary.json").read_text())["active_fraction"]
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    assert profile["shared_fraction"] == pytest.approx((total - experts) / total, abs=1e-5)
    assert profile["dropless_fraction"] == pytest.approx((total - experts + experts * 2 / 8) / total, abs=1e-5)
    for domain, fractions in brute_force_fractions.items():
        assert profile["by_domain"][domain] == pytest.approx(fractions.mean(), abs=2e-5)
        for (a, b), figure in zip(profile["position_buckets"], profile["by_domain_position"][domain]):
            assert figure == pytest.approx(fractions[:, a:b].mean(), abs=2e-5)
    every = np.concatenate(list(brute_force_fractions.values()))
    for (a, b), figure in zip(profile["position_buckets"], profile["by_position"]):
        assert figure == pytest.approx(every[:, a:b].mean(), abs=2e-5)
    card = (demo_model_path() / "README.md").read_text()
    for domain in DOMAINS:
        assert f"| {domain} | {100 * profile['by_domain'][domain]:.2f}% |" in card


def test_the_active_fraction_moves_with_the_domain_and_the_position(brute_force_fractions):
    """On the brute-force figures: domains apart (DOMAIN_GAP_MIN), and the share falling from each
    quarter of the input to the next."""
    by_domain = {d: f.mean() for d, f in brute_force_fractions.items()}
    assert max(by_domain.values()) - min(by_domain.values()) >= DOMAIN_GAP_MIN, by_domain
    every = np.concatenate(list(brute_force_fractions.values()))
    quarters = [q.mean() for q in np.array_split(every, 4, axis=1)]
    assert all(a > b for a, b in zip(quarters, quarters[1:])), quarters
    assert quarters[0] - quarters[-1] >= POSITION_DRIFT_MIN, quarters
    dropless = json.loads((demo_model_path() / "training_summary.json").read_text())["active_fraction"][
        "dropless_fraction"]
    assert every.max() == pytest.approx(dropless, abs=1e-5), "some token keeps all its slots, none more"


def test_decoding_one_token_at_a_time_never_drops(demo):
    model, tokenizer = demo
    kept_per_decode_step = []
    handles = [block.register_forward_hook(lambda m, a, o: kept_per_decode_step.append(
        (m.dispatch.kept.shape[0], bool(m.dispatch.kept.all())))) for block in capacity_blocks(model)]
    try:
        ids = tokenizer(domain_texts("prose", 1, seed=4, max_chars=200), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    decode = [all_kept for tokens, all_kept in kept_per_decode_step if tokens == 1]
    assert len(decode) == 3 * CLAIMED_SHAPE["num_hidden_layers"] and all(decode)
    assert not all(all_kept for tokens, all_kept in kept_per_decode_step if tokens > 1), "the prompt should drop"


def _brute_force_nmi(labels_a: list[int], labels_b: list[int]) -> float:
    """NMI straight from the definitions, one pair of labels at a time (arithmetic-mean normalisation)."""
    n = len(labels_a)
    pairs = Counter(zip(labels_a, labels_b))
    count_a, count_b = Counter(labels_a), Counter(labels_b)
    mutual_info = sum(c / n * math.log((c / n) / (count_a[a] / n * count_b[b] / n)) for (a, b), c in pairs.items())
    entropy_a = -sum(c / n * math.log(c / n) for c in count_a.values())
    entropy_b = -sum(c / n * math.log(c / n) for c in count_b.values())
    if entropy_a == entropy_b == 0:
        return 1.0
    if mutual_info <= 1e-15:
        return 0.0
    return mutual_info / ((entropy_a + entropy_b) / 2)


def test_nmi_equals_the_oracles():
    sklearn_nmi = None
    try:
        from sklearn.metrics import normalized_mutual_info_score as sklearn_nmi
    except ImportError:
        pass
    rng = random.Random(0)
    for case in range(150):
        size = rng.randint(1, 200)
        labels_a = [rng.randrange(rng.randint(1, 4)) for _ in range(size)]
        if case % 3 == 0:
            labels_b = [rng.randrange(8) for _ in range(size)]
        else:  # dependent labellings, so high NMI is exercised too
            labels_b = [(a * 3 + (rng.randrange(3) if case % 3 == 1 else 0)) % 8 for a in labels_a]
        ours = specialisation.normalized_mutual_info(labels_a, labels_b)
        assert ours == pytest.approx(_brute_force_nmi(labels_a, labels_b), abs=1e-10)
        if sklearn_nmi is not None:
            assert ours == pytest.approx(sklearn_nmi(labels_a, labels_b), abs=1e-10)


def test_nmi_limit_cases_and_bad_input():
    assert specialisation.normalized_mutual_info([0, 0, 1, 1], [5, 5, 2, 2]) == pytest.approx(1.0)
    assert specialisation.normalized_mutual_info([0, 1, 0, 1], [0, 0, 1, 1]) == 0.0
    assert specialisation.normalized_mutual_info([3, 3], [1, 1]) == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        specialisation.normalized_mutual_info([0, 1], [0])
    with pytest.raises(ValueError, match="empty"):
        normalized_mutual_information(np.zeros((3, 8)))


def test_held_out_texts_are_deterministic_and_never_trained_on():
    for domain in DOMAINS:
        assert domain_texts(domain, 5, seed=1) == domain_texts(domain, 5, seed=1)
        assert domain_texts(domain, 5, seed=1) != domain_texts(domain, 5, seed=2)
        assert all(0 < len(text) <= 400 and text.strip() for text in domain_texts(domain, 20, seed=3))
    files = demo_data.stdlib_source_files()
    held_out_code = set(domain_documents("code", "held_out"))
    assert held_out_code and held_out_code.isdisjoint(domain_documents("code", "train"))
    assert len(held_out_code) + len(domain_documents("code", "train")) == len(files)
    assert set(domain_documents("prose", "held_out")).isdisjoint(domain_documents("prose", "train"))
    training_math = {line for doc in domain_documents("math", "train", seed=0) for line in doc.splitlines()}
    held_out_math = {line for text in domain_texts("math", 50, seed=0) for line in text.splitlines()}
    # Operand pairs decide the split, so no held-out line can be a training line.
    assert held_out_math and held_out_math.isdisjoint(training_math)
    with pytest.raises(ValueError, match="unknown domain"):
        domain_texts("poetry", 1)


def test_quick_training_writes_a_loadable_model(tmp_path):
    parser = argparse.ArgumentParser()
    train_demo.add_arguments(parser)
    out = tmp_path / "quick_model"
    args = parser.parse_args(["--quick", "--steps", "3", "--seed", "1", "--out", str(out)])
    assert train_demo.run(args) == 0
    model, tokenizer = load_demo_model(out)
    assert model.config.num_local_experts == 8 and model.config.num_experts_per_tok == 2
    assert model.config.hidden_size == train_demo.QUICK_RECIPE.hidden_size
    assert model.config.capacity_factor == train_demo.QUICK_RECIPE.capacity_factor
    assert len(capacity_blocks(model)) == train_demo.QUICK_RECIPE.num_hidden_layers
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["recipe"]["steps"] == 3 and summary["seed"] == 1
    assert set(summary["active_fraction"]["by_domain"]) == set(DOMAINS)
    assert (out / "README.md").read_text().startswith("# moescope demo model")
    ids = tokenizer("x = 1\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_load_demo_model_says_how_to_build_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-demo"):
        load_demo_model(tmp_path)


def test_the_committed_model_card_is_what_train_demo_writes():
    """`moescope train-demo` regenerates the card from training_summary.json: the committed card must
    be exactly that text, so a wording fixed in one (issue 24: top-1 vs kept-slot specialisation) is
    not undone by the next training run."""
    import json
    import os

    from moescope.demo.data import demo_model_path
    from moescope.demo.model_card import model_card

    folder = demo_model_path()
    with open(os.path.join(folder, "training_summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as fh:
        assert model_card(summary) == fh.read()

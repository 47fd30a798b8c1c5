"""Resuming a watched training run from a checkpoint, and NaN gradients (issue 23, items 12-14).

Checkpoints are real files: `torch.save` of the model's, optimizer's and scheduler's state dicts,
read back with `torch.load(weights_only=True)`. Oracles: the same ten steps run by a plain optimizer
and LambdaLR without moescope (its parameters and learning rates), the SGD update written out
(lr = (w - w') / g), the gradients torch computed, and the raw Parquet rows read with pyarrow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import moescope.training as training
from moescope.alerts.cooldown_policy import CooldownConfig
from tests.support.training import EXPERTS, batches, rows, tiny_mixtral

STEPS, SAVED_AT = 10, 5
# Normalised router entropy is never below 0: the policy never cools a router by itself here.
NEVER = CooldownConfig(thresholds={"router_entropy": 0.0})


def schedule(step: int) -> float:
    return 1.0 / (1 + step)


def make(kind: str, seed: int = 0):
    """A tiny Mixtral, its optimizer and a LambdaLR: "sgd" (one group), "adamw" (decay and no-decay
    groups as HF Trainer builds them) or "sgd2" (two groups at different rates, no momentum)."""
    model = tiny_mixtral(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elif kind == "adamw":
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                      lr=1e-2)
    else:
        optimizer = torch.optim.SGD([{"params": decay}, {"params": rest, "lr": 0.05}], lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def train(model, optimizer, scheduler, data) -> list[list[float]]:
    """Plain steps; returns each step's learning rates, per param group, as the update used them."""
    used = []
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        used.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return used


def save(path, model, optimizer, scheduler) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, path)


def load(path, model, optimizer, scheduler) -> None:
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])


def resume(path, kind: str, order: str, **options):
    """A fresh process's objects (other initial weights: everything comes from the checkpoint),
    the checkpoint loaded before or after `watch`."""
    model, optimizer, scheduler = make(kind, seed=1)
    if order == "before":
        load(path, model, optimizer, scheduler)
    monitor = training.watch(model, optimizer, scheduler=scheduler, **options)
    if order == "after":
        load(path, model, optimizer, scheduler)
    return model, optimizer, scheduler, monitor


def plain_learning_rates(kind: str) -> list[list[float]]:
    """The learning rates torch gives each param group over the ten steps, without moescope."""
    model, optimizer, scheduler = make(kind)
    return train(model, optimizer, scheduler, batches(STEPS))


# -- item 12: a checkpoint saved without a cooldown, resumed under cooldown="auto" ----------------

@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_checkpoint_saved_without_cooldown_resumes_under_cooldown_auto(tmp_path, kind, order):
    data = batches(STEPS)
    reference, ref_optimizer, ref_scheduler = make(kind)
    ref_lrs = train(reference, ref_optimizer, ref_scheduler, data)

    first = make(kind)
    train(*first, data[:SAVED_AT])
    save(tmp_path / "checkpoint.pt", *first)

    model, optimizer, scheduler, monitor = resume(tmp_path / "checkpoint.pt", kind, order, store=tmp_path / "store",
                                                  cooldown="auto", cooldown_config=NEVER)
    assert len(optimizer.param_groups) > len(ref_optimizer.param_groups)  # the routers' groups are split out
    train(model, optimizer, scheduler, data[SAVED_AT:])  # torch's zip() raised at the first scheduler.step()
    monitor.close()

    assert len(scheduler.get_last_lr()) == len(optimizer.param_groups)
    mine = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(mine[name], p, msg=name)
    stored = sorted(rows(tmp_path / "store", "train_steps"), key=lambda r: (r["optimizer_step"], r["layer"]))
    assert [r["optimizer_step"] for r in stored] == [k for k in range(1, STEPS - SAVED_AT + 1) for _ in range(2)]
    for r in stored:  # the plain run's rates: every router sits in the first group
        expected = ref_lrs[SAVED_AT + r["optimizer_step"] - 1][0]
        assert r["lr"] == pytest.approx(expected, rel=1e-12) and r["router_lr"] == pytest.approx(expected, rel=1e-12)


# -- item 12: a cooldown in force at the save goes on after the resume -----------------------------

def router_step(model, optimizer, scheduler, ids, layer: int) -> float:
    """One step; returns the lr the update applied to `layer`'s router weight, (w - w') / g (SGD)."""
    model(input_ids=ids, labels=ids).loss.backward()
    router = model.model.layers[layer].mlp.gate.weight
    before, grad = router.detach().clone(), router.grad.detach().clone()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    big = grad.abs() > 1e-4
    return float(((before - router.detach())[big] / grad[big]).median())


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_cooldown_in_force_at_the_save_is_restored_with_the_optimizer(tmp_path, order):
    data, store = batches(STEPS), tmp_path / "store"
    scheduled = [lrs[0] for lrs in plain_learning_rates("sgd2")]  # the routers' group
    model, optimizer, scheduler = make("sgd2")
    monitor = training.watch(model, optimizer, scheduler=scheduler, store=store, run_id="cooled", cooldown="auto",
                             cooldown_config=NEVER)
    used = {0: [], 1: []}
    for k, ids in enumerate(data[:SAVED_AT], start=1):
        if k == 3:  # two updates done: updates 3..8 cool layer 0's router
            monitor.cooldown.actuator.start(0, factor=0.1, epsilon=0.0, steps=6, reason="by hand")
        used[0].append(router_step(model, optimizer, scheduler, ids, 0))
    save(tmp_path / "checkpoint.pt", model, optimizer, scheduler)
    monitor.close()

    model, optimizer, scheduler, monitor = resume(tmp_path / "checkpoint.pt", "sgd2", order, store=store,
                                                  run_id="cooled", cooldown="auto", cooldown_config=NEVER)
    assert set(monitor.cooldown.actuator.cooling()) == {0}
    for ids in data[SAVED_AT:]:
        used[0].append(router_step(model, optimizer, scheduler, ids, 0))
    monitor.close()

    cooled = [0.1 if 3 <= k <= 8 else 1.0 for k in range(1, STEPS + 1)]
    assert used[0] == pytest.approx([lr * f for lr, f in zip(scheduled, cooled)], rel=1e-4)
    stored = rows(store, "train_steps")
    assert sorted((r["optimizer_step"], r["layer"]) for r in stored) == [(k, layer) for k in range(1, STEPS + 1)
                                                                          for layer in (0, 1)]
    for r in stored:
        k = r["optimizer_step"]
        assert r["router_lr"] == pytest.approx(scheduled[k - 1] * (cooled[k - 1] if r["layer"] == 0 else 1.0),
                                               rel=1e-12), r
    events = sorted(rows(store, "routing_cooldown_events"), key=lambda r: r["ts"])
    assert [(r["action"], r["step"], r["layer"]) for r in events] == [
        ("start", 2, 0), ("end", 5, 0), ("start", 5, 0), ("end", 8, 0)]
    resumed = events[2]
    assert resumed["reason"] == "resumed from a checkpoint: by hand" and resumed["period_steps"] == 3
    assert resumed["lr_after"] == pytest.approx(scheduled[SAVED_AT] * 0.1, rel=1e-12)
    assert events[1]["reason"] == "run ended" and events[3]["reason"] == "cooldown period over"


def test_a_cooldown_checkpoint_resumes_in_a_plain_loop_without_moescope(tmp_path):
    """The optimizer's state_dict comes out in the layout the optimizer had before the split, so it
    loads into one built the usual way; the cooldown's state in it is a key torch carries along."""
    model, optimizer, scheduler = make("adamw")
    monitor = training.watch(model, optimizer, scheduler=scheduler, cooldown="auto", cooldown_config=NEVER)
    train(model, optimizer, scheduler, batches(2))
    monitor.cooldown.actuator.start(1, factor=0.5, epsilon=0.0, steps=4)
    torch.save({"optimizer": optimizer.state_dict()}, tmp_path / "checkpoint.pt")
    monitor.close()
    twin, twin_optimizer, _ = make("adamw", seed=1)
    twin_optimizer.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True)["optimizer"])
    assert len(twin_optimizer.param_groups) == 2
    assert twin_optimizer.param_groups[0]["moescope_cooldown"]["cooling"][1]["ends_at_step"] == 6


# -- item 13: a run resumed under its run id counts on -------------------------------------------

@pytest.mark.parametrize("order", ["before", "after"])
def test_a_resumed_run_continues_its_optimizer_steps_and_forwards(tmp_path, order):
    data, store = batches(STEPS), tmp_path / "store"
    model, optimizer, scheduler = make("adamw")
    monitor = training.watch(model, optimizer, scheduler=scheduler, store=store, run_id="resumed")
    train(model, optimizer, scheduler, data[:SAVED_AT])
    save(tmp_path / "checkpoint.pt", model, optimizer, scheduler)
    monitor.close()
    model, optimizer, scheduler, monitor = resume(tmp_path / "checkpoint.pt", "adamw", order, store=store,
                                                  run_id="resumed")
    train(model, optimizer, scheduler, data[SAVED_AT:])
    monitor.flush()
    assert [s.optimizer_step for s in monitor.steps] == list(range(SAVED_AT + 1, STEPS + 1))
    monitor.close()

    trained = sorted(rows(store, "train_steps"), key=lambda r: (r["optimizer_step"], r["layer"]))
    assert [(r["optimizer_step"], r["layer"]) for r in trained] == [(k, layer) for k in range(1, STEPS + 1)
                                                                               for layer in (0, 1)]
    layer_steps = rows(store, "layer_steps")
    keys = [(r["step"], r["layer"]) for r in layer_steps]
    assert len(keys) == len(set(keys))  # no forward numbered twice
    assert sorted(keys) == [(s, layer) for s in range(STEPS) for layer in (0, 1)]  # one forward per step, 0..9
    steps = rows(store, "steps")
    assert sorted(r["step"] for r in steps) == list(range(STEPS))
    by_step = {(r["step"], r["layer"]): r for r in layer_steps}
    for r in trained:  # each optimizer step's row names the forward it covers, which holds its tokens
        assert r["step"] == r["step_end"] == r["optimizer_step"] - 1
        assert by_step[(r["step"], r["layer"])]["tokens"] == r["tokens"] == data[0].numel()


def test_a_checkpoint_of_another_run_starts_the_new_run_at_its_first_step(tmp_path):
    model, optimizer, scheduler = make("sgd")
    monitor = training.watch(model, optimizer, run_id="pretrain")
    train(model, optimizer, scheduler, batches(3))
    save(tmp_path / "checkpoint.pt", model, optimizer, scheduler)
    monitor.close()
    model, optimizer, scheduler, monitor = resume(tmp_path / "checkpoint.pt", "sgd", "after", store=tmp_path / "s",
                                                  run_id="finetune")
    train(model, optimizer, scheduler, batches(2, seed=7))
    monitor.close()
    assert sorted({r["optimizer_step"] for r in rows(tmp_path / "s", "train_steps")}) == [1, 2]
    assert sorted(r["step"] for r in rows(tmp_path / "s", "steps")) == [0, 1]


# -- item 14: NaN gradients are NaN, and health sees them ----------------------------------------

def expert_norms(model, layer: int) -> list[float]:
    experts = model.model.layers[layer].mlp.experts
    return [float(torch.sqrt(sum(p.grad[e].double().pow(2).sum() for p in experts.parameters())))
            for e in range(EXPERTS)]


def test_all_nan_expert_gradients_are_reported_as_nan_and_make_the_experts_unhealthy(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = training.watch(model, optimizer, store=tmp_path, health=True)
    nan_experts = list(model.model.layers[0].mlp.experts.parameters())

    def skip_the_nan_update(optimizer, args, kwargs):  # after the monitor measured: keep the weights finite
        for p in nan_experts:
            p.grad = None

    optimizer.register_step_pre_hook(skip_the_nan_update)
    finite = []
    for ids in batches(8):
        model(input_ids=ids, labels=ids).loss.backward()
        for p in nan_experts:
            p.grad.fill_(float("nan"))
        finite.append(expert_norms(model, 1))
        optimizer.step()
        optimizer.zero_grad()
    monitor.flush()
    steps = monitor.steps
    monitor.close()

    for step in steps:
        assert np.isnan(step.layers[0].expert_grad_norm).all()  # was None, as for a frozen expert
        assert math.isnan(step.scalars()["moe/expert_grad_norm_max/layer_0"])
    stored = sorted(rows(tmp_path, "train_steps"), key=lambda r: (r["optimizer_step"], r["layer"]))
    assert len(stored) == 16
    for r in stored:
        if r["layer"] == 0:
            assert r["expert_grad_norm"] is not None and all(math.isnan(v) for v in r["expert_grad_norm"]), r
        else:
            np.testing.assert_allclose(r["expert_grad_norm"], finite[r["optimizer_step"] - 1], rtol=1e-5)

    health = rows(tmp_path, "expert_health")
    assert {(r["layer"], r["expert"]) for r in health} == {(layer, e) for layer in (0, 1) for e in range(EXPERTS)}
    for r in health:
        if r["layer"] == 0:  # the step's own NaN gradient: the grad component and the score at 0, and why
            assert math.isnan(r["grad_norm"]) and r["grad"] == 0.0 and r["score"] == 0.0, r
            assert "non-finite gradient" in r["reasons"], r
        else:  # the latest optimizer step of the window: the norm torch computed
            assert r["grad_norm"] == pytest.approx(finite[r["step_end"]][r["expert"]], rel=1e-5), r
            assert r["grad"] is not None and r["grad"] > 0


def test_frozen_experts_have_no_gradient_norm(tmp_path):
    model = tiny_mixtral()
    model.model.layers[1].mlp.experts.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    monitor = training.watch(model, optimizer, store=tmp_path)
    train(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), batches(2))
    monitor.close()
    stored = rows(tmp_path, "train_steps")
    assert len(stored) == 4
    assert all((r["expert_grad_norm"] is None) == (r["layer"] == 1) for r in stored)


def test_forwards_run_before_a_resume_keep_their_numbers():
    """A resume numbers the next forward later (`_skip_forwards`); forwards already run in the open
    window keep the numbers they ran under, even when their reduction was deferred to the window's
    close (as it is on a CPU): their window closes before the jump. Oracle: the forward numbers
    the host counted, against the routes' step column of each record."""
    from moescope import probe
    from moescope.core.exporters import InMemoryExporter
    from moescope.training.monitor import _skip_forwards

    model = tiny_mixtral(0)
    memory = InMemoryExporter()
    ids = batches(1)[0]
    with probe.attach(model, [memory], routes=True, window=10, window_s=None) as session, torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids)
        _skip_forwards(session, 5)
        model(input_ids=ids)
    steps = [sorted(set(record.layers[0].routes.step.tolist())) for record in memory.records]
    assert steps == [[0, 1], [7]], steps
    assert [(r.step, r.step_end) for r in memory.records] == [(0, 1), (7, 7)]

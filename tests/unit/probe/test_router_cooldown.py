"""The routing cooldown's actuator on a real tiny Mixtral.

Oracles: an unsplit twin (a model and optimizer built the usual way, loaded with the cooled one's
weights and optimizer state before each step) for the updates and the schedule; the SGD update rule
written out (p - lr * g) for an exact check; the router's own forward on the input it received for
the logits; the experts' and the router's inputs captured by hooks written here for the jitter.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.probe.router_cooldown import RouterCooldown, RouterCooldownError
from tests.support.zoo import training_mixtral

torch.set_num_threads(1)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def _hf_groups(model, weight_decay: float = 0.1) -> list[dict]:
    """Two groups as HF Trainer builds them: decay for matrices, none for norms (routers in the first)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _router_ids(layers) -> dict[int, set[int]]:
    return {layer.index: {id(p) for p in layer.router.parameters()} for layer in layers}


def _train_step(model, optimizer, scheduler=None, seed: int = 0) -> None:
    x = _batch(seed)
    model(x, labels=x).loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad()


def _warmup_decay(step: int) -> float:  # transformers' get_linear_schedule_with_warmup(2, 20)
    return step / 2 if step < 2 else max(0.0, (20 - step) / 18)


# -- the split --------------------------------------------------------------------------------------

def test_split_keeps_every_state_tensor_and_the_parent_hyperparameters():
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.AdamW(_hf_groups(model), lr=3e-3, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_decay)
    for step in range(2):
        _train_step(model, optimizer, scheduler, seed=step)
    layers = probe.find_moe_layers(model)
    state = {p: dict(optimizer.state[p]) for p in model.parameters()}
    parent = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    decay_before = list(optimizer.param_groups[0]["params"])

    cooldown = RouterCooldown(layers, optimizer, scheduler)
    routers = _router_ids(layers)
    assert len(optimizer.param_groups) == 4
    for layer in layers:
        [group] = cooldown.groups(layer.index)
        new = optimizer.param_groups[group]
        assert {id(p) for p in new["params"]} == routers[layer.index]
        assert {k: v for k, v in new.items() if k != "params"} == parent  # initial_lr, betas, weight_decay ...
        assert "initial_lr" in new
    moved = set().union(*routers.values())
    assert optimizer.param_groups[0]["params"] == [p for p in decay_before if id(p) not in moved]
    for p in model.parameters():  # the very same state objects, keyed by the same parameters
        assert optimizer.state[p].keys() == state[p].keys()
        assert all(optimizer.state[p][k] is v for k, v in state[p].items())
    exp_avg = {p: optimizer.state[p]["exp_avg"] for p in model.parameters()}
    _train_step(model, optimizer, scheduler, seed=5)
    assert all(optimizer.state[p]["exp_avg"] is exp_avg[p] for p in model.parameters())  # updated in place
    cooldown.close()


def test_a_router_outside_the_optimizer_is_a_clear_error():
    model = training_mixtral(dtype=torch.float64)
    layers = probe.find_moe_layers(model)
    routers = set().union(*_router_ids(layers).values())
    subset = torch.optim.SGD([p for p in model.parameters() if id(p) not in routers], lr=0.1)
    with pytest.raises(RouterCooldownError, match="not in the optimizer; build the optimizer over every router"):
        RouterCooldown(layers, subset)
    for layer in layers:
        layer.router.requires_grad_(False)
    trainable = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(RouterCooldownError, match="frozen: requires_grad=False"):
        RouterCooldown(layers, trainable)
    assert len(trainable.param_groups) == 1  # refused before anything moved


def test_one_split_per_optimizer():
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layers = probe.find_moe_layers(model)
    first = RouterCooldown(layers, optimizer)
    with pytest.raises(RouterCooldownError, match="already has an open RouterCooldown"):
        RouterCooldown(layers, optimizer)
    first.close()
    second = RouterCooldown(layers, optimizer)  # the split is reused, not made again
    assert len(optimizer.param_groups) == 3 and second.groups(0) == first.groups(0)
    second.close()
    with pytest.raises(RouterCooldownError, match="split for other routers"):
        RouterCooldown(layers[:1], optimizer)


def test_a_group_of_routers_is_kept_and_named_parameters_follow_their_params():
    model, twin = training_mixtral(dtype=torch.float64), training_mixtral(dtype=torch.float64)
    layers = probe.find_moe_layers(model)
    routers = set().union(*_router_ids(layers).values())

    def groups(m):  # named parameters, the routers already in a group of their own (at a lower lr)
        named = list(m.named_parameters())
        return [{"params": [(n, p) for n, p in named if id(p) not in routers and ".gate." not in n]},
                {"params": [(n, p) for n, p in named if ".mlp.gate." in n], "lr": 0.01}]

    optimizer = torch.optim.AdamW(groups(model), lr=0.1)
    _train_step(model, optimizer)
    cooldown = RouterCooldown(layers, optimizer)
    assert len(optimizer.param_groups) == 3  # layer 0 keeps the routers' group, layer 1 gets a copy
    assert cooldown.groups(0) == [1] and cooldown.groups(1) == [2]
    for group in optimizer.param_groups:
        assert group["param_names"] == [n for n, p in model.named_parameters() if any(p is q for q in group["params"])]
    assert optimizer.param_groups[2]["lr"] == 0.01 and cooldown.lr_in_force(1) == 0.01
    saved = copy.deepcopy(optimizer.state_dict())
    assert [g["param_names"] for g in saved["param_groups"]] == [
        [n for n, _ in g["params"]] for g in groups(model)]
    twin_optimizer = torch.optim.AdamW(groups(twin), lr=0.1)
    twin_optimizer.load_state_dict(saved)
    mine = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        assert torch.equal(twin_optimizer.state[p]["exp_avg"], optimizer.state[mine[name]]["exp_avg"]), name
    cooldown.close()


@pytest.mark.parametrize("kind", ["lambda", "step", "sequential"])
def test_split_groups_keep_following_the_schedule_and_the_factor_never_compounds(kind):
    def build(model):
        optimizer = torch.optim.SGD(_hf_groups(model), lr=0.2)
        if kind == "lambda":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [_warmup_decay, lambda s: 0.9 ** s])
        elif kind == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        else:
            scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
                torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=3),
                torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)], milestones=[3])
        return optimizer, scheduler

    model, twin = training_mixtral(dtype=torch.float64), training_mixtral(dtype=torch.float64)
    optimizer, scheduler = build(model)
    twin_optimizer, twin_scheduler = build(twin)
    _train_step(model, optimizer, scheduler)  # a schedule already under way when the cooldown attaches
    _train_step(twin, twin_optimizer, twin_scheduler)
    cooldown = RouterCooldown(probe.find_moe_layers(model), optimizer, scheduler)
    seen = []
    for step in range(10):
        if step == 2:
            cooldown.start(0, factor=0.1, epsilon=0.0, steps=5)
        scheduled = twin_optimizer.param_groups[0]["lr"]  # the router's parent group, unsplit
        factor = 0.1 if 2 <= step < 7 else 1.0
        assert cooldown.lr_in_force(0) == pytest.approx(scheduled * factor, rel=1e-12)
        assert cooldown.lr_in_force(1) == pytest.approx(scheduled, rel=1e-12)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
            [g["lr"] for g in twin_optimizer.param_groups] + [scheduled, scheduled], rel=1e-12)
        seen.append(scheduled)
        _train_step(model, optimizer, scheduler, seed=step)
        _train_step(twin, twin_optimizer, twin_scheduler, seed=step)
    assert len(set(seen)) > 2  # the schedule really moved while the layer cooled
    assert [c.action for c in cooldown.changes] == ["start", "end"]
    assert cooldown.changes[1].optimizer_step - cooldown.changes[0].optimizer_step == 5
    cooldown.close()


def test_a_scheduler_that_does_not_match_the_optimizer_is_refused():
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    another = torch.optim.SGD(training_mixtral(dtype=torch.float64).parameters(), lr=0.1)
    other = torch.optim.lr_scheduler.StepLR(another, step_size=1)
    with pytest.raises(RouterCooldownError, match="drives another optimizer"):
        RouterCooldown(probe.find_moe_layers(model), optimizer, other)


# -- the learning rate -----------------------------------------------------------------------------

def test_sgd_router_update_is_exactly_factor_times_lr_times_gradient():
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    layers = probe.find_moe_layers(model)
    cooldown = RouterCooldown(layers, optimizer, scheduler)
    router = layers[0].router.weight
    other = layers[1].router.weight
    for step in range(6):
        if step == 1:
            cooldown.start(0, factor=0.25, epsilon=0.0, steps=3)
        x = _batch(step)
        model(x, labels=x).loss.backward()
        lr = 0.05 / (1 + step)
        factor = 0.25 if 1 <= step < 4 else 1.0
        want = router.detach() - factor * lr * router.grad
        want_other = other.detach() - lr * other.grad
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        torch.testing.assert_close(router.detach(), want, rtol=0, atol=1e-15)
        torch.testing.assert_close(other.detach(), want_other, rtol=0, atol=1e-15)
    cooldown.close()


def test_adamw_router_update_is_factor_times_the_twins_and_the_rest_identical():
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.AdamW(_hf_groups(model), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_decay)
    layers = probe.find_moe_layers(model)
    cooldown = RouterCooldown(layers, optimizer, scheduler)
    routers = _router_ids(layers)
    names = {id(p): n for n, p in model.named_parameters()}
    ratios = {}
    for step in range(7):
        if step == 2:
            cooldown.start(1, factor=0.1, epsilon=0.0, steps=3)
        # the twin: built the usual way, loaded from the cooled model and optimizer (its checkpoint
        # comes out in the unsplit layout, so it loads as is); a deep copy, as state_dict() shares tensors
        twin = training_mixtral(dtype=torch.float64)
        twin.load_state_dict(model.state_dict())
        twin_optimizer = torch.optim.AdamW(_hf_groups(twin), lr=1e-2)
        twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for m, o in ((model, optimizer), (twin, twin_optimizer)):
            x = _batch(step)
            m(x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
        scheduler.step()
        twin_params = dict(twin.named_parameters())
        cooling = 2 <= step < 5
        for p in model.parameters():
            name = names[id(p)]
            update = p.detach() - before[name]
            twin_update = twin_params[name].detach() - before[name]
            if id(p) in routers[1] and cooling:
                torch.testing.assert_close(update, 0.1 * twin_update, rtol=1e-9, atol=1e-18)
                ratios[step] = float((update.norm() / twin_update.norm()))
            else:
                assert torch.equal(update, twin_update), (step, name)
    assert ratios.keys() == {2, 3, 4} and all(r == pytest.approx(0.1, rel=1e-9) for r in ratios.values())
    cooldown.close()


def test_state_dict_round_trips_between_split_and_unsplit_optimizers():
    model, twin = training_mixtral(dtype=torch.float64), training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.AdamW(_hf_groups(model), lr=1e-2)
    for step in range(2):
        _train_step(model, optimizer, seed=step)
    cooldown = RouterCooldown(probe.find_moe_layers(model), optimizer)
    _train_step(model, optimizer, seed=2)
    saved = copy.deepcopy(optimizer.state_dict())
    twin_optimizer = torch.optim.AdamW(_hf_groups(twin), lr=1e-2)
    assert [len(g["params"]) for g in saved["param_groups"]] == [len(g["params"]) for g in twin_optimizer.param_groups]
    twin_optimizer.load_state_dict(saved)
    mine = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        torch.testing.assert_close(twin_optimizer.state[p]["exp_avg_sq"], optimizer.state[mine[name]]["exp_avg_sq"],
                                   rtol=0, atol=0)
    # and back: an unsplit checkpoint loads into the split optimizer, each state on its own parameter
    for p in twin.parameters():
        twin_optimizer.state[p]["exp_avg"] = torch.full_like(p, float(len(p.shape)) + p.numel())
    optimizer.load_state_dict(copy.deepcopy(twin_optimizer.state_dict()))
    assert len(optimizer.param_groups) == 4
    for name, p in model.named_parameters():
        assert torch.equal(optimizer.state[p]["exp_avg"], torch.full_like(p, float(len(p.shape)) + p.numel())), name
    cooldown.close()


def _sequential(optimizer):
    """A warm-up by LambdaLR (its per-group base_lrs are what a checkpoint restores), then a decay."""
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_decay),
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)], milestones=[5])


def test_a_checkpoint_saved_before_any_split_loads_into_a_split_optimizer_and_scheduler(tmp_path):
    """Files written by torch.save and read with weights_only=True; the oracle is the plain run that
    wrote the checkpoint going on without a cooldown: same parameters, same rates in every group."""
    plain = training_mixtral(dtype=torch.float64)
    plain_optimizer = torch.optim.SGD(_hf_groups(plain), lr=0.2)
    plain_scheduler = _sequential(plain_optimizer)
    for step in range(3):
        _train_step(plain, plain_optimizer, plain_scheduler, seed=step)
    torch.save({"model": plain.state_dict(), "optimizer": plain_optimizer.state_dict(),
                "scheduler": plain_scheduler.state_dict()}, tmp_path / "checkpoint.pt")
    expected = []
    for step in range(3, 7):
        expected.append([g["lr"] for g in plain_optimizer.param_groups])
        _train_step(plain, plain_optimizer, plain_scheduler, seed=step)

    model = training_mixtral(seed=1, dtype=torch.float64)
    optimizer = torch.optim.SGD(_hf_groups(model), lr=0.2)
    scheduler = _sequential(optimizer)
    cooldown = RouterCooldown(probe.find_moe_layers(model), optimizer, scheduler)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])  # its lists are the two groups' before the split
    used = []
    for step in range(3, 7):  # the scheduler's step raised torch's zip() error here
        used.append([g["lr"] for g in optimizer.param_groups])
        _train_step(model, optimizer, scheduler, seed=step)
    assert used == [[decay, rest, decay, decay] for decay, rest in expected]
    mine = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(mine[name], p, rtol=0, atol=0, msg=name)
    cooldown.close()


def test_the_cooldowns_in_force_are_saved_with_the_optimizer_and_restored_before_the_attach(tmp_path):
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cooldown = RouterCooldown(probe.find_moe_layers(model), optimizer)
    for step in range(2):
        _train_step(model, optimizer, seed=step)
    cooldown.start(0, factor=0.25, epsilon=0.0, steps=3, reason="by hand")
    _train_step(model, optimizer, seed=2)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "checkpoint.pt")
    cooldown.close()

    twin = training_mixtral(seed=1, dtype=torch.float64)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    twin.load_state_dict(checkpoint["model"])
    twin_optimizer.load_state_dict(checkpoint["optimizer"])  # before the cooldown is attached
    resumed = RouterCooldown(probe.find_moe_layers(twin), twin_optimizer)
    assert resumed.optimizer_steps == 3 and set(resumed.cooling()) == {0}
    assert resumed.cooling()[0].ends_at_step == 5 and resumed.cooling()[0].factor == 0.25
    [change] = resumed.changes
    assert (change.action, change.reason, change.steps, change.optimizer_step) == (
        "start", "resumed from a checkpoint: by hand", 2, 3)
    assert all(not any(k.startswith("moescope_") for k in g) for g in twin_optimizer.param_groups)
    router = twin.model.layers[0].mlp.gate.weight
    for step, lr in [(3, 0.025), (4, 0.025), (5, 0.1)]:  # SGD written out: p - lr * g
        x = _batch(step)
        twin(x, labels=x).loss.backward()
        before, grad = router.detach().clone(), router.grad.detach().clone()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
        torch.testing.assert_close(router.detach(), before - lr * grad, rtol=1e-12, atol=1e-15)
    assert resumed.cooling() == {} and resumed.last_end_step(0) == 5
    resumed.close()


# -- the jitter ------------------------------------------------------------------------------------

def _capture(layer):
    """Hooks written here: what reached the router before and after the cooldown's pre-hook, its
    output, and what the experts received."""
    seen: dict[str, torch.Tensor] = {}

    def given(module, args):
        seen["given"] = args[0].detach().clone()

    def received(module, args, output):
        seen["received"], seen["logits"] = args[0].detach().clone(), output[0].detach().clone()

    def experts(module, args):
        seen["experts"] = args[0].detach().clone()

    handles = [layer.router.register_forward_pre_hook(given, prepend=True),
               layer.router.register_forward_hook(received),
               layer.experts.register_forward_pre_hook(experts)]
    return seen, handles


def test_jitter_only_while_cooling_in_training_mode_and_within_epsilon():
    model = training_mixtral(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layers = probe.find_moe_layers(model)
    cooldown = RouterCooldown(layers, optimizer, seed=3)
    seen, handles = _capture(layers[0])
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))

    def run(train: bool) -> dict[str, torch.Tensor]:
        model.train(train)
        with torch.no_grad():
            model(x)
        return dict(seen)

    calm = run(True)
    assert torch.equal(calm["given"], calm["received"])
    eps = 0.01
    cooldown.start(0, factor=0.1, epsilon=eps)
    rng = torch.get_rng_state()
    cooled = run(True)
    assert torch.equal(torch.get_rng_state(), rng)  # the jitter draws from its own generator
    assert torch.equal(cooled["given"], calm["given"])  # layer 0's input: nothing upstream changed
    ratio = cooled["received"] / cooled["given"]
    assert float(ratio.min()) >= 1 - eps - 1e-6 and float(ratio.max()) <= 1 + eps + 1e-6
    assert float(ratio.min()) < 1 - 0.9 * eps and float(ratio.max()) > 1 + 0.9 * eps  # it fills the range
    assert abs(float(ratio.mean()) - 1) < 1e-3
    assert not torch.equal(cooled["logits"], calm["logits"])
    # the logits are the router's own forward on the jittered input; the experts got the clean input
    torch.testing.assert_close(cooled["logits"], layers[0].router.forward(cooled["received"])[0], rtol=0, atol=0)
    assert torch.equal(cooled["experts"], calm["experts"])

    evaluated = run(False)  # eval mode: untouched
    assert torch.equal(evaluated["received"], evaluated["given"]) and torch.equal(evaluated["logits"], calm["logits"])
    cooldown.end(0, "test over")
    after = run(True)
    assert torch.equal(after["logits"], calm["logits"])
    for handle in handles:
        handle.remove()
    cooldown.close()


def test_layers_that_do_not_cool_get_no_jitter_and_the_probe_sees_the_cooled_logits():
    model = training_mixtral(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = InMemoryExporter()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with probe.attach(model, [memory], recording=probe.Recording(window=1)) as session:
        cooldown = RouterCooldown(session.layers, optimizer)
        seen, handles = _capture(session.layers[1])
        cooldown.start(0, epsilon=0.05)
        with torch.no_grad():
            model(x)
        assert torch.equal(seen["given"], seen["received"])
        session.flush()
        cooldown.close()
        for handle in handles:
            handle.remove()
    assert len(memory.records) == 1 and memory.records[0].layers[0].tokens == 32


# -- failure, closing, bad input -------------------------------------------------------------------

def test_hooks_never_raise_into_training_and_close_restores():
    model = training_mixtral(dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layers = probe.find_moe_layers(model)
    cooldown = RouterCooldown(layers, optimizer)
    cooldown.start(0, factor=0.5, epsilon=0.01)
    cooldown._generator = None  # the jitter hook now fails: the forward goes on unjittered
    broken = copy.copy(cooldown._split.groups)
    cooldown._split.groups = {0: [99], 1: broken[1]}  # and the step hooks fail: the step goes on
    x = _batch(0)
    model(x, labels=x).loss.backward()
    router = layers[0].router.weight
    want = router.detach() - 0.1 * router.grad  # the failed pre-hook scaled nothing
    optimizer.step()
    torch.testing.assert_close(router.detach(), want, rtol=0, atol=1e-15)
    assert cooldown.hook_errors >= 2 and cooldown.optimizer_steps == 1
    cooldown._split.groups = broken
    ended = cooldown.close()
    assert [(c.layer, c.action, c.reason) for c in ended] == [(0, "end", "cooldown closed")]
    assert cooldown.cooling() == {} and len(optimizer.param_groups) == 3  # the split stays
    assert all(g["lr"] == 0.1 for g in optimizer.param_groups)
    assert not layers[0].router._forward_pre_hooks and not optimizer._optimizer_step_pre_hooks
    with pytest.raises(RouterCooldownError, match="closed"):
        cooldown.start(0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(layer=5), "no MoE layer 5; the cooldown covers layers \\[0, 1\\]"),
    (dict(factor=0.0), "factor .* must lie in \\(0, 1\\]"),
    (dict(factor=2.0), "factor .* must lie in \\(0, 1\\]"),
    (dict(epsilon=1.0), "epsilon .* must lie in \\[0, 1\\)"),
    (dict(steps=0), "steps counts optimizer steps"),
    (dict(steps=2.5), "steps counts optimizer steps"),
])
def test_bad_start_arguments_say_what_is_allowed(kwargs, message):
    model = training_mixtral(dtype=torch.float64)
    cooldown = RouterCooldown(probe.find_moe_layers(model), torch.optim.SGD(model.parameters(), lr=0.1))
    args = dict(layer=0) | kwargs
    with pytest.raises(RouterCooldownError, match=message):
        cooldown.start(args.pop("layer"), **args)
    assert cooldown.cooling() == {}
    cooldown.start(0)
    with pytest.raises(RouterCooldownError, match="layer 0 is already cooling"):
        cooldown.start(0)
    assert cooldown.end(1) is None  # not cooling: nothing to end
    cooldown.close()

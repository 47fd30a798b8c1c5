"""moescope.training: one record per optimizer step, checked against transformers' own losses, the
gradients torch computed, and the raw Parquet rows; plain loop, HF Trainer, TensorBoard, W&B."""

from __future__ import annotations

import glob
import json
import os
import time

import numpy as np
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

import moescope.training as training
from tests.support.training import EXPERTS, TOP_K, batches, rows, tiny_mixtral


def run_loop(model, optimizer, data, accumulate: int = 1, scheduler=None, **options):
    """A plain training loop with the two lines of the recipe; returns the monitor and, per optimizer
    step, the model's router logits of each micro-batch (per layer) and its own aux losses."""
    monitor = training.watch(model, optimizer, **options)
    logits, own_aux = [], []
    step_logits: list[tuple] = []
    for i, ids in enumerate(data):
        out = model(input_ids=ids, labels=ids)
        step_logits.append(tuple(t.detach() for t in out.router_logits))
        own_aux.append(float(out.aux_loss.detach()))
        (out.loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
            logits.append(step_logits)
            step_logits = []
    monitor.flush()
    return monitor, logits, own_aux


def test_aux_and_z_loss_equal_the_models_own_per_step(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor, logits, own_aux = run_loop(model, optimizer, batches(5), store=tmp_path)
    steps = monitor.steps
    monitor.close()
    assert [s.optimizer_step for s in steps] == [1, 2, 3, 4, 5]
    for step, micro, aux in zip(steps, logits, own_aux):
        (layer_logits,) = micro
        assert step.aux_loss == pytest.approx(aux, rel=1e-5)  # the model's own aux_loss
        assert step.tokens == 24
        for layer, layer_out in zip(step.layers, layer_logits):
            assert layer.aux_loss == pytest.approx(float(load_balancing_loss_func((layer_out,), EXPERTS, TOP_K)),
                                                   rel=1e-5)
            assert layer.z_loss == pytest.approx(float(router_z_loss_func(layer_out.unsqueeze(0))), rel=1e-5)
        pooled = torch.cat(layer_logits)
        assert step.z_loss == pytest.approx(float(router_z_loss_func(pooled.unsqueeze(0))), rel=1e-5)


def test_aux_loss_counts_the_selection_not_the_kept_slots_under_capacity(tmp_path):
    """With expert capacity some chosen slots are dropped; transformers' loss counts the top-k
    choices all the same, and so must each layer's recomputed loss."""
    from moescope.demo.capacity import install_capacity

    model = install_capacity(tiny_mixtral(), capacity_factor=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, logits, own_aux = run_loop(model, optimizer, batches(3), store=tmp_path)
    steps = monitor.steps
    monitor.close()
    assert sum(layer.dropped_assignments for layer in _layer_rows(tmp_path)) > 0  # drops really happened
    for step, (layer_logits,), aux in zip(steps, logits, own_aux):
        assert step.aux_loss == pytest.approx(aux, rel=1e-5)
        for layer, layer_out in zip(step.layers, layer_logits):
            assert layer.aux_loss == pytest.approx(float(load_balancing_loss_func((layer_out,), EXPERTS, TOP_K)),
                                                   rel=1e-5)


def _layer_rows(root):
    from types import SimpleNamespace

    return [SimpleNamespace(**r) for r in rows(root, "layer_steps")]


def test_gradient_accumulation_counts_every_micro_batch_once(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, logits, _ = run_loop(model, optimizer, batches(6), accumulate=3, store=tmp_path)
    steps = monitor.steps
    monitor.close()
    assert len(steps) == 2
    for step, micro in zip(steps, logits):
        assert step.step_end - step.step + 1 == 3
        assert step.tokens == 3 * 24
        # the loss over all three micro-batches' tokens, as if they were one batch
        per_layer = tuple(torch.cat([m[layer] for m in micro]) for layer in range(2))
        assert step.aux_loss == pytest.approx(float(load_balancing_loss_func(per_layer, EXPERTS, TOP_K)), rel=1e-5)
    # the store: one layer_steps row per layer and optimizer step, covering three forwards each
    layer_rows = [r for r in rows(tmp_path, "layer_steps") if dict(r["tags"]).get("phase") == "train"]
    assert sorted((r["step"], r["layer"], r["forwards"], r["tokens"]) for r in layer_rows) == [
        (0, 0, 3, 72), (0, 1, 3, 72), (3, 0, 3, 72), (3, 1, 3, 72)]


def test_gradient_checkpointing_does_not_record_the_recomputation(tmp_path):
    model = tiny_mixtral()
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, logits, own_aux = run_loop(model, optimizer, batches(3), store=tmp_path)
    steps = monitor.steps
    monitor.close()
    assert [s.tokens for s in steps] == [24, 24, 24]
    assert [s.step_end - s.step for s in steps] == [0, 0, 0]
    for step, aux in zip(steps, own_aux):
        assert step.aux_loss == pytest.approx(aux, rel=1e-5)


def test_expert_gradient_norms_are_the_gradients_torch_computed(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = training.watch(model, optimizer, store=tmp_path)
    expected = []
    for ids in batches(2):
        model(input_ids=ids, labels=ids).loss.backward()
        per_layer = []
        for decoder in model.model.layers:
            experts = decoder.mlp.experts
            norms = [float(torch.sqrt(sum(p.grad[e].double().pow(2).sum() for p in experts.parameters())))
                     for e in range(EXPERTS)]
            per_layer.append(norms)
        expected.append(per_layer)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    stored = sorted(rows(tmp_path, "train_steps"), key=lambda r: (r["optimizer_step"], r["layer"]))
    assert [(r["optimizer_step"], r["layer"]) for r in stored] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in stored:
        np.testing.assert_allclose(r["expert_grad_norm"], expected[r["optimizer_step"] - 1][r["layer"]], rtol=1e-5)
        assert r["lr"] == pytest.approx(0.1) and r["router_lr"] == pytest.approx(0.1)


def test_learning_rate_in_force_follows_the_scheduler(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    used = []
    monitor = training.watch(model, optimizer, store=tmp_path, scheduler=scheduler)
    for ids in batches(4):
        model(input_ids=ids, labels=ids).loss.backward()
        used.append(optimizer.param_groups[0]["lr"])  # what the next update uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    monitor.flush()
    assert [s.lr for s in monitor.steps] == pytest.approx(used)
    assert used == pytest.approx([1e-3, 5e-4, 1e-3 / 3, 2.5e-4])
    monitor.close()


def test_dead_expert_fraction_over_the_last_steps_from_raw_rows(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    window = 2
    # one token per step: 2 of 4 experts chosen, so some are dead within any short window
    monitor, _, _ = run_loop(model, optimizer, batches(6, batch=1, seq=1), store=tmp_path, dead_window=window)
    steps = monitor.steps
    monitor.close()
    load = {}
    for r in rows(tmp_path, "layer_steps"):
        load[(r["step"], r["layer"])] = np.array(r["expert_load"])
    for i, step in enumerate(steps):
        for layer in step.layers:
            recent = [load[(s.step, layer.layer)] for s in steps[max(0, i - window + 1): i + 1]]
            total = np.sum(recent, axis=0)
            assert layer.dead_expert_fraction == pytest.approx(np.count_nonzero(total == 0) / EXPERTS)
    assert any(layer.dead_expert_fraction > 0 for s in steps for layer in s.layers)


def test_eval_forwards_are_tagged_and_kept_out_of_training_steps(tmp_path):
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = training.watch(model, optimizer, store=tmp_path)
    for ids in batches(2):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[:, :5])
    model.train()
    monitor.close()
    assert [s.tokens for s in monitor.steps] == [24, 24]
    phases = sorted((dict(r["tags"])["phase"], r["tokens"]) for r in rows(tmp_path, "steps"))
    assert phases == [("eval", 10), ("eval", 10), ("train", 24), ("train", 24)]


def test_tensorboard_scalars_are_the_steps_figures(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = tiny_mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    monitor, _, own_aux = run_loop(model, optimizer, batches(3), tensorboard=writer)
    steps = monitor.steps
    monitor.close()
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("moe/aux_loss/layer_0", "moe/z_loss/layer_1", "moe/dead_expert_fraction/layer_0",
                 "moe/router_lr/layer_1", "moe/expert_grad_norm_max/layer_0", "moe/aux_loss/all_layers", "moe/lr"):
        assert name in tags, name
    logged = [(e.step, e.value) for e in events.Scalars("moe/aux_loss/all_layers")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx(own_aux, rel=1e-5)
    layer1 = [e.value for e in events.Scalars("moe/z_loss/layer_1")]
    assert layer1 == pytest.approx([s.layers[1].z_loss for s in steps], rel=1e-6)


def test_wandb_offline_run_gets_the_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="moescope-test", dir=str(tmp_path))
    try:
        model = tiny_mixtral()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor, _, own_aux = run_loop(model, optimizer, batches(3), wandb=True)
        monitor.close()
    finally:
        run.finish()
    history = _wandb_offline_history(tmp_path)
    aux = [h["moe/aux_loss/all_layers"] for h in history if "moe/aux_loss/all_layers" in h]
    assert aux == pytest.approx(own_aux, rel=1e-5)
    assert [h["moe/optimizer_step"] for h in history if "moe/optimizer_step" in h] == [1, 2, 3]


def _wandb_offline_history(root, timeout_s: float = 60.0) -> list[dict]:
    """The history rows an offline W&B run wrote, read back from its transaction log: a 7-byte
    header (":W&B", magic, version), then LevelDB-log records (crc32, little-endian length, type:
    1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks, each a `wandb_internal_pb2.Record`.

    W&B's service process writes the log after `run.finish()` has returned (seen: the file still
    held its 7-byte header alone, about once in six runs, and was whole 0.2 s later), so this reads
    until the log holds the run's `exit` record, its last, for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_offline_records(root)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), \
        f"W&B wrote no exit record within {timeout_s:g} s of run.finish()"
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def _wandb_offline_records(root) -> list:
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, pending, chunks = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7: pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def test_hf_trainer_callback_with_accumulation_checkpointing_and_tensorboard(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_mixtral()
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches(8, batch=1, seq=12)]
    seen = []  # the model's own router logits of every training forward
    handle = model.register_forward_hook(
        lambda m, a, out: seen.append(tuple(t.detach() for t in out.router_logits)) if m.training else None)
    callback = training.MoescopeCallback(store=str(tmp_path / "store"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, gradient_checkpointing=True, max_steps=2,
                             learning_rate=1e-3, report_to=["tensorboard"], logging_steps=1, save_strategy="no",
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    handle.remove()
    steps = callback.monitor.steps
    assert [s.optimizer_step for s in steps] == [1, 2]
    assert [s.tokens for s in steps] == [48, 48]  # 2 micro-batches x 2 sequences x 12 tokens, once each
    for i, step in enumerate(steps):
        micro = seen[2 * i: 2 * i + 2]
        per_layer = tuple(torch.cat([m[layer] for m in micro]) for layer in range(2))
        assert step.aux_loss == pytest.approx(float(load_balancing_loss_func(per_layer, EXPERTS, TOP_K)), rel=1e-5)
        assert step.lr == pytest.approx(1e-3 * (1 - i / 2))  # the Trainer's linear schedule
    stored = rows(tmp_path / "store", "train_steps")
    assert sorted({r["optimizer_step"] for r in stored}) == [1, 2]
    assert glob.glob(str(tmp_path / "out" / "runs" / "moescope" / "events.out.tfevents.*"))


def test_bad_options_say_what_to_do():
    model = tiny_mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="one optimizer step"):
        training.watch(model, optimizer, window=4)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        training.watch(model, object())
    with pytest.raises(ValueError, match="cooldown"):
        training.watch(model, optimizer, cooldown="yes")
    with pytest.raises(TypeError, match="SummaryWriter"):
        training.watch(model, optimizer, tensorboard=42)


def test_lightning_callback_with_accumulation_and_its_tensorboard_logger(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="the optional extra: pip install 'moescope[lightning]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moescope.training.lightning import MoescopeLightningCallback

    seen = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_mixtral()

        def training_step(self, batch, index):
            out = self.model(input_ids=batch, labels=batch)
            seen.append(tuple(t.detach() for t in out.router_logits))
            return out.loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.cat(batches(8, batch=1, seq=12)), batch_size=2)
    callback = MoescopeLightningCallback(store=str(tmp_path / "store"))
    logger = pl.loggers.TensorBoardLogger(str(tmp_path / "tb"), name="run", version=0)
    trainer = pl.Trainer(max_steps=2, accumulate_grad_batches=2, logger=logger, callbacks=[callback],
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Module(), data)
    steps = callback.monitor.steps
    assert [s.optimizer_step for s in steps] == [1, 2]
    assert [s.tokens for s in steps] == [48, 48]
    for i, step in enumerate(steps):
        micro = seen[2 * i: 2 * i + 2]
        per_layer = tuple(torch.cat([m[layer] for m in micro]) for layer in range(2))
        assert step.aux_loss == pytest.approx(float(load_balancing_loss_func(per_layer, EXPERTS, TOP_K)), rel=1e-5)
        assert all(layer.expert_grad_norm is not None and (layer.expert_grad_norm > 0).any() for layer in step.layers)
    events = EventAccumulator(str(tmp_path / "tb" / "run" / "version_0"))
    events.Reload()
    assert [e.step for e in events.Scalars("moe/aux_loss/layer_0")] == [1, 2]


def test_cooldown_auto_cools_the_firing_layers_router_and_records_it(tmp_path):
    """The training monitor with cooldown="auto" on a model with expert capacity: a rule that fires
    on the first window cools the router; train_steps shows the lr each update really used."""
    from moescope.alerts.cooldown_policy import CooldownConfig
    from moescope.demo.capacity import install_capacity

    model = install_capacity(tiny_mixtral(), capacity_factor=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = CooldownConfig(thresholds={"router_entropy": 2.0, "capacity_use": 0.0}, for_duration="0s", window=1,
                            period_steps=2, min_gap_steps=100, max_share=1.0)
    monitor, _, own_aux = run_loop(model, optimizer, batches(6), store=tmp_path, cooldown="auto",
                                   cooldown_config=config)
    steps = monitor.steps
    monitor.close()
    assert [s.aux_loss for s in steps] == pytest.approx(own_aux, rel=1e-5)
    events = sorted(rows(tmp_path, "routing_cooldown_events"), key=lambda r: (r["layer"], r["step"]))
    starts = {r["layer"]: r["step"] for r in events if r["action"] == "start"}
    ends = {r["layer"]: r["step"] for r in events if r["action"] == "end"}
    assert set(starts) == {0, 1} and set(ends) == {0, 1}
    stored = rows(tmp_path, "train_steps")
    for r in stored:
        cooling = starts[r["layer"]] < r["optimizer_step"] <= ends[r["layer"]]
        assert r["lr"] == pytest.approx(0.1)
        assert r["router_lr"] == pytest.approx(0.01 if cooling else 0.1), r
    assert any(r["router_lr"] == pytest.approx(0.01) for r in stored)
    alerts = [r for r in rows(tmp_path, "alerts") if r["alertname"] == "RoutingCooldownApplied"]
    assert sorted(r["state"] for r in alerts) == ["firing", "firing", "resolved", "resolved"]


def test_a_failing_cooldown_hook_is_counted_in_the_sessions_hook_errors(tmp_path):
    from moescope.demo.capacity import install_capacity

    model = install_capacity(tiny_mixtral(), capacity_factor=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = training.watch(model, optimizer, store=tmp_path, cooldown="auto")
    actuator = monitor.cooldown.actuator
    actuator.start(0, factor=0.5, epsilon=0.01)
    actuator._generator = None  # the jitter hook now fails; the forward goes on unjittered
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert actuator.hook_errors >= 1
    assert monitor.session.hook_errors == actuator.hook_errors
    monitor.close()

"""`attach`: hook a model's MoE layers and turn each forward pass into a `StepRecord`.

Hooks are global state on the modules they sit on: this session keeps every handle it adds and
removes exactly those in `close()` (also when attaching fails half-way), leaving other hooks alone.
Only forwards of the module passed to `attach` are recorded; calling a submodule directly, or the
recomputation of gradient checkpointing, records nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from probe.adapters import Choice, MoELayer, MoESpec, find_moe_layers
from probe.gate import TrustGate
from probe.health import HealthSampler
from probe.records import KVCacheLayer, LayerInfo, LayerStep, Routes, RunInfo, StepRecord, TokenSample
from probe.reduce import pack, reduce_layer, unpack

log = logging.getLogger(__name__)

COSELECTION_MAX_EXPERTS = 64  # E x E counts per layer and step; beyond this only on request


class ProbeAttachError(RuntimeError):
    """The probe cannot attach to this model as it is; the message says what to do."""


def new_run_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def shared_run_id() -> str:
    """A new run id; under torch.distributed, rank 0's, so that every rank writes one run.

    This is a collective call when a process group is initialised: every rank must attach.
    """
    run_id = new_run_id()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _sample_size(option: bool | int) -> int:
    """router_logits / router_inputs: False or 0 is off, True is every token, n a sample of n."""
    if option is True:
        return -1
    return max(int(option or 0), 0)


class _Forward:
    """What the hooks gather during one forward of the root module."""

    def __init__(self, step: int, tags: dict[str, str], inputs: dict[str, Any]):
        self.step = step
        self.tags = tags
        self.inputs = inputs
        self.started = time.perf_counter()
        self.logits: dict[int, torch.Tensor] = {}
        self.router_in: dict[int, torch.Tensor] = {}
        self.choice: dict[int, Choice] = {}


@dataclass
class _Collected:
    """A forward whose reductions are packed on the device, waiting for (or done with) the transfer."""

    forward: _Forward
    buffer: torch.Tensor | None
    slots: list
    meta: dict[int, dict[str, Any]]
    ts: dt.datetime
    duration_s: float
    kv_cache: list[KVCacheLayer] | None
    event: Any = None  # a CUDA event while the copy to pinned host memory is in flight


class ProbeSession:
    """A probe attached to one model. Use as a context manager, or call `close()`."""

    def __init__(self, model: nn.Module, layers: list[MoELayer], exporters: Sequence[Any] = (),
                 store: str | os.PathLike | None = None, routes: bool = False,
                 router_logits: bool | int = False, router_inputs: bool | int = False,
                 kv_cache: bool = False, coselection: bool | None = None, tags: dict | None = None,
                 run_id: str | None = None, policy: str = "block", max_queue: int = 256,
                 flush_interval_s: float = 5.0, sample_seed: int = 0, health: bool = False,
                 trust_gate: str | None = None, health_options: dict | None = None, trust_policy: Any = None):
        from store.writer import (  # store may import probe, not vice versa at import time
            BatchProcessor,
            ParquetExporter,
        )

        self.model = model
        self.layers = layers
        self.routes = routes
        self.router_logits = _sample_size(router_logits)
        self.router_inputs = _sample_size(router_inputs)
        self.kv_cache = kv_cache
        self.coselection = coselection
        self._tags: list[dict[str, str]] = [{str(k): str(v) for k, v in (tags or {}).items()}]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._forward: _Forward | None = None
        self._in_flight: deque[_Collected] = deque()
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(sample_seed)
        self.step = 0
        self.hook_errors = 0
        self.closed = False

        rank, world_size = _distributed()
        total = sum(p.numel() for p in model.parameters())
        # Rows no token can use (LongCat's zero-expert slots in fused weights) are never active.
        routed = sum(layer.params_per_expert * layer.num_experts + layer.unused_params for layer in layers)
        self.total_params = total
        self.shared_params = total - routed  # counted for every token, by the model-card convention
        self.run = RunInfo(
            run_id=run_id or os.environ.get("MOESCOPE_RUN_ID") or shared_run_id(),
            started_at=dt.datetime.now(dt.timezone.utc), model_class=type(model).__name__,
            total_params=total, routed_expert_params=routed, tags=dict(self._tags[0]), rank=rank,
            world_size=world_size, layers=tuple(LayerInfo(
                layer=layer.index, module=layer.name, family=layer.family, num_experts=layer.num_experts,
                top_k=layer.top_k, params_per_expert=layer.params_per_expert, zero_experts=layer.zero_experts,
                expert_capacity=layer.expert_capacity) for layer in layers))
        exporters = list(exporters)
        self.parquet = None
        self.processor = BatchProcessor(exporters, max_queue=max_queue, policy=policy,
                                        flush_interval_s=flush_interval_s)
        if store is not None:
            self.parquet = ParquetExporter(store, self.run, max_age_s=flush_interval_s,
                                           processor=self.processor)
            self.processor.exporters.append(self.parquet)
        for exporter in exporters:
            if hasattr(exporter, "on_attach"):
                exporter.on_attach(self.run)
            if hasattr(exporter, "bind_probe_stats"):
                exporter.bind_probe_stats(self.probe_stats)
        # -- expert health and trust gate (probe/health.py, probe/gate.py, alerts/trust_policy.py) --
        if trust_gate not in (None, "manual", "auto"):
            raise ValueError(f"trust_gate must be None, 'manual' or 'auto', not {trust_gate!r}")
        health = health or trust_gate == "auto"  # the auto policy judges by health scores
        self.health = HealthSampler(layers, on_error=self._hook_failed, **(health_options or {})) if health else None
        self.gate = TrustGate(layers, on_error=self._hook_failed) if trust_gate else None
        self.trust = None
        if health or trust_gate:
            from alerts.trust_policy import bind_policy  # alerts imports probe: only when asked for

            self.trust = bind_policy(self, trust_policy, trust_gate, store)
            self.processor.exporters.append(self.trust)
        # -- end expert health and trust gate --
        try:
            self._install()
        except BaseException:
            self._remove_hooks()
            self.processor.shutdown()
            raise

    # -- hooks ---------------------------------------------------------------------------------

    def _install(self) -> None:
        # Hooks are host-side bookkeeping: under torch.compile they run eagerly at graph breaks
        # (tracing them would bake one forward's Python state into the graph).
        eager = torch.compiler.disable
        self._handles.append(self.model.register_forward_pre_hook(eager(self._on_forward_start),
                                                                  with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(eager(self._on_forward_end), with_kwargs=True,
                                                              always_call=True))
        for layer in self.layers:
            self._handles.append(layer.router.register_forward_hook(eager(self._router_hook(layer))))
            if layer.read_choice is not None and layer.experts is not None:
                self._handles.append(layer.experts.register_forward_pre_hook(
                    eager(self._experts_hook(layer)), with_kwargs=True))
        if self.gate is not None:  # prepended to the routers: the recorder above sees the gated routing
            self._handles.extend(self.gate.install())
        if self.health is not None:
            self._handles.extend(self.health.install(lambda: self._forward is not None))

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            if self._forward is not None:  # re-entrant call of the root: record the outer one only
                return
            inputs = dict(kwargs)
            if args and "input_ids" not in inputs and isinstance(args[0], torch.Tensor):
                inputs["input_ids"] = args[0]
            tags: dict[str, str] = {}
            for layer_tags in self._tags:
                tags.update(layer_tags)
            self._forward = _Forward(self.step, tags, inputs)
        except Exception:
            self._hook_failed()

    def _router_hook(self, layer: MoELayer) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            forward = self._forward
            if forward is None:
                return
            try:
                logits = layer.read_logits(output).detach()
                forward.logits[layer.index] = logits
                if self.router_inputs and args and isinstance(args[0], torch.Tensor):
                    forward.router_in[layer.index] = args[0].detach().reshape(-1, args[0].shape[-1])
                if layer.read_router_choice is not None:
                    forward.choice[layer.index] = layer.read_router_choice(output, logits)
            except Exception:
                self._hook_failed()
        return hook

    def _experts_hook(self, layer: MoELayer) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            forward = self._forward
            if forward is None:
                return
            try:
                choice = layer.read_choice(args, kwargs, forward.logits.get(layer.index))
                forward.choice[layer.index] = Choice(choice.ids.detach(), choice.weights.detach(),
                                                     None if choice.kept is None else choice.kept.detach(),
                                                     choice.capacity)
            except Exception:
                self._hook_failed()
        return hook

    def _on_forward_end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        forward, self._forward = self._forward, None
        if forward is None:
            return
        self.step += 1
        try:
            collected = self._collect(forward, output)
            if collected.buffer is not None and collected.buffer.is_cuda:
                # Start the forward's one transfer without waiting for it: the record is built
                # at a later forward (or flush) once the copy is done, so the model never syncs.
                host = torch.empty(collected.buffer.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(collected.buffer, non_blocking=True)
                collected.buffer, collected.event = host, torch.cuda.Event()
                collected.event.record()
            self._in_flight.append(collected)
        except Exception:
            self._hook_failed()
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Emit the records whose transfer is done (all of them when `block`), oldest first."""
        while self._in_flight:
            collected = self._in_flight[0]
            if collected.event is not None and not block and not collected.event.query():
                return
            self._in_flight.popleft()
            try:
                if collected.event is not None:
                    collected.event.synchronize()
                record = self._finish(collected)
            except Exception:
                self._hook_failed()
                continue
            self.processor.emit(record)

    def _hook_failed(self) -> None:
        # The model thread must never see the probe fail: count, log once, carry on.
        self.hook_errors += 1
        if self.hook_errors == 1:
            log.exception("moescope probe hook failed; the forward goes on unrecorded for that layer")

    # -- building the record -------------------------------------------------------------------

    def _input_shape(self, inputs: dict[str, Any], decoder: bool) -> tuple[torch.Tensor | None, tuple]:
        names = ("decoder_input_ids", "decoder_inputs_embeds") if decoder else ("input_ids", "inputs_embeds")
        for name in names:
            value = inputs.get(name)
            if isinstance(value, torch.Tensor):
                ids = value if name.endswith("input_ids") else None
                return ids, tuple(value.shape[:2]) if value.dim() >= 2 else (1, value.shape[0])
        return None, ()

    def _collect(self, forward: _Forward, output: Any) -> _Collected:
        """Device side of a record: every reduction of the forward, packed into one buffer."""
        tensors: dict[tuple, torch.Tensor] = {}
        meta: dict[int, dict[str, Any]] = {}
        for layer in self.layers:
            logits = forward.logits.get(layer.index)
            choice = forward.choice.get(layer.index)
            if logits is None or choice is None:
                continue
            slots = layer.num_experts + layer.zero_experts
            cosel = self.coselection if self.coselection is not None else (
                layer.top_k > 1 and slots <= COSELECTION_MAX_EXPERTS)
            for name, value in reduce_layer(logits, choice, slots, layer.num_experts, cosel).items():
                tensors[(layer.index, name)] = value
            if self.health is not None:  # expert-health samples join the one transfer
                tensors.update({(layer.index, name): value for name, value in self.health.take(layer.index).items()})
            tokens = choice.ids.shape[0]
            decoder = "decoder" in layer.name
            ids, shape = self._input_shape(forward.inputs, decoder)
            if ids is not None and ids.numel() != tokens:
                ids = None
            if shape and shape[0] * shape[1] != tokens:
                shape = ()
            meta[layer.index] = dict(tokens=tokens, shape=shape, capacity=choice.capacity,
                                     trust_weight=None if self.gate is None else self.gate.weights(layer.index))
            if ids is not None and (self.routes or self.router_logits or self.router_inputs):
                tensors[(layer.index, "token_ids")] = ids.reshape(-1)
            if self.routes:
                tensors[(layer.index, "ids")] = choice.ids.to(torch.int32)
                tensors[(layer.index, "weights")] = choice.weights.to(torch.float32)
                if choice.kept is not None:
                    tensors[(layer.index, "kept")] = choice.kept
            for kind, size, source in (("logits", self.router_logits, logits),
                                       ("inputs", self.router_inputs, forward.router_in.get(layer.index))):
                if not size or source is None:
                    continue
                n = tokens if size < 0 else min(size, tokens)
                index = torch.randperm(tokens, generator=self._generator)[:n].sort().values
                tensors[(layer.index, f"{kind}_token")] = index
                index = index.to(source.device)
                tensors[(layer.index, kind)] = source.index_select(0, index).to(torch.float32)
                tensors[(layer.index, f"{kind}_top1")] = choice.ids[:, 0].index_select(0, index)

        buffer, slots = pack(tensors)
        return _Collected(forward=forward, buffer=buffer, slots=slots, meta=meta,
                          ts=dt.datetime.now(dt.timezone.utc), duration_s=time.perf_counter() - forward.started,
                          kv_cache=kv_cache_layers(output) if self.kv_cache else None)

    def _finish(self, collected: _Collected) -> StepRecord:
        """Host side of a record, from the transferred buffer."""
        forward, meta = collected.forward, collected.meta
        host = unpack(collected.buffer, collected.slots)
        layer_steps = []
        active = float(self.shared_params)
        for layer in self.layers:
            if layer.index not in meta:
                continue
            info = meta[layer.index]
            got = {name: value for (index, name), value in host.items() if index == layer.index}
            tokens = info["tokens"]
            per_token = float(got["real_slots_kept"][0]) / tokens * layer.params_per_expert if tokens else 0.0
            active += per_token
            capacity = info["capacity"]  # set per forward where the router sizes it to the batch (NLLB)
            capacity_use = None
            if capacity is None and layer.expert_capacity is not None:
                sequences = info["shape"][0] if info["shape"] else 1
                capacity = layer.expert_capacity * sequences  # Switch: a capacity per sequence
            if capacity is not None:
                capacity_use = float(got["expert_load"][: layer.num_experts].max()) / capacity
            layer_steps.append(LayerStep(
                layer=layer.index, tokens=tokens, expert_load=got["expert_load"],
                gate_weight_sum=got["gate_weight_sum"].astype(np.float64),
                router_entropy_mean=float(got["entropy_mean"][0]),
                router_entropy_p95=float(got["entropy_p95"][0]),
                top1_margin_mean=float(got["margin_mean"][0]),
                dropped_tokens=int(got["dropped_tokens"][0]),
                dropped_assignments=int(got["dropped_assignments"][0]), capacity=capacity,
                capacity_use=capacity_use, active_params_per_token=per_token,
                router_prob_sum=got["router_prob_sum"].astype(np.float64),
                coselection=got.get("coselection"),
                routes=self._routes(got, info) if self.routes else None,
                router_logits=self._sample(got, "logits"), router_inputs=self._sample(got, "inputs"),
                **self._health_fields(info, got)))

        ids, shape = self._input_shape(forward.inputs, decoder=False)
        batch_size, seq_len = shape if shape else (1, layer_steps[0].tokens if layer_steps else 0)
        return StepRecord(
            run_id=self.run.run_id, step=forward.step, ts=collected.ts, duration_s=collected.duration_s,
            tokens=batch_size * seq_len, batch_size=batch_size, seq_len=seq_len, active_params=active,
            total_params=self.total_params, tags=forward.tags, layers=layer_steps, kv_cache=collected.kv_cache)

    def _health_fields(self, info: dict[str, Any], got: dict[str, np.ndarray]) -> dict[str, Any]:
        fields: dict[str, Any] = HealthSampler.fields(got) if self.health is not None else {}
        if info["trust_weight"] is not None:
            fields["trust_weight"] = info["trust_weight"]  # as it was during the forward
        return fields

    @staticmethod
    def _routes(got: dict[str, np.ndarray], info: dict[str, Any]) -> Routes:
        ids = got["ids"]
        tokens = ids.shape[0]
        row = np.arange(tokens, dtype=np.int32)
        if info["shape"]:
            seq_len = info["shape"][1]
            sequence, position = row // seq_len, row % seq_len
        else:
            sequence, position = np.zeros_like(row), row
        kept = got.get("kept")
        return Routes(expert_ids=ids, gate_weights=got["weights"],
                      kept=kept.reshape(ids.shape) if kept is not None else np.ones(ids.shape, dtype=bool),
                      token_ids=got.get("token_ids"), sequence=sequence, position=position)

    @staticmethod
    def _sample(got: dict[str, np.ndarray], kind: str) -> TokenSample | None:
        if kind not in got:
            return None
        token = got[f"{kind}_token"].astype(np.int32)
        token_ids = got.get("token_ids")
        return TokenSample(token=token, token_ids=None if token_ids is None else token_ids[token],
                           values=got[kind], top1_expert=got[f"{kind}_top1"].astype(np.int32))

    # -- public API ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def tag(self, **tags: Any) -> Iterator[None]:
        """Tags (key=value) that land on every record made inside the block; blocks nest."""
        self._tags.append({str(k): str(v) for k, v in tags.items()})
        try:
            yield
        finally:
            self._tags.pop()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Write everything recorded so far; False if the writer did not finish in time."""
        self._drain(block=True)
        return self.processor.force_flush(timeout_s)

    def close(self) -> None:
        """Remove exactly the hooks this session added, drain and flush the writer; safe twice."""
        if self.closed:
            return
        self.closed = True
        self._remove_hooks()
        self._drain(block=True)
        self.processor.shutdown()

    def probe_stats(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        """What the probe wrote (rows per table) and dropped (rows per table and reason), so far."""
        written = dict(self.parquet.written_rows) if self.parquet is not None else {}
        return written, dict(self.processor.dropped_rows)

    @property
    def dropped_records(self) -> int:
        return sum(self.processor.dropped_records.values())

    def __enter__(self) -> ProbeSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def kv_cache_layers(output: Any) -> list[KVCacheLayer] | None:
    """Bytes held by the KV cache per attention layer, from the cache the forward returned.

    Reads only tensor shapes and dtypes on the host: no device transfer.
    """
    cache = getattr(output, "past_key_values", None)
    if cache is None and isinstance(output, dict):
        cache = output.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    result = []
    for index, cache_layer in enumerate(layers):
        tensors = [v for v in vars(cache_layer).values() if isinstance(v, torch.Tensor)]
        keys = getattr(cache_layer, "keys", None)
        seq_len = int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() >= 2 else 0
        result.append(KVCacheLayer(layer=index, bytes=sum(t.numel() * t.element_size() for t in tensors),
                                   seq_len=seq_len))
    return result


def _is_compiled(model: nn.Module) -> bool:
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    wrapper = getattr(optimized, "OptimizedModule", None)
    return (wrapper is not None and isinstance(model, wrapper)) or getattr(
        model, "_compiled_call_impl", None) is not None


def attach(model: nn.Module, store: str | os.PathLike | None = None, *, routes: bool = False,
           router_logits: bool | int = False, router_inputs: bool | int = False, kv_cache: bool = False,
           coselection: bool | None = None, tags: dict | None = None, run_id: str | None = None,
           exporters: Sequence[Any] = (), specs: Iterable[MoESpec] = (),
           layers: str | Sequence[str] | Callable[[str], bool] | None = None, policy: str = "block",
           max_queue: int = 256, flush_interval_s: float = 5.0, sample_seed: int = 0, health: bool = False,
           trust_gate: str | None = None, health_options: dict | None = None,
           trust_policy: Any = None) -> ProbeSession:
    """Hook every MoE layer of `model` and record each forward pass.

    store: a folder to write Parquet tables into (see the README for the tables); exporters:
    more consumers of the records (e.g. the Prometheus exporter, an `InMemoryExporter`).
    routes: write per-token expert ids and gate weights. router_logits / router_inputs: True for
    every token, an int for a random sample of that many tokens per layer and forward.
    kv_cache: record KV-cache bytes per attention layer (useful during `generate`).
    specs: `MoESpec`s describing custom MoE modules. layers: only hook blocks with these names
    (a name, a list of names or a predicate). policy: "block" (lossless, the model waits if the
    disk cannot keep up) or "drop" (the model never waits; drops are counted in probe_stats).
    health: sample expert outputs and weight fingerprints and score expert health (docs/health.md;
    health_options go to `probe.health.HealthSampler`). trust_gate: None (default: nothing in the
    model changes), "manual" (a `TrustGate` at `session.gate`, changed by `session.trust.override`)
    or "auto" (health on, and the policy gates unhealthy experts). trust_policy: an
    `alerts.trust_policy.TrustPolicy` (thresholds, alert sink); a default one otherwise.

    Returns the session (a context manager). Raises NoMoELayersError for a model with no MoE layer
    and ProbeAttachError for a model compiled before attaching.
    """
    if _is_compiled(model):
        raise ProbeAttachError(
            "this model was compiled with torch.compile before attaching: compiled graphs do not run "
            "hooks added afterwards, so nothing would be recorded. Attach first, then compile: "
            "`session = probe.attach(model, ...); model = torch.compile(model)`.")
    select = None
    if isinstance(layers, str):
        select = lambda name: name == layers  # noqa: E731
    elif isinstance(layers, Sequence):
        wanted = set(layers)
        select = lambda name: name in wanted  # noqa: E731
    elif callable(layers):
        select = layers
    moe_layers = find_moe_layers(model, specs=specs, select=select)
    return ProbeSession(model, moe_layers, exporters=exporters, store=store, routes=routes,
                        router_logits=router_logits, router_inputs=router_inputs, kv_cache=kv_cache,
                        coselection=coselection, tags=tags, run_id=run_id, policy=policy,
                        max_queue=max_queue, flush_interval_s=flush_interval_s, sample_seed=sample_seed,
                        health=health, trust_gate=trust_gate, health_options=health_options,
                        trust_policy=trust_policy)

"""Routing jitter: does the same token go to the same experts when a server runs it differently?

"The same sentence goes to experts A+B on the first call and A+C on the second" breaks expert
caching, reproducibility and A/B comparisons. `jitter(model, inputs)` runs the same inputs again
under the conditions a server really varies and compares every (token, layer) routing with a
baseline run:

- ``alone``: each input in a batch of its own, in the model's dtype and attention: the reference;
- ``repeat``: ``alone`` again (non-determinism: CPU threads, GPU kernels that reduce in any order);
- ``batch=B``: inputs batched B at a time with others, right-padded (with an attention mask and
  position ids counted from the mask exactly as `generate` builds them: `generate_position_ids`,
  every pad slot at position 0); compared with ``alone``;
- ``batch=B,left_pad``: the same batches left-padded, compared with ``batch=B`` (the padding side
  alone differs);
- ``batch=C``: another batch size, right-padded, compared with ``alone``;
- ``bfloat16`` / ``float16``: ``alone`` with the model cast as `model.to(dtype)` casts it (every
  floating parameter and buffer), compared with ``alone``; a dtype whose ops the device lacks is
  skipped and the reason kept;
- ``attn=sdpa`` / ``attn=eager``: ``alone`` under transformers' other attention implementation,
  where the model offers one.

Per condition and layer: the tokens compared, how many changed their expert set (the k experts
chosen, as the probe reads the final choice: bias correction, grouped top-k included), their top-1
(of the chosen experts, the one with the highest router logit; ties to the earlier slot), the
experts that really processed them (capacity drops), the largest change of a gate weight (dense
over experts: a weight that appears or vanishes counts whole), and histograms of the baseline's
top-k margin for the tokens whose set changed and for the rest. The margin is in router *logits*:
the k-th largest logit minus the (k+1)-th of the baseline run (for a softmax router, ln(p_k /
p_k+1)). Flips should sit at tiny margins; a flip at a wide margin means the condition changed the
hidden states, not a rounding.

The forwards and the comparison rules (top-1, margins, their histogram) are the ones the mismatch
check uses too: `moescope.analyses.routing_compare`.

Results land in a store (`store=`) as the run's `jitter` rows (one per condition and layer) and
`jitter_tokens` rows (the flipped tokens, at most `max_listed` per condition and layer, with their
neighbours' ids for context), plus a `runs` row (source "jitter") and `layers` rows.

Sharp edges: the dtype conditions cast the model in place and cast it back (the original tensors
are kept, so the model returns bit for bit; half as much memory again in the meantime); the
model runs in eval mode and is left in the mode it came in; decoder-only models only (an
encoder-decoder's decoder inputs are not varied).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from moescope.analyses.check_runs import model_run, write_check_run
from moescope.analyses.routing_compare import (
    CONTEXT_AFTER,
    CONTEXT_BEFORE,
    MARGIN_EDGES,
    MARGIN_KIND,
    RoutingError,
    expert_change,
    forward_routing,
    generate_position_ids,
    margin_histogram,
    margins,
    pad_id,
    top1_expert,
)
from moescope.probe.adapters import MoELayer, MoESpec, find_moe_layers
from moescope.probe.capture import LayerRouting, RoutingCapture

if TYPE_CHECKING:
    from moescope.store.location import StoreLocation

__all__ = [
    "BASELINE", "CONDITION_KINDS", "DEFAULT_DTYPES", "LAYER_COLUMNS", "TOKEN_COLUMNS", "Condition", "JitterError",
    "JitterReport", "compare_layer", "compare_runs", "jitter", "jitter_line", "plan_conditions", "token_inputs",
    "write_report",
    # the comparison helpers the mismatch check shares (`moescope.analyses.routing_compare`), here as before
    "CONTEXT_AFTER", "CONTEXT_BEFORE", "MARGIN_EDGES", "MARGIN_KIND", "expert_change", "forward_routing",
    "generate_position_ids", "margin_histogram", "margins", "pad_id", "top1_expert",
]

CONDITION_KINDS = ("repeat", "batched", "left_padding", "batch_size", "dtype", "attention")
DEFAULT_DTYPES = ("bfloat16", "float16")
BASELINE = "alone"


class JitterError(ValueError):
    """The jitter check cannot run as asked; the message says what to do."""


@dataclass(frozen=True)
class Condition:
    """One way of running the inputs: batch size, padding side, dtype and attention, and the
    condition its routing is compared with (`baseline`)."""

    name: str
    baseline: str
    description: str
    batch_size: int = 1
    padding_side: str = "right"
    dtype: str | None = None  # None: the model's own
    attn_implementation: str | None = None  # None: the model's own


@dataclass
class JitterReport:
    """What `jitter` measured.

    layers: one row per (condition, layer): condition, baseline, description, layer, tokens (token
    and layer pairs compared), set_changed, top1_changed, kept_changed (counts), their *_fraction
    (of tokens), max_weight_change (absolute gate weight), changed_by_margin / unchanged_by_margin
    (counts per bin of MARGIN_EDGES), listed (tokens listed in `tokens`), and the condition's
    batch_size, padding_side, dtype, attn_implementation.
    tokens: one row per listed token whose set or top-1 changed: condition, layer, sequence (the
    input's index), position, token_id, set_changed, top1_changed, topk_margin, top1_margin
    (baseline logits), baseline_ids, condition_ids, baseline_weights, condition_weights,
    context_ids, context_start.
    skipped: condition -> why it could not run (e.g. a dtype the device lacks).
    """

    layers: pd.DataFrame
    tokens: pd.DataFrame
    skipped: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None
    model_class: str = ""

    def line(self) -> str:
        """One line for a person: the worst condition's share of changed expert sets, every
        condition's in brief, and where the flips sit (median baseline margin, flipped vs not)."""
        if self.layers.empty:
            return "Routing jitter: nothing compared."
        by = self.layers.groupby("condition", sort=False)[["tokens", "set_changed", "top1_changed"]].sum()
        by["share"] = by.set_changed / by.tokens.where(by.tokens > 0)
        parts = [f"{name} {row.share:.2%}" for name, row in by.iterrows()]
        flipped = self.tokens[self.tokens.set_changed] if not self.tokens.empty else self.tokens
        where = ""
        if len(flipped):
            where = (f"; median top-k margin of the flipped {flipped.topk_margin.median():.3g} logits, of the "
                     f"unchanged in the bin from {self.median_unchanged_margin():g}")
        return ("Routing jitter, expert set changed for (token, layer) pairs: " + ", ".join(parts) + where
                + (f"; skipped: {', '.join(self.skipped)}" if self.skipped else ""))

    def median_unchanged_margin(self) -> float:
        """The median bin's lower edge of the tokens whose set did not change (every condition and
        layer pooled): the histogram is all that is kept of them."""
        counts = np.sum(np.stack(self.layers.unchanged_by_margin.to_numpy()), axis=0)
        if not counts.sum():
            return math.nan
        return MARGIN_EDGES[int(np.searchsorted(np.cumsum(counts), counts.sum() / 2))]


# -- conditions --------------------------------------------------------------------------------

def plan_conditions(kinds: Sequence[str], inputs: int, batch_size: int, other_batch_size: int,
                    dtypes: Sequence[str], attn_implementation: str | None) -> list[Condition]:
    """The concrete conditions for `kinds` (of CONDITION_KINDS), in the order they are run.
    Batch sizes are capped at the number of inputs. Raises JitterError for an unknown kind or
    dtype, or a batch size below 1."""
    unknown = [k for k in kinds if k not in CONDITION_KINDS]
    if unknown:
        raise JitterError(f"unknown condition {', '.join(unknown)}; choose from {', '.join(CONDITION_KINDS)}")
    if batch_size < 1 or other_batch_size < 1:
        raise JitterError(f"batch sizes must be at least 1, got {batch_size} and {other_batch_size}")
    batch, other = min(batch_size, inputs), min(other_batch_size, inputs)
    batched = f"batch={batch}"
    out = []
    for kind in kinds:
        if kind == "repeat":
            out.append(Condition("repeat", BASELINE, "each input alone, run again"))
        elif kind == "batched":
            out.append(Condition(batched, BASELINE, f"batched {batch} at a time, right-padded", batch))
        elif kind == "left_padding":
            if "batched" not in kinds:
                out.append(Condition(batched, BASELINE, f"batched {batch} at a time, right-padded", batch))
            out.append(Condition(f"{batched},left_pad", batched, f"batched {batch} at a time, left-padded",
                                 batch, "left"))
        elif kind == "batch_size" and other != batch:
            out.append(Condition(f"batch={other}", BASELINE, f"batched {other} at a time, right-padded", other))
        elif kind == "dtype":
            for name in dtypes:
                if not isinstance(getattr(torch, str(name), None), torch.dtype):
                    raise JitterError(f"unknown dtype {name!r}; use a torch dtype name such as bfloat16 or float16")
                out.append(Condition(str(name), BASELINE, f"each input alone, model cast to {name}", dtype=str(name)))
        elif kind == "attention" and attn_implementation in ("eager", "sdpa"):
            other_attn = "sdpa" if attn_implementation == "eager" else "eager"
            out.append(Condition(f"attn={other_attn}", BASELINE,
                                 f"each input alone, attention '{other_attn}' instead of '{attn_implementation}'",
                                 attn_implementation=other_attn))
    unique: dict[str, Condition] = {}
    for condition in out:
        unique.setdefault(condition.name, condition)  # the first of each name, in order
    return list(unique.values())


@contextlib.contextmanager
def _cast(model: nn.Module, dtype: str | None) -> Iterator[None]:
    """The model cast to `dtype` inside the block, its original tensors put back after."""
    if dtype is None:
        yield
        return
    params = [(p, p.data) for p in model.parameters()]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    try:
        model.to(getattr(torch, dtype))
        yield
    finally:
        for param, original in params:
            param.data = original
        for module, name, original in buffers:
            module._buffers[name] = original


@contextlib.contextmanager
def _attention(model: nn.Module, implementation: str | None) -> Iterator[None]:
    if implementation is None:
        yield
        return
    config = getattr(model, "config", None)
    before = str(getattr(config, "_attn_implementation", None) or "eager")
    set_attn: Callable[[str], Any] = model.set_attn_implementation  # type: ignore[assignment]
    set_attn(implementation)
    try:
        yield
    finally:
        set_attn(before)


# -- running -----------------------------------------------------------------------------------

def _run(model: nn.Module, capture: RoutingCapture, inputs: Sequence[Sequence[int]], condition: Condition,
         pad_id: int, device: torch.device, tick: Callable[[], None]) -> list[list[LayerRouting]]:
    routed: list[list[LayerRouting]] = []
    with _cast(model, condition.dtype), _attention(model, condition.attn_implementation):
        for first in range(0, len(inputs), condition.batch_size):
            try:
                routed += forward_routing(model, capture, inputs[first:first + condition.batch_size],
                                          condition.padding_side, pad_id, device)
            except RoutingError as e:
                raise JitterError(str(e)) from e
            tick()
    return routed


# -- comparing ---------------------------------------------------------------------------------

def _dense(ids: np.ndarray, values: np.ndarray | None, slots: int) -> np.ndarray:
    """(tokens, slots): `values` (True where None) at each token's ids, zero elsewhere."""
    out = np.zeros((len(ids), slots), dtype=bool if values is None else np.float64)
    np.put_along_axis(out, ids, True if values is None else values.astype(np.float64), axis=1)
    return out


def compare_layer(base: LayerRouting, other: LayerRouting, top_k: int) -> dict[str, Any]:
    """The figures of one layer: counts, largest gate-weight change, margins and which tokens changed."""
    slots = base.logits.shape[1]
    set_changed = (_dense(base.ids, None, slots) != _dense(other.ids, None, slots)).any(axis=1)
    kept_changed = (_kept_mask(base, slots) != _kept_mask(other, slots)).any(axis=1)
    top1_changed = top1_expert(base.logits, base.ids) != top1_expert(other.logits, other.ids)
    weight_change = np.abs(_dense(base.ids, base.weights, slots) - _dense(other.ids, other.weights, slots))
    topk_margin, top1_margin = margins(base.logits, top_k)
    return dict(tokens=len(base.ids), set_changed=set_changed, top1_changed=top1_changed, kept_changed=kept_changed,
                max_weight_change=float(weight_change.max()) if weight_change.size else 0.0,
                topk_margin=topk_margin, top1_margin=top1_margin)


def _kept_mask(routing: LayerRouting, slots: int) -> np.ndarray:
    """(tokens, slots) bool: the experts that processed each token (slots kept at capacity)."""
    out = np.zeros((len(routing.ids), slots), dtype=bool)
    kept = routing.kept.reshape(-1)
    rows = np.repeat(np.arange(len(routing.ids)), routing.ids.shape[1])
    out[rows[kept], routing.ids.reshape(-1)[kept]] = True
    return out


def _concat(pieces: Sequence[LayerRouting]) -> LayerRouting:
    return LayerRouting(*(np.concatenate([getattr(p, name) for p in pieces])
                          for name in ("logits", "ids", "weights", "kept")))


def compare_runs(layers: Sequence[MoELayer], inputs: Sequence[Sequence[int]], condition: Condition, order: int,
                 base: list[list[LayerRouting]], other: list[list[LayerRouting]],
                 max_listed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The `jitter` rows (one per layer) and listed `jitter_tokens` rows of one condition against its
    baseline; `base` and `other` hold per input, per layer, the routing of the input's tokens."""
    sequence = np.concatenate([np.full(len(ids), i) for i, ids in enumerate(inputs)])
    position = np.concatenate([np.arange(len(ids)) for ids in inputs])
    token_ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in inputs])
    layer_rows, token_rows = [], []
    for position_of_layer, layer in enumerate(layers):
        a = _concat([routed[position_of_layer] for routed in base])
        b = _concat([routed[position_of_layer] for routed in other])
        figures = compare_layer(a, b, a.ids.shape[1])
        changed = figures["set_changed"]
        listed = np.flatnonzero(changed | figures["top1_changed"])[:max(0, max_listed)]
        layer_rows.append(dict(
            condition=condition.name, condition_order=order, baseline=condition.baseline,
            description=condition.description, layer=layer.index, tokens=figures["tokens"],
            set_changed=int(changed.sum()), top1_changed=int(figures["top1_changed"].sum()),
            kept_changed=int(figures["kept_changed"].sum()), max_weight_change=figures["max_weight_change"],
            changed_by_margin=margin_histogram(figures["topk_margin"][changed]),
            unchanged_by_margin=margin_histogram(figures["topk_margin"][~changed]), listed=len(listed)))
        for row in listed:
            seq, pos = int(sequence[row]), int(position[row])
            start = max(0, pos - CONTEXT_BEFORE)
            token_rows.append(dict(
                condition=condition.name, layer=layer.index, sequence=seq, position=pos,
                token_id=int(token_ids[row]), set_changed=bool(changed[row]),
                top1_changed=bool(figures["top1_changed"][row]), topk_margin=float(figures["topk_margin"][row]),
                top1_margin=float(figures["top1_margin"][row]), baseline_ids=a.ids[row].tolist(),
                condition_ids=b.ids[row].tolist(), baseline_weights=a.weights[row].tolist(),
                condition_weights=b.weights[row].tolist(),
                context_ids=[int(t) for t in inputs[seq][start:pos + CONTEXT_AFTER + 1]], context_start=start))
    return layer_rows, token_rows


# -- inputs ------------------------------------------------------------------------------------

def token_inputs(inputs: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor, tokenizer: Any = None,
                 max_tokens: int | None = None) -> list[list[int]]:
    """`inputs` as lists of token ids: texts through `tokenizer` (as a server tokenizes them,
    special tokens included), id sequences as given; each cut to `max_tokens`. Raises JitterError for
    no inputs, texts without a tokenizer, or an input with no token."""
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.tolist() if inputs.dim() == 2 else [inputs.tolist()]
    inputs = list(inputs)
    if not inputs:
        raise JitterError("no inputs: give at least one text or token-id sequence")
    if any(isinstance(x, str) for x in inputs):
        if tokenizer is None:
            raise JitterError("texts need a tokenizer: pass tokenizer= (e.g. AutoTokenizer.from_pretrained(folder)) "
                              "or token ids instead of texts")
        encoded = [list(tokenizer(str(text))["input_ids"]) for text in inputs]
    else:
        encoded = [[int(t) for t in (x.tolist() if isinstance(x, torch.Tensor) else x)] for x in inputs]
    if max_tokens is not None:
        encoded = [ids[:max_tokens] for ids in encoded]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise JitterError(f"input {empty[0]} has no token: give non-empty texts")
    return encoded


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


# -- the check ---------------------------------------------------------------------------------

def jitter(model: nn.Module, inputs: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor, *,
           tokenizer: Any = None, conditions: Sequence[str] = CONDITION_KINDS, batch_size: int = 8,
           other_batch_size: int = 3, dtypes: Sequence[str] = DEFAULT_DTYPES, max_tokens: int | None = None,
           max_listed: int = 1000, specs: Sequence[MoESpec] = (),
           store: str | os.PathLike | StoreLocation | None = None,
           run_id: str | None = None, tags: dict[str, str] | None = None, progress: bool = False,
           new_run: bool = True) -> JitterReport:
    """Run `inputs` under each condition and compare every token's routing in every MoE layer with the baseline.

    The baseline runs each input alone, in the model's dtype and attention; each condition varies
    one thing a server varies (see the module docstring). The model runs in eval mode and is left in
    the mode it came in; the dtype conditions cast it in place and back (bit for bit; half as much
    memory again in the meantime). A condition the model or device cannot run (a dtype without
    kernels, an attention implementation not installed) is skipped and named in `report.skipped`.

    Args:
        model: a decoder-only MoE model (an encoder-decoder is refused).
        inputs: texts (with `tokenizer`), token-id sequences, or a tensor of ids (one row per input).
        tokenizer: turns texts into ids, as a server tokenizes them (special tokens included).
        conditions: which of CONDITION_KINDS to run: "repeat" (alone again), "batched" (batched
            `batch_size` at a time, right-padded), "left_padding" (the same batches left-padded,
            compared with right-padded), "batch_size" (batched `other_batch_size` at a time), "dtype"
            (the model cast to each of `dtypes`), "attention" (transformers' other attention
            implementation, eager or sdpa). Default: all.
        batch_size: inputs per batch of the batched conditions (capped at the number of inputs).
        other_batch_size: the other batch size of the "batch_size" condition (capped likewise; not
            run when it equals `batch_size`).
        dtypes: torch dtype names of the "dtype" condition.
        max_tokens: cut each input to this many tokens; None: no cut.
        max_listed: the most flipped tokens kept per condition and layer (`jitter_tokens` rows).
        specs: `MoESpec`s for custom MoE modules.
        store: with a store (a folder or a URL), the results are written there as a run (`jitter`,
            `jitter_tokens`, `layers` and a `runs` row with source "jitter"); None: not written.
        run_id: the run id in the store (None: a new id).
        tags: key=value tags of the stored run.
        progress: show a progress bar over the forwards.
        new_run: False: `run_id` is a run the store already holds (the probe's run of the same
            model, say) and only the `jitter` and `jitter_tokens` rows are added to it; its own
            `runs` and `layers` rows stay as they are, and the dashboard's Routing jitter page shows
            the check on that run.

    Returns:
        A JitterReport: per condition and layer the tokens compared and how many changed their expert
            set, their top-1 and their kept experts; the flipped tokens; the skipped conditions; and
            `run_id` when stored.

    Raises:
        JitterError: for inputs or options it cannot use (no inputs, texts without a tokenizer, an
            empty input, an unknown condition or dtype, a batch size below 1, an encoder-decoder
            model, `new_run=False` without a store and a run id); the message says what to do.
        probe.NoMoELayersError: for a model without MoE layers.
        OSError: when the store refused the rows.
    """
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise JitterError(f"{type(model).__name__} is an encoder-decoder model; the jitter check runs decoder-only "
                          "models (one router row per input token)")
    if not new_run and (store is None or run_id is None):
        raise JitterError("new_run=False adds the check to a run the store holds: give store= and that run's run_id=")
    ids = token_inputs(inputs, tokenizer, max_tokens)
    layers = find_moe_layers(model, specs)
    attn = getattr(config, "_attn_implementation", None)
    plan = plan_conditions(conditions, len(ids), batch_size, other_batch_size, dtypes, attn)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model_dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).removeprefix("torch.")
    pad = pad_id(model, tokenizer)
    runs, skipped = _run_conditions(model, layers, ids, plan, pad, device, progress)
    report = _compare_conditions(model, layers, ids, plan, runs, skipped, max_listed, model_dtype, attn)
    if store is not None:
        report.run_id = write_report(store, report, model, layers, run_id, tags, new_run=new_run)
    return report


def _run_conditions(model: nn.Module, layers: Sequence[MoELayer], ids: list[list[int]], plan: Sequence[Condition],
                    pad_id: int, device: torch.device, progress: bool
                    ) -> tuple[dict[str, list[list[LayerRouting]]], dict[str, str]]:
    """Run the baseline, then each planned condition, capturing every layer's routing, the model in eval
    mode meanwhile. Returns the runs by condition name, and the conditions skipped with the reason."""
    from tqdm.auto import tqdm

    baseline = Condition(BASELINE, "", "each input alone")
    forwards = sum(math.ceil(len(ids) / c.batch_size) for c in [baseline, *plan])
    runs: dict[str, list[list[LayerRouting]]] = {}
    skipped: dict[str, str] = {}
    was_training = model.training
    bar = tqdm(total=forwards, desc="jitter", unit="fwd", disable=not progress, leave=False)
    try:
        model.eval()
        with RoutingCapture(layers) as capture, torch.no_grad():
            runs[BASELINE] = _run(model, capture, ids, baseline, pad_id, device, lambda: bar.update())
            for condition in plan:
                bar.set_postfix_str(condition.name)
                if condition.baseline not in runs:
                    skipped[condition.name] = f"its baseline {condition.baseline} did not run"
                    continue
                try:
                    runs[condition.name] = _run(model, capture, ids, condition, pad_id, device, lambda: bar.update())
                except JitterError:
                    raise
                except (RuntimeError, NotImplementedError, ValueError, ImportError, TypeError) as e:
                    skipped[condition.name] = _reason(e)
                    capture.discard()
    finally:
        model.train(was_training)
        bar.close()
    return runs, skipped


def _compare_conditions(model: nn.Module, layers: Sequence[MoELayer], ids: list[list[int]],
                        plan: Sequence[Condition], runs: dict[str, list[list[LayerRouting]]],
                        skipped: dict[str, str], max_listed: int, model_dtype: str, attn: str | None
                        ) -> JitterReport:
    """Compare each condition that ran with its baseline, layer by layer, into a `JitterReport`."""
    layer_rows: list[dict[str, Any]] = []
    token_rows: list[dict[str, Any]] = []
    for order, condition in enumerate(plan):
        if condition.name not in runs:
            continue
        rows, listed = compare_runs(layers, ids, condition, order, runs[condition.baseline], runs[condition.name],
                                    max_listed)
        settings = dict(batch_size=condition.batch_size, padding_side=condition.padding_side,
                        dtype=condition.dtype or model_dtype, attn_implementation=condition.attn_implementation or attn)
        layer_rows += [dict(row, **settings) for row in rows]
        token_rows += listed
    frame = pd.DataFrame(layer_rows, columns=list(LAYER_COLUMNS))
    for name in ("set_changed", "top1_changed", "kept_changed"):
        frame[f"{name}_fraction"] = frame[name] / frame.tokens.where(frame.tokens > 0)
    return JitterReport(frame, pd.DataFrame(token_rows, columns=list(TOKEN_COLUMNS)), skipped,
                        model_class=type(model).__name__)


LAYER_COLUMNS = ("condition", "condition_order", "baseline", "description", "layer", "tokens", "set_changed",
                 "top1_changed", "kept_changed", "max_weight_change", "changed_by_margin", "unchanged_by_margin",
                 "listed", "batch_size", "padding_side", "dtype", "attn_implementation")
TOKEN_COLUMNS = ("condition", "layer", "sequence", "position", "token_id", "set_changed", "top1_changed",
                 "topk_margin", "top1_margin", "baseline_ids", "condition_ids", "baseline_weights",
                 "condition_weights", "context_ids", "context_start")


def jitter_line(model: nn.Module, inputs: Sequence[str] | Sequence[Sequence[int]], tokenizer: Any = None,
                **options: Any) -> str:
    """`jitter(model, inputs, ...)`'s one line for a person (`JitterReport.line`); options as `jitter`'s."""
    return jitter(model, inputs, tokenizer=tokenizer, **options).line()


# -- the store ---------------------------------------------------------------------------------

def write_report(store: str | os.PathLike | StoreLocation, report: JitterReport, model: nn.Module,
                 layers: Sequence[MoELayer], run_id: str | None = None, tags: dict[str, str] | None = None,
                 *, new_run: bool = True) -> str:
    """Write `report` as run `run_id` (a new id when None): its `jitter` and `jitter_tokens` rows,
    then its `layers` rows and its `runs` row (source "jitter") last, so that the run appears
    complete or not at all (`moescope.analyses.check_runs.write_check_run`); with `new_run=False`,
    only the `jitter` and `jitter_tokens` rows, into the existing run `run_id`. Returns the run id;
    raises OSError when the store refused rows and JitterError for `new_run=False` without a run id."""
    from moescope.core.runs import new_run_id
    from moescope.store.location import open_location

    location = open_location(store)
    if location.is_local and os.path.isfile(location.url):
        raise JitterError(f"the store {location.url!r} is a file: give a folder (it is created if missing)")
    if not new_run and run_id is None:
        raise JitterError("new_run=False adds the check to a run the store holds: give that run's run_id")
    run = model_run(model, layers, run_id or new_run_id(), dt.datetime.now(dt.timezone.utc), tags)
    jitter_rows = [dict(row, run_id=run.run_id, ts=run.started_at, margin_kind=MARGIN_KIND,
                        margin_edges=list(MARGIN_EDGES), changed_by_margin=list(row["changed_by_margin"]),
                        unchanged_by_margin=list(row["unchanged_by_margin"]), rank=0)
                   for row in report.layers[list(LAYER_COLUMNS)].to_dict("records")]
    token_rows = [dict(row, run_id=run.run_id, rank=0) for row in report.tokens.to_dict("records")]
    write_check_run(location, run, "jitter", [("jitter", jitter_rows), ("jitter_tokens", token_rows)],
                    new_run=new_run)
    return run.run_id

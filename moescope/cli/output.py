"""`--format json`: every analysis command's machine-readable document, and the one serialiser.

`summary`, `placement`, `traffic`, `whatif cache`, `jitter` and `mismatch` print a table by default;
with `--format json` they print ONE JSON document on stdout instead, built by this module from the
same report objects the table prints (a `*_document` function per command: no second computation),
and everything else they say (progress bars, "wrote ..." notes) goes to stderr. Errors are unchanged:
a message on stderr and the command's exit status.

Every document is an object with:

- `schema_version` (`SCHEMA_VERSION`): raised when a key is renamed, removed or changes meaning;
  a key added leaves it as it is.
- `command`: the command that printed it (`placement`, `whatif cache`, ...).
- `units`: the unit of each key that has one, by its path (`layers[].tokens`; from `UNITS`, by key
  name); a key not in it is a label, an id, an index or a flag.
- the command's keys (`DOCUMENTS`: the documented key list; the reference page is generated from it).

Values: a table of the report is a list of rows (objects with the same keys); a mapping whose keys
are data (a condition, a reason) is a list of rows too, so that every key is documented. Floats are
written with full precision (Python's shortest repr that reads back to the same double). JSON has
no NaN or infinity: a figure that is not defined (no data, a source that does not record it, a
division by zero) or not finite is `null`, as is a missing value; nothing else is null.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["DOCUMENTS", "FORMATS", "SCHEMA_VERSION", "UNITS", "Document", "document", "document_keys",
           "jitter_document", "jsonable", "mismatch_document", "notes", "placement_document", "rebalance_document",
           "summary_document", "traffic_document", "wants_json", "whatif_cache_document", "write_document"]

SCHEMA_VERSION = 1
FORMATS = ("table", "json")

# the unit of a key, by its name, in every document (one meaning per name)
UNITS: dict[str, str] = {
    "tokens": "tokens", "layer_tokens": "tokens (summed over layers)", "dropped_tokens": "tokens",
    "forwards": "forwards", "steps": "forwards", "window_start": "step", "window_end": "step (exclusive)",
    "fit_start": "step", "window_steps": "forwards", "context_start": "token position",
    "total_params": "parameters", "active_params_per_token": "parameters",
    "max_over_mean": "ratio (busiest expert / mean)", "load_cv": "ratio (std / mean)",
    "entropy": "nats", "entropy_norm": "ratio (H / ln E)",
    "dropped_rate": "fraction of tokens", "active_fraction": "fraction of parameters",
    "slots": "slots (kept top-k assignments)", "rank_slots": "slots per rank", "rank_tokens": "tokens per rank",
    "hottest_expert_slots": "slots", "rank_load": "slots per rank",
    "balancedness": "ratio (mean / max over ranks)", "imbalance": "ratio ((max - mean) / mean)",
    "fit": "ratio (mean / max over ranks)", "later": "ratio (mean / max over ranks)",
    "last": "ratio (mean / max over ranks)", "decay": "ratio difference", "gain": "ratio difference",
    "windows": "windows",
    "remote_ranks_mean": "ranks per token", "floor_remote_ranks": "ranks per token",
    "remote_nodes_mean": "nodes per token", "floor_remote_nodes": "nodes per token",
    "remote_ranks_histogram": "tokens per count of remote ranks", "remote_nodes_histogram":
        "tokens per count of remote nodes",
    "rank_matrix": "tokens (home rank x rank)", "node_matrix": "tokens (home node x node)",
    "gpu_sends": "sends", "rdma_sends": "sends", "intra_node_share": "fraction of GPU sends",
    "busiest_link_tokens": "tokens", "busiest_node_link_tokens": "tokens",
    "dispatch_bytes_per_forward": "bytes per forward", "combine_bytes_per_forward": "bytes per forward",
    "rdma_dispatch_bytes_per_forward": "bytes per forward", "rdma_combine_bytes_per_forward": "bytes per forward",
    "limited_changed_share": "fraction of tokens", "limited_moved_weight": "top-k gate weight per token",
    "limited_moved_weight_changed": "top-k gate weight per changed token",
    "hit_rate": "fraction of accesses", "hits": "expert accesses", "accesses": "expert accesses",
    "capacity": "experts resident per layer",
    "set_changed": "pairs", "top1_changed": "pairs", "kept_changed": "pairs", "slots_changed": "slots",
    "max_weight_change": "gate weight", "changed_by_margin": "pairs per margin bin",
    "unchanged_by_margin": "pairs per margin bin", "changed_by_count": "pairs per count of differing experts",
    "margin_edges": "logits (lower bin edges)", "topk_margin": "logits (in mismatch: the unit margin_kind names)",
    "top1_margin": "logits",
    "listed": "pairs", "pairs": "(token, layer) pairs", "tokens_set_changed": "tokens",
    "tokens_top1_changed": "tokens",
    "set_changed_fraction": "fraction of pairs", "top1_changed_fraction": "fraction of pairs",
    "slots_changed_fraction": "fraction of pairs x k", "tokens_set_changed_fraction": "fraction of tokens",
    "tokens_top1_changed_fraction": "fraction of tokens", "decision_share": "fraction of pairs",
    "token_share": "fraction of tokens", "sequences": "sequences", "inputs": "inputs",
    "batch_size": "inputs per batch", "dead_experts": "experts", "ranks": "ranks", "nodes": "nodes",
    "redundant": "slots", "groups": "expert groups", "rebalance_every": "windows", "top_k": "experts per token",
    "chance": "fraction of the top-k (k / E)", "agreement": "fraction of the top-k", "flips": "pairs",
    "large_margin_flips": "pairs", "margin_threshold": "margin_kind's unit (logits or biased scores)",
    "offset": "tokens",
    "removed_share": "fraction of the k3 KL", "k3_mean": "nats per generated token",
    "abs_mean": "nats per generated token", "sq_mean": "nats squared per generated token",
    "extreme_2": "fraction of tokens (|Δ| > ln 2)", "extreme_5": "fraction of tokens (|Δ| > ln 5)",
    "count": "token rows", "checked": "token rows", "expected": "token rows",
    "hours": "hours", "expert_bytes": "bytes", "rearrangements": "refits", "skipped": "refits",
    "rearrangement_steps": "steps", "mean_balancedness": "ratio (mean / max over ranks)",
    "min_balancedness": "ratio (mean / max over ranks)", "mean_overload": "ratio (busiest / mean rank)",
    "mean_node_balancedness": "ratio (mean / max over nodes)",
    "mean_in_node_balancedness": "ratio (mean / max over a node's ranks)", "moved_slots": "slots",
    "sent_slots": "slots", "moved_bytes": "bytes", "sent_bytes": "bytes", "moved_bytes_per_hour": "bytes per hour",
    "staleness": "fraction of MoE time", "current_balancedness": "ratio (mean / max over ranks)",
    "fresh_balancedness": "ratio (mean / max over ranks)", "layer_staleness": "fraction of MoE time",
}


@dataclass(frozen=True)
class Document:
    """One command's document: its keys in order, each a path (`layers[].tokens`: the key `tokens`
    of every row of the list `layers`; `whatif.ranks`: the key `ranks` of the object `whatif`), where
    their meanings are written (`described_by`: the report whose docstring says them), and the keys
    whose name `UNITS` knows that have no unit here (`unitless`: a flag in a token row)."""

    command: str
    keys: tuple[str, ...]
    described_by: str
    unitless: tuple[str, ...] = ()

    def units(self) -> dict[str, str]:
        """The unit of each documented key that holds a value (not an object or a list of rows), by path."""
        parents = {path.rsplit(".", 1)[0].removesuffix("[]") for path in self.keys if "." in path}
        return {path: UNITS[name] for path in self.keys
                if path not in parents and path not in self.unitless
                and (name := path.rsplit(".", 1)[-1]) in UNITS}


def _rows(table: str, columns: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (table, *(f"{table}[].{c}" for c in columns))


_SUMMARY_LAYER = ("layer", "tokens", "max_over_mean", "load_cv", "dead_experts", "entropy", "entropy_norm",
                  "dropped_tokens", "dropped_rate")
_PLACEMENT_LAYER = ("layer", "window_start", "window_end", "steps", "tokens", "slots", "rank_slots", "rank_tokens",
                    "balancedness", "imbalance", "hottest_rank", "hottest_experts", "hottest_expert_slots")
_WIRE_FIGURES = ("remote_ranks_mean", "remote_nodes_mean", "remote_ranks_histogram", "remote_nodes_histogram",
                 "rank_matrix", "node_matrix", "gpu_sends", "rdma_sends", "intra_node_share", "busiest_link",
                 "busiest_link_tokens", "busiest_node_link", "busiest_node_link_tokens",
                 "dispatch_bytes_per_forward", "combine_bytes_per_forward", "rdma_dispatch_bytes_per_forward",
                 "rdma_combine_bytes_per_forward")
_TRAFFIC_LAYER = ("layer", "window_start", "window_end", "tokens", "forwards", "remote_ranks_mean",
                  "floor_remote_ranks", "remote_nodes_mean", "floor_remote_nodes", "remote_ranks_histogram",
                  "remote_nodes_histogram", "rank_matrix", "node_matrix", "gpu_sends", "rdma_sends",
                  "intra_node_share", "busiest_link", "busiest_link_tokens", "busiest_node_link",
                  "busiest_node_link_tokens", "dispatch_bytes_per_forward", "combine_bytes_per_forward",
                  "rdma_dispatch_bytes_per_forward", "rdma_combine_bytes_per_forward", "limited_changed_share",
                  "limited_moved_weight", "limited_moved_weight_changed", "limited_rule",
                  *(f"limited_{name}" for name in _WIRE_FIGURES))
_JITTER_LAYER = ("condition", "condition_order", "baseline", "description", "layer", "tokens", "set_changed",
                 "top1_changed", "kept_changed", "max_weight_change", "changed_by_margin", "unchanged_by_margin",
                 "listed", "batch_size", "padding_side", "dtype", "attn_implementation")
_JITTER_TOKEN = ("condition", "layer", "sequence", "position", "token_id", "set_changed", "top1_changed",
                 "topk_margin", "top1_margin", "baseline_ids", "condition_ids", "baseline_weights",
                 "condition_weights", "context_ids", "context_start")
_MISMATCH_GROUP = ("grouping", "group_name", "group_order", "layer", "pairs", "tokens", "set_changed", "top1_changed",
                   "slots_changed", "tokens_set_changed", "tokens_top1_changed", "changed_by_count",
                   "changed_by_margin", "unchanged_by_margin", "listed", "set_changed_fraction",
                   "top1_changed_fraction", "slots_changed_fraction", "tokens_set_changed_fraction",
                   "tokens_top1_changed_fraction")
_MISMATCH_TOKEN = ("layer", "step", "engine_rank", "sequence", "position", "token_id", "set_changed", "top1_changed",
                   "slots_changed", "topk_margin", "top1_margin", "reference_ids", "engine_ids", "reference_weights",
                   "context_ids", "context_start")

_REBALANCE_POLICY = ("policy", "rearrangements", "skipped", "rearrangement_steps", "mean_balancedness",
                     "min_balancedness", "mean_overload", "mean_node_balancedness", "mean_in_node_balancedness",
                     "moved_slots", "sent_slots", "moved_bytes", "sent_bytes", "moved_bytes_per_hour", "balancedness")

_GAP_ROW = ("routing", "left_out_layer", "grouping", "group_name", "group_order", "tokens", "k3_mean", "abs_mean",
            "sq_mean", "extreme_2", "extreme_5")
_TRACE_FINDING = ("check_name", "count", "checked", "expected", "sequences", "rows", "detail", "origins")

_HEAD = ("schema_version", "command", "units")

DOCUMENTS: dict[str, Document] = {document.command: document for document in (
    Document("summary", (
        *_HEAD, "run_id", "model_class", "source", "total_params", "active_params_per_token", "forwards", "tokens",
        "ranks", *_rows("layers", _SUMMARY_LAYER),
        "all", *(f"all.{key}" for key in ("layer_tokens", "load_cv", "entropy", "entropy_norm", "dropped_tokens",
                                          "dropped_rate")),
        *_rows("hosts", ("host", "ranks", "forwards", "tokens", "load_cv", "max_over_mean", "dropped_rate")),
        *_rows("tags", ("key", "value", "steps", "tokens", "active_fraction")),
        *_rows("trace_findings", _TRACE_FINDING)),
        "moescope.analyses.summary.SummaryReport", ("trace_findings[].sequences",)),
    Document("placement", (
        *_HEAD, "run_id", "ranks", "source", "dispatch", *_rows("layers", _PLACEMENT_LAYER),
        "whatif", *(f"whatif.{key}" for key in ("ranks", "nodes", "groups", "redundant", "fit_window",
                                                "rebalance_every", "window_steps", "dispatch")),
        *_rows("whatif.candidates", ("candidate", "fit", "later", "last", "windows", "decay", "gain")),
        *_rows("whatif.windows", ("candidate", "window_start", "window_end", "balancedness", "imbalance", "fitted")),
        *_rows("whatif.layers", ("candidate", "window_start", "window_end", "layer", "fit_start", "rank_load",
                                 "balancedness", "imbalance"))),
        "moescope.analyses.placement.PlacementReport and moescope.analyses.placement_whatif.WhatIfReport"),
    Document("placement rebalance", (
        *_HEAD, "run_id", "ranks", "nodes", "groups", "redundant", "window_steps", "dispatch", "steps", "hours",
        "expert_bytes", *_rows("policies", _REBALANCE_POLICY),
        "staleness", *(f"staleness.{key}" for key in ("source", "window_start", "window_end", "staleness",
                                                      "current_balancedness", "fresh_balancedness", "layers",
                                                      "layer_staleness")),
        *_rows("alerts", ("alertname", "severity", "layer", "values", "values[].signal", "values[].value"))),
        "moescope.analyses.rebalance.RebalanceReport", ("steps",)),
    Document("traffic", (
        *_HEAD, "run_id", "ranks", "nodes", "source", "home", "replica_rule", "mode",
        *_rows("layers", _TRAFFIC_LAYER), *_rows("comparison", ("placement", *_TRAFFIC_LAYER)),
        *_rows("coselection_by_window", ("placement", "fit_start", *_TRAFFIC_LAYER))),
        "moescope.analyses.traffic.TrafficReport"),
    Document("whatif cache", (
        *_HEAD, "run_id", "layer", *_rows("tags", ("key", "value")),
        *_rows("curves", ("layer", "policy", "capacity", "hit_rate", "hits", "accesses", "tokens", "truncated"))),
        "moescope.analyses.expert_cache.cache_report"),
    Document("jitter", (
        *_HEAD, "run_id", "model_class", "inputs", "margin_edges", *_rows("layers", _JITTER_LAYER),
        *_rows("tokens", _JITTER_TOKEN), *_rows("skipped", ("condition", "reason"))),
        "moescope.analyses.jitter.JitterReport", ("tokens[].set_changed", "tokens[].top1_changed")),
    Document("mismatch", (
        *_HEAD, "run_id", "engine_run", "model_class", "reference_dtype", "top_k", "layers", "decision_share",
        "token_share", "margin_edges", *_rows("groups", _MISMATCH_GROUP), *_rows("tokens", _MISMATCH_TOKEN),
        *_rows("skipped", ("reason", "sequences")),
        *_rows("alerts", ("alertname", "severity", "layer", "values", "values[].signal", "values[].value")),
        "replay", "replay.sequences", "replay.layers", "replay.folder",
        "margin_kind",
        "trace", *(f"trace.{key}" for key in ("verdict", "chance", "flips", "large_margin_flips", "margin_threshold")),
        *_rows("trace.offsets", ("offset", "agreement", "pairs")),
        "gap", "gap.removed_share", "gap.layers", *_rows("gap.rows", _GAP_ROW),
        *_rows("gap.skipped", ("reason", "sequences"))),
        "moescope.analyses.mismatch.MismatchReport", ("tokens[].set_changed", "tokens[].top1_changed")),
)}


def document_keys(value: Any, prefix: str = "") -> list[str]:
    """The key paths of a JSON value as `Document.keys` writes them, in first-seen order (the rows of a
    list together: `layers[].tokens` once). A list of scalars or of lists is a value, not keys, and so
    is a document's `units` block (its keys are paths)."""
    out: dict[str, None] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out[path] = None
            if path != "units":
                out.update(dict.fromkeys(document_keys(item, path)))
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping):
                out.update(dict.fromkeys(document_keys(item, f"{prefix}[]")))
    return list(out)


# -- the serialiser -----------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """`value` as plain JSON values: a dataclass or mapping an object, a DataFrame a list of rows, a
    Series or array (numpy, any depth) a list, numpy scalars Python numbers, a timestamp ISO 8601
    text; NaN, infinity, None, pandas' NA and NaT null. Raises TypeError for anything else (a new
    report field gets a rule here, not a `str()`)."""
    import numpy as np
    import pandas as pd

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, pd.DataFrame):
        return [{str(k): jsonable(v) for k, v in row.items()} for row in value.to_dict("records")]
    if isinstance(value, (np.ndarray, pd.Series, list, tuple)):
        return [jsonable(v) for v in (value.tolist() if isinstance(value, np.ndarray) else list(value))]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (dt.datetime, dt.date, pd.Timestamp)):
        return None if pd.isna(value) else value.isoformat()
    if value is pd.NA or value is pd.NaT:
        return None
    raise TypeError(f"no JSON form for {type(value).__name__}: give it a rule in moescope.cli.output.jsonable")


def document(command: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document of `command` (a key of `DOCUMENTS`) around `body`, its keys: schema_version,
    command, the units of its documented keys, then `body` as `jsonable` writes it."""
    return {"schema_version": SCHEMA_VERSION, "command": command, "units": DOCUMENTS[command].units(),
            **jsonable(dict(body))}


def write_document(command: str, body: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """Print `document(command, body)` as one line of JSON on `stream` (stdout)."""
    text = json.dumps(document(command, body), allow_nan=False, ensure_ascii=False)
    print(text, file=stream or sys.stdout)


def wants_json(args: argparse.Namespace) -> bool:
    """Whether the command was asked for `--format json`."""
    return getattr(args, "format", None) == "json"


def notes(args: argparse.Namespace) -> TextIO:
    """Where a command's notes ("wrote ...", "plot written to ...") go: stdout under its table, stderr
    beside a JSON document (stdout holds the document and nothing else)."""
    return sys.stderr if wants_json(args) else sys.stdout


# -- the documents, from the report objects the tables print ------------------------------------------


def summary_document(report: Any) -> dict[str, Any]:
    """`moescope summary`'s keys from a `moescope.analyses.summary.SummaryReport`."""
    run = report.run
    whole = None if not report.layers else dict(
        layer_tokens=run.layer_tokens, load_cv=run.load_cv, entropy=run.entropy.nats,
        entropy_norm=run.entropy.normalized, dropped_tokens=run.dropped_tokens, dropped_rate=run.dropped_token_rate)
    return dict(run_id=report.run_id, model_class=report.model_class, source=report.source,
                total_params=report.total_params or None, active_params_per_token=report.active_params,
                forwards=report.counts.forwards, tokens=report.counts.tokens, ranks=report.counts.ranks,
                layers=report.layers, all=whole, hosts=report.hosts,
                tags=report.tags[["key", "value", "steps", "tokens", "active_fraction"]],
                trace_findings=report.trace_findings[list(_TRACE_FINDING)] if len(report.trace_findings) else [])


def placement_document(report: Any, run_id: str, whatif: Any = None) -> dict[str, Any]:
    """`moescope placement`'s keys from a `PlacementReport` and, with `--whatif`, a `WhatIfReport`."""
    body: dict[str, Any] = dict(run_id=run_id, ranks=report.ranks, source=report.source, dispatch=report.dispatch,
                                layers=report.layers, whatif=None)
    if whatif is not None:
        setup = whatif.setup
        figures = whatif.figures()
        body["whatif"] = dict(
            ranks=setup.ranks, nodes=setup.nodes, groups=setup.groups, redundant=setup.redundant,
            fit_window=setup.fit_window, rebalance_every=setup.rebalance_every, window_steps=whatif.window_steps,
            dispatch=whatif.dispatch,
            candidates=figures[["candidate", "fit", "later", "last", "windows", "decay", "gain"]],
            windows=whatif.summary[["candidate", "window_start", "window_end", "balancedness", "imbalance", "fitted"]],
            layers=whatif.rows)
    return body


def traffic_document(report: Any, run_id: str, comparison: Any = None, windowed: Any = None) -> dict[str, Any]:
    """`moescope traffic`'s keys from a `TrafficReport`, and the `--compare` frames the table prints."""
    return dict(run_id=run_id, ranks=report.ranks, nodes=report.nodes, source=report.source, home=report.home,
                replica_rule=report.replica_rule, mode=report.mode, layers=report.layers, comparison=comparison,
                coselection_by_window=windowed)


def whatif_cache_document(report: Any, run_id: str, layer: int | None, tags: Mapping[str, str] | None) -> dict:
    """`moescope whatif cache`'s keys from `cache_report`'s frame."""
    columns = ["layer", "policy", "capacity", "hit_rate", "hits", "accesses", "tokens", "truncated"]
    return dict(run_id=run_id, layer=layer, tags=[dict(key=k, value=v) for k, v in (tags or {}).items()],
                curves=[] if report.empty else report[columns])


def jitter_document(report: Any, inputs: int) -> dict[str, Any]:
    """`moescope jitter`'s keys from a `JitterReport`."""
    from moescope.analyses.jitter import LAYER_COLUMNS, MARGIN_EDGES, TOKEN_COLUMNS

    return dict(run_id=report.run_id, model_class=report.model_class, inputs=inputs, margin_edges=MARGIN_EDGES,
                layers=report.layers[list(LAYER_COLUMNS)] if len(report.layers) else [],
                tokens=report.tokens[list(TOKEN_COLUMNS)] if len(report.tokens) else [],
                skipped=[dict(condition=c, reason=r) for c, r in report.skipped.items()])


def _alerts(fired: Any) -> list[dict[str, Any]]:
    """Alert transitions a command's rules fired, as rows (their values a list of (signal, value) rows)."""
    return [dict(alertname=t.alertname, severity=t.severity, layer=t.layer,
                 values=[dict(signal=s, value=v) for s, v in t.values.items()]) for t in fired]


def rebalance_document(report: Any, fired: Any = ()) -> dict[str, Any]:
    """`moescope placement --rebalance`'s keys from a `moescope.analyses.rebalance.RebalanceReport` and
    the alerts its staleness rules fired."""
    setup = report.setup
    return dict(run_id=report.run_id, ranks=setup.ranks, nodes=setup.nodes, groups=setup.groups,
                redundant=setup.redundant, window_steps=setup.window_steps, dispatch=report.dispatch,
                steps=report.steps, hours=report.hours, expert_bytes=report.expert_bytes,
                policies=report.policies, staleness=report.staleness, alerts=_alerts(fired))


def mismatch_document(report: Any, fired: Any = (), replay: Mapping[str, Any] | None = None,
                      engine_run: str | None = None) -> dict[str, Any]:
    """`moescope mismatch`'s keys from a `MismatchReport` (None: `--export` without a model, the
    replay alone), the alerts its rules fired and the replay it exported (None: no `--export`)."""
    from moescope.analyses.mismatch import GROUP_COLUMNS, TOKEN_COLUMNS
    from moescope.analyses.routing_compare import MARGIN_EDGES

    fractions = ["set_changed_fraction", "top1_changed_fraction", "slots_changed_fraction",
                 "tokens_set_changed_fraction", "tokens_top1_changed_fraction"]
    alerts = _alerts(fired)
    if report is None:
        return dict(run_id=None, engine_run=engine_run, model_class=None, reference_dtype=None, top_k=None,
                    layers=None, decision_share=None, token_share=None, margin_edges=MARGIN_EDGES, groups=[],
                    tokens=[], skipped=[], alerts=alerts, replay=replay, margin_kind=None, trace=None, gap=None)
    trace = report.trace
    gap = report.gap
    return dict(run_id=report.run_id, engine_run=report.engine_run, model_class=report.model_class,
                reference_dtype=report.reference_dtype, top_k=report.top_k, layers=report.layers,
                decision_share=report.decision_share, token_share=report.token_share, margin_edges=MARGIN_EDGES,
                groups=report.groups[[*GROUP_COLUMNS, *fractions]],
                tokens=report.tokens[list(TOKEN_COLUMNS)] if len(report.tokens) else [],
                skipped=[dict(reason=r, sequences=n) for r, n in report.skipped.items()], alerts=alerts, replay=replay,
                margin_kind=report.margin_kind, trace=None if trace is None else dict(
                    verdict=trace.verdict(), chance=trace.chance, flips=trace.flips,
                    large_margin_flips=trace.large_margin_flips, margin_threshold=trace.threshold,
                    offsets=[dict(offset=d, agreement=trace.agreement[d], pairs=trace.pairs.get(d, 0))
                             for d in sorted(trace.agreement)]),
                gap=None if gap is None else dict(
                    removed_share=gap.removed_share, layers=gap.layers,
                    rows=gap.rows[list(_GAP_ROW)],
                    skipped=[dict(reason=r, sequences=n) for r, n in gap.skipped.items()]))

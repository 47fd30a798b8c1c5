"""The per-layer summary of one run: the report `moescope summary STORE` prints and the demo ends with.

Every figure comes from a `store.Store` query and a `moescope.metrics` definition
(`moescope.metrics.figures.layer_figures`, `run_figures`, `run_counts`), the same the dashboard shows
under the same label. The command that prints it is `moescope.cli.summary`; the report names the
program to run its example query with (`program`), so nothing here reads the command line.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pandas as pd

from moescope.metrics.figures import LayerFigures, RunCounts, RunFigures, layer_figures_of, run_counts, run_figures
from moescope.store import Store
from moescope.store.location import StoreLocation, open_location
from moescope.store.schema import NOT_RECORDED

__all__ = ["SummaryReport", "format_report", "format_summary", "host_rows", "layer_rows", "store_arguments",
           "summary_report"]


def layer_rows(store: Store, run_id: str) -> list[dict]:
    """Per MoE layer of a run: tokens, load spread (routed experts), router entropy (token-weighted,
    nats and H / ln E), dropped tokens and their rate. See `moescope.metrics.figures.layer_figures`."""
    return [_layer_row(f) for f in layer_figures_of(store.layer_totals(run_id).itertuples())]


def _layer_row(f: LayerFigures) -> dict:
    return dict(layer=f.layer, tokens=f.tokens, max_over_mean=f.spread.max_mean, load_cv=f.spread.cv,
                dead_experts=f.spread.dead_experts, entropy=f.entropy.nats, entropy_norm=f.entropy.normalized,
                dropped_tokens=f.dropped_tokens, dropped_rate=f.dropped_token_rate)


def host_rows(store: Store, run_id: str) -> list[dict]:
    """Per host that recorded the run (`Store.host_totals`, `Store.host_layer_totals`): ranks,
    forwards (per rank), tokens, load_cv (token-weighted over layers), max_over_mean (of the layer
    whose busiest expert is furthest above the mean), dropped_rate (over layer-tokens)."""
    totals = store.host_totals(run_id)
    per_layer = store.host_layer_totals(run_id)
    rows = []
    for t in totals.itertuples():
        layers = layer_figures_of(per_layer[per_layer.host == t.host].itertuples())
        run = run_figures(layers)
        spreads = [f.spread.max_mean for f in layers if not math.isnan(f.spread.max_mean)]
        rows.append(dict(host=str(t.host), ranks=int(t.ranks), forwards=int(t.forwards), tokens=int(t.tokens or 0),
                         load_cv=run.load_cv, max_over_mean=max(spreads) if spreads else math.nan,
                         dropped_rate=run.dropped_token_rate))
    return rows


def _count(value: Any) -> int:
    """A parameter count from a row: 0 where it is null (not recorded)."""
    return 0 if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)


def _dropped(dropped: int, rate: float) -> str:
    """The dropped-token cell: '—' where the source records no drops (its rate is NaN), never 0."""
    return f"{'—':>8}" if math.isnan(rate) else f"{dropped:>8,}"


def _cell(value: float, spec: str, width: int) -> str:
    return f"{'—':>{width}}" if isinstance(value, float) and math.isnan(value) else f"{value:>{width}{spec}}"


def _shown(value: str) -> str:
    """An option's value as a message shows it: a URL without its user information or query."""
    if "://" not in value:
        return value
    parts = urlsplit(value)
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return f"{parts.scheme}://{host}{parts.path}"


def store_arguments(location: StoreLocation) -> str:
    """The store as a command line names it: the (redacted) location and its --storage-option pairs."""
    words = [location.redacted if not location.is_local else location.url]
    for key, value in location.storage_options.items():
        words += ["--storage-option", f"{key}={_shown(str(value))}"]
    return " ".join(shlex.quote(w) for w in words)


def format_summary(root: str | os.PathLike | StoreLocation, run_id: str | None = None,
                   storage_options: Mapping[str, Any] | None = None, program: str = "moescope") -> str:
    """A plain-text report of one run (the latest by default).

    Args:
        root: the store, a folder or a URL.
        run_id: the run; None: the most recently started one.
        storage_options: for a URL, as `moescope.attach` takes them.
        program: how the report's example query calls moescope (the command line passes
            `moescope.cli.program_name()`, which finds this installation's script).

    Returns:
        The report: the run's headline, a row per MoE layer and one for all, a per-host table for a run
        recorded by more than one host (`host_rows`), the tags, and where the tables are.

    Raises:
        EmptyStoreError: the store holds no run.
        UnknownRunError: the store does not hold `run_id`.
    """
    location = open_location(root, storage_options)
    with Store(location) as store:
        return format_report(summary_report(store, store.check_run(run_id)), location, program)


@dataclass(frozen=True)
class SummaryReport:
    """What `summary_report` found for one run: what `moescope summary` prints, as a table or as JSON.

    Attributes:
        run_id: the run.
        model_class: the model's class (`?` where the runs row is missing).
        source: `probe`, or the engine the run was imported from.
        total_params: the model's parameters; 0 where the source does not record them.
        active_params: active parameters per token (token-weighted over steps); NaN where not recorded.
        counts: forwards and tokens summed over ranks, and the ranks (`moescope.metrics.figures.RunCounts`).
        layers: `layer_rows`: per MoE layer, tokens, max_over_mean, load_cv, dead_experts, entropy
            (nats), entropy_norm (H / ln E), dropped_tokens, dropped_rate (NaN: not recorded).
        run: the figures over every layer (`moescope.metrics.figures.RunFigures`).
        hosts: `host_rows`, per host that recorded the run.
        tags: per step tag (`Store.tag_totals`): key, value, steps (forwards), tokens, active_fraction.
        trace_findings: what the trace checks found in an engine run's trace (`Store.trace_findings`): per
            check, check_name, count, checked, expected, sequences, rows, detail, origins; empty for none.
    """

    run_id: str
    model_class: str
    source: str
    total_params: int
    active_params: float
    counts: RunCounts
    layers: list[dict]
    run: RunFigures
    hosts: list[dict]
    tags: pd.DataFrame
    trace_findings: pd.DataFrame


def summary_report(store: Store, run_id: str) -> SummaryReport:
    """The summary of run `run_id` of an open store (`Store.check_run` names it): every figure
    `format_summary` prints."""
    info = store.run_info(run_id) or {"model_class": "?", "total_params": 0, "source": "probe"}
    steps = store.step_totals(run_id)
    active = float(steps["active_params"]) if steps["steps"] and steps["active_params"] is not None else math.nan
    figures = layer_figures_of(store.layer_totals(run_id).itertuples())
    return SummaryReport(
        run_id=run_id, model_class=str(info["model_class"]), source=str(info.get("source") or "probe"),
        total_params=_count(info["total_params"]), active_params=active, counts=run_counts(steps),
        layers=[_layer_row(f) for f in figures], run=run_figures(figures), hosts=host_rows(store, run_id),
        tags=store.tag_totals(run_id), trace_findings=store.trace_findings(run_id))


def format_report(report: SummaryReport, location: StoreLocation, program: str = "moescope") -> str:
    """`report` as the text `format_summary` returns; `location` and `program` make its example query."""
    run_id, run, source, total, active = (report.run_id, report.run, report.source, report.total_params,
                                          report.active_params)
    not_recorded = f"{NOT_RECORDED} ({source})"
    counts = report.counts.headline()
    layers = report.layers
    lines = [
        f"run {run_id}: {report.model_class}, " + (f"{total:,} parameters" if total else
                                                   f"parameter counts {not_recorded}"),
        f"{counts}; active parameters per token {active:,.0f} = {100 * active / total:.1f}% of the model"
        if total and not math.isnan(active) else f"{counts}; active parameters per token {not_recorded}",
        "",
        f"{'layer':>5} {'tokens':>10} {'max/mean':>9} {'load CV':>8} {'dead':>5} {'entropy':>8} "
        f"{'H/ln E':>8} {'dropped':>8} {'drop %':>7}",
    ]
    for r in layers:
        lines.append(f"{r['layer']:>5} {r['tokens']:>10,} {_cell(r['max_over_mean'], '.2f', 9)} "
                     f"{_cell(r['load_cv'], '.2f', 8)} {r['dead_experts']:>5} {_cell(r['entropy'], '.3f', 8)} "
                     f"{_cell(r['entropy_norm'], '.3f', 8)} {_dropped(r['dropped_tokens'], r['dropped_rate'])} "
                     f"{_cell(100 * r['dropped_rate'], '.2f', 7)}")
    if layers:
        lines.append(f"{'all':>5} {run.layer_tokens:>10,} {'':>9} {_cell(run.load_cv, '.2f', 8)} {'':>5} "
                     f"{_cell(run.entropy.nats, '.3f', 8)} {_cell(run.entropy.normalized, '.3f', 8)} "
                     f"{_dropped(run.dropped_tokens, run.dropped_token_rate)} "
                     f"{_cell(100 * run.dropped_token_rate, '.2f', 7)}")
        lines.append("(load figures over routed experts; entropy and rates token-weighted; 'all' sums the "
                     "layers' tokens)")
        missing = [name for name, value in (("router entropy", run.entropy.nats),
                                            ("dropped tokens", run.dropped_token_rate)) if math.isnan(value)]
        if missing:
            lines.append(f"(—: {' and '.join(missing)} {not_recorded})")
    hosts = report.hosts
    if len(hosts) > 1:
        lines += ["", f"by host ({len(hosts)} hosts; a rank's rows belong to the host its runs row names):",
                  f"  {'host':<24} {'ranks':>5} {'forwards':>9} {'tokens':>12} {'load CV':>8} {'max/mean':>9} "
                  f"{'drop %':>7}"]
        lines += [f"  {h['host'][:24]:<24} {h['ranks']:>5} {h['forwards']:>9,} {h['tokens']:>12,} "
                  f"{_cell(h['load_cv'], '.2f', 8)} {_cell(h['max_over_mean'], '.2f', 9)} "
                  f"{_cell(100 * h['dropped_rate'], '.2f', 7)}" for h in hosts]
        lines.append("  (load CV token-weighted over layers; max/mean of the host's most uneven layer)")
    lines += trace_finding_lines(report.trace_findings, run_id, program, location)
    tags = report.tags
    if not tags.empty:
        lines += ["", "by tag:"]
        lines += [f"  {r.key}={r.value}: {r.steps:,} forwards, active fraction {100 * r.active_fraction:.2f}%"
                  for r in tags.itertuples()]
    where = location.url if location.is_local else location.redacted
    lines += [
        "",
        f"tables: {where}/<table> (Delta Lake, partitioned by run_id: read them as Delta tables, not by globbing "
        "their Parquet files)",
        f"try:  {program} query {store_arguments(location)} \"SELECT layer, expert_ids, count(*) FROM routes "
        "GROUP BY ALL ORDER BY 3 DESC LIMIT 10\"",
    ]
    return "\n".join(lines)


def trace_finding_lines(findings: pd.DataFrame, run_id: str, program: str, location: StoreLocation) -> list[str]:
    """What the trace checks found in an engine's trace (`moescope.ingest.trace_checks`, the run's
    `trace_findings` rows, `Store.trace_findings`): a line per check, or nothing for a run without findings."""
    if findings.empty:
        return []
    lines = ["", f"trace checks: {len(findings)} finding{'s' if len(findings) != 1 else ''} (do not replay or train "
                 "on this trace before reading them):"]
    lines += [f"  {r.check_name}: {int(r['count']):,} of {int(r.checked):,} ({r.origins}): {r.detail}"
              for _, r in findings.iterrows()]
    lines.append(f"  more: {program} check {store_arguments(location)} --run {run_id}")
    return lines


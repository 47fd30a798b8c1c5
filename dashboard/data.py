"""Cached access to the store for the pages: one connection per store, cached query results, and
the few frames the pages shape from them (each alert's latest state).

The pages only cache and draw: every number comes from a `store.Store` query (`store/queries.py`,
`store/reports.py`) or a `moescope.metrics.signals` function; nothing here writes SQL, and the frames
shaped here pick rows, never compute a number.

A page names its store by `ctx.root`, the location's url (a folder or `s3://...`): a plain string,
so it keys the caches; `settings.location_of` gives it back with the storage options the dashboard
was started with. `st.cache_resource` holds the `Store` (one DuckDB connection per store, shared by every
browser session; a lock serialises its use because a DuckDB connection is not meant to be used
by two threads at once). Query results go through `st.cache_data` keyed by the widget values and
by the store's *version* (`store.store.data_version`, a fingerprint of its committed files): when
the probe writes a new file the version changes, the views are re-made and every query reads
fresh data, while a finished store is queried once per distinct question. A question too slow for
a page's first render (Placement's traffic) is asked of the same cached function on the server's
worker thread (`off_the_run`), and the page reads the answer from the cache on its run after.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import streamlit as st

from moescope.alerts.outbox import outbox_path, read_deliveries
from moescope.analyses.tokens import context_parts, token_text
from moescope.analyses.training_report import training_report as _training_report
from moescope.dashboard import settings
from moescope.store.store import EmptyStoreError, Store, data_version

T = TypeVar("T")
TTL_S = 600
_lock = threading.RLock()

TagFilter = tuple[str, str] | None  # (tag key, value) from the sidebar, or no filter


class NoStore(Exception):
    """The dashboard's store does not exist (yet). Its argument is the store's `ctx.root`."""


def store_exists(root: str) -> bool:
    """Whether there may be a store at `root`: a local folder must exist; a store on object storage
    is asked for (a missing one raises NoStore from the first query: "no store yet")."""
    location = settings.location_of(root)
    return os.path.isdir(location.url) if location.is_local else True


def store_version(root: str) -> str:
    """The store's `data_version` (changes with every commit; '' where there is no store yet)."""
    return data_version(settings.location_of(root))


def tags(tag: TagFilter) -> dict[str, str] | None:
    """The sidebar's tag filter as the store's `tags=` argument."""
    return {str(tag[0]): str(tag[1])} if tag else None


@st.cache_resource(show_spinner=False)
def _open(root: str) -> dict[str, Any]:
    return {"store": Store(settings.location_of(root)), "version": None}


def with_store(root: str, version: str, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(store, *args)` on the cached store of `root`, first re-making its views if the
    store's files changed since they were made. Raises NoStore when there is no store there."""
    if not store_exists(root):
        raise NoStore(root)
    try:
        entry = _open(root)
    except EmptyStoreError as e:
        raise NoStore(root) from e
    with _lock:
        if entry["version"] != version:
            entry["store"].refresh()
            entry["version"] = version
        return fn(entry["store"], *args)


def _cached(fn: Callable[..., T], tagged: bool = False) -> Callable[..., T]:
    """`fn(store, *args)` cached by (root, store version, args). With `tagged`, the last argument
    is the sidebar's TagFilter, handed to `fn` as its `tags=` keyword."""
    # The store version is an argument so new files make new cache entries; the widget values
    # (run, layer, tag filter, ...) are the rest of the key.
    def call(root: str, version: str, *args: Any) -> T:
        if tagged:
            *rest, tag = args if args else (None,)
            return with_store(root, version, lambda store, *a: fn(store, *a, tags=tags(tag)), *rest)
        return with_store(root, version, fn, *args)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    call.__module__ = __name__
    return st.cache_data(ttl=TTL_S, max_entries=256, show_spinner=False)(call)


_worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moescope-off-the-run")
_off_the_run: dict[tuple, concurrent.futures.Future] = {}
_off_the_run_lock = threading.Lock()
OFF_THE_RUN_KEPT = 64  # finished computations remembered (their results are in their functions' caches)


def off_the_run(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """The future of `fn(*args)`, a cached function of this module, computed on the server's worker
    thread (one at a time, each asked once however many sessions ask): its result lands in `fn`'s
    cache, where the page's next run reads it at once (`common.after_first_render`). A computation
    that failed, or was cancelled, is asked again. A new question of `fn` cancels its questions that
    wait in the queue (a live page asks again at every new version of the store, a user at every click:
    the queue never holds more than one question a function), never one under way."""
    key = (fn.__qualname__, args)
    with _off_the_run_lock:
        future = _off_the_run.get(key)
        if future is None or future.cancelled() or (future.done() and future.exception() is not None):
            for (name, _), queued in _off_the_run.items():
                if name == key[0]:
                    queued.cancel()  # only a future that has not started can be cancelled
            future = _off_the_run[key] = _worker.submit(fn, *args)
        for old in [k for k, f in _off_the_run.items() if f.done()][:-OFF_THE_RUN_KEPT]:
            del _off_the_run[old]
        return future


def off_the_run_pending() -> int:
    """How many computations `off_the_run` has under way."""
    with _off_the_run_lock:
        return sum(not future.done() for future in _off_the_run.values())


def off_the_run_wait(timeout: float | None = None) -> bool:
    """Wait until no computation `off_the_run` asked for is under way; False if `timeout` (seconds) passed first."""
    with _off_the_run_lock:
        futures = list(_off_the_run.values())
    _, waiting = concurrent.futures.wait(futures, timeout=timeout)
    return not waiting


def _runs_newest_first(store: Store) -> pd.DataFrame:
    return store.runs().sort_values("started_at", ascending=False, ignore_index=True)


runs = _cached(_runs_newest_first)
tag_values = _cached(Store.tag_values)
layers = _cached(Store.layers)
run_info = _cached(Store.run_info)
step_totals = _cached(Store.step_totals, tagged=True)
active_fraction_buckets = _cached(Store.active_fraction_buckets, tagged=True)
active_fraction_by_tag = _cached(Store.active_fraction_by_tag, tagged=True)
active_fraction_by_position = _cached(Store.active_fraction_by_position, tagged=True)
layer_totals = _cached(Store.layer_totals, tagged=True)
layer_buckets = _cached(Store.layer_buckets, tagged=True)
load_heatmap = _cached(Store.load_heatmap, tagged=True)
expert_share = _cached(Store.expert_share)
expert_tag_load = _cached(Store.expert_tag_load, tagged=True)
drift_from_first_steps = _cached(Store.drift_from_first_steps)
table_rows = _cached(Store.table_rows)
probe_stats = _cached(Store.probe_stats)
# (root, version, run_id, tag): per host that recorded the run (`Store.host_totals`, `Store.host_layer_totals`)
host_totals = _cached(Store.host_totals, tagged=True)
host_layer_totals = _cached(Store.host_layer_totals, tagged=True)


def _cache_report(store: Store, run_id: str, layer: int, max_tokens: int,
                  tag: tuple[str, str] | None = None) -> pd.DataFrame:
    from moescope.analyses.expert_cache import cache_report

    return cache_report(store, run_id, layer, tags={str(tag[0]): str(tag[1])} if tag else None,
                        max_tokens=max_tokens)


# (root, version, run_id, layer, max_tokens, tag): `moescope.analyses.expert_cache.cache_report` of one layer
cache_report = _cached(_cache_report)


def _coselection(store: Store, run_id: str, layer: int, tags: dict[str, str] | None = None):
    matrix = store.coselection(run_id, layer, tags=tags)
    return matrix if matrix.size else None


def _expert_tokens(store: Store, run_id: str, layer: int, expert: int, step_range: tuple[int, int] | None,
                   limit: int, tags: dict[str, str] | None = None) -> pd.DataFrame:
    return store.expert_tokens(run_id, layer, expert, step_range, tags=tags, limit=limit)


# (root, version, run_id, layer, tag): the (E, E) co-selection counts, None where none were recorded
coselection = _cached(_coselection, tagged=True)
# (root, version, run_id, layer, expert, step_range, limit, tag): `Store.expert_tokens`
expert_tokens = _cached(_expert_tokens, tagged=True)


def _router_input_points(store: Store, run_id: str, layer: int, size: int) -> tuple[pd.DataFrame, np.ndarray]:
    sample = store.router_input_sample(run_id, layer, size)
    hidden = (np.stack([np.asarray(h, dtype=np.float32) for h in sample.hidden]) if len(sample)
              else np.zeros((0, 0), dtype=np.float32))
    return sample.drop(columns=["hidden"]), hidden


@st.cache_data(max_entries=16, show_spinner=False)
def router_input_points(root: str, version: str, run_id: str, layer: int, size: int) -> tuple[pd.DataFrame, np.ndarray]:
    """The Semantic clusters page's sample of router inputs (`Store.router_input_sample`): its columns
    but `hidden`, and its `hidden` vectors as one (n, width) float32 array. No time limit: a sample of
    a store version is fixed."""
    return with_store(root, version, _router_input_points, run_id, layer, size)


@st.cache_resource(show_spinner=False)
def tokenizer(path: str | None):
    """The tokenizer at a local folder (never downloaded), or None without a path."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def token_texts(token_ids: pd.Series, tokenizer_path: str | None) -> list[str]:
    """Each id as its token's text where a tokenizer is known (a token that is part of a character
    as its bytes, `\\xe2\\x80`: `analyses.tokens.token_text`), as '#id' otherwise."""
    tok = tokenizer(tokenizer_path)
    out = []
    for value in token_ids:
        if value is None or pd.isna(value):
            out.append("?")
        elif tok is None:
            out.append(f"#{int(value)}")
        else:
            out.append(token_text(tok, int(value)))
    return out


# Whitespace drawn as signs: a token that is a space or a newline would show as a blank cell.
_WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"})
_LINE_BREAKS = str.maketrans({"\n": "↵", "\t": "⇥", "\r": "␍"})
# Around the centre token of a context: marks no source code or prose uses (brackets are code's).
CENTRE_MARKS = ("«", "»")


def visible_token(text: str) -> str:
    """A token's text with its spaces, newlines and tabs as visible signs (␣ ↵ ⇥)."""
    return text.translate(_WHITESPACE)


def context_text(ids: Any, positions: Any, centre: int, tokenizer_path: str | None) -> str:
    """The neighbouring tokens of a sequence as one line, the centre token between « » with its
    whitespace visible (`visible_token`); line breaks and tabs elsewhere as ↵ and ⇥. A character
    cut across tokens is shown whole, inside the marks where the centre token is part of it
    (`analyses.tokens.context_parts`)."""
    if ids is None or isinstance(ids, float) or len(ids) == 0:  # NaN/None: no routes recorded
        return ""
    left, right = CENTRE_MARKS
    tok = tokenizer(tokenizer_path)
    positions = [int(p) for p in positions]
    if tok is not None and int(centre) in positions:
        before, token, after = context_parts(tok, [int(i) for i in ids], positions.index(int(centre)))
        return f"{before.translate(_LINE_BREAKS)}{left}{visible_token(token)}{right}{after.translate(_LINE_BREAKS)}"
    texts = token_texts(pd.Series(list(ids)), tokenizer_path)
    parts = [f"{left}{visible_token(t)}{right}" if p == int(centre) else t.translate(_LINE_BREAKS)
             for t, p in zip(texts, positions)]
    # Decoded tokens carry their own spaces; ids need one between them.
    return ("" if tok is not None else " ").join(parts)


@st.cache_data(ttl=10, max_entries=32, show_spinner=False)
def outbox_deliveries(root: str, fingerprints: tuple[str, ...]) -> pd.DataFrame | None:
    """The alerts outbox's deliveries of these alerts (`alerts.outbox.read_deliveries`; re-read every
    10 s: it is not Parquet); None when the store has no outbox. The outbox is in the store's local
    state folder (`alerts.outbox.outbox_path`: `--state-dir`, else where `alerts run` keeps it)."""
    conf = settings.current()
    rows = read_deliveries(outbox_path(settings.location_of(root), conf.state_dir if conf else None), fingerprints)
    if rows is None:
        return None
    frame = pd.DataFrame(rows, columns=["fingerprint", "receiver", "state", "attempts", "created_at",
                                        "delivered_at", "last_error"])
    for column in ("created_at", "delivered_at"):
        frame[column] = pd.to_datetime(frame[column], unit="s", utc=True)
    return frame


# (root, version, run_id): `Store.training_span`, what moescope.training recorded of a run
training_span = _cached(Store.training_span)
# (root, version, run_id, dead_window, last_steps): `moescope.analyses.training_report.training_report`
training_report = _cached(_training_report)


# -- routing checks: the jitter and mismatch runs (moescope.analyses.jitter, moescope.analyses.mismatch) ---

# (root, version, run_id): a jitter run's rows per (condition, layer), `Store.jitter_layers`
jitter_layers = _cached(Store.jitter_layers)
# (root, version, run_id, condition, layer, limit): its listed tokens, narrowest margin first
jitter_tokens = _cached(Store.jitter_tokens)
# (root, version, run_id): a mismatch run's rows per (group, layer), `Store.mismatch_layers`
mismatch_layers = _cached(Store.mismatch_layers)
# (root, version, run_id, layer, limit, set_changed): its listed (token, layer) pairs, narrowest margin first
mismatch_tokens = _cached(Store.mismatch_tokens)
# (root, version, run_id): an engine run's trace findings, `Store.trace_findings`
trace_findings = _cached(Store.trace_findings)
# (root, version, run_id): a mismatch run's log-prob gap rows, `Store.mismatch_logprob_gap`
mismatch_logprob_gap = _cached(Store.mismatch_logprob_gap)


# -- placement (moescope.analyses.placement, moescope.analyses.traffic) ------------------------------

def _placement_report(store: Store, run_id: str, ranks: int, window: int | None, dispatch: str,
                      tags: dict[str, str] | None = None) -> pd.DataFrame:
    from moescope.analyses.placement import Placement, placement_report

    return placement_report(store, run_id, Placement.contiguous(ranks), window, tags, dispatch=dispatch,
                            tokens=False).layers


def _placement_whatif(store: Store, run_id: str, ranks: int, window: int, dispatch: str,
                      tags: dict[str, str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame, str, str | None]:
    from moescope.analyses.placement import WhatIfSetup, placement_whatif, why_placements_coincide
    from moescope.metrics import signals

    stored = store.placement_whatif(run_id)
    if not stored.empty and not tags:
        rows = stored.copy()
        rows["rank_load"] = [np.asarray(v, dtype=np.float64) for v in rows.rank_load]
        summary = pd.DataFrame([dict(candidate=candidate, window_start=start, window_end=group.window_end.iloc[0],
                                     balancedness=signals.balancedness_over_layers(np.stack(list(group.rank_load))))
                                for (candidate, start), group in rows.groupby(["candidate", "window_start"],
                                                                               sort=False)])
        first = stored.iloc[0]
        experts = int(store.layer_totals(run_id).num_experts.max())
        return rows, summary, (f"stored by `moescope placement --whatif --save` ({int(first.ranks)} ranks, "
                               f"{int(first.redundant)} redundant, dispatch {first.dispatch})"), \
            why_placements_coincide(experts, int(first.ranks), int(first.redundant))
    totals = store.layer_totals(run_id, tags=tags)
    experts = max((int(r.num_experts) if pd.notna(r.num_experts) else len(r.expert_load)
                   for r in totals.itertuples()), default=ranks)
    redundant = -experts % ranks  # the fewest extra slots that split evenly over the ranks, as EPLB needs
    report = placement_whatif(store, run_id, window, WhatIfSetup(ranks=ranks, redundant=redundant, rebalance_every=1),
                              tags=tags, dispatch=dispatch)
    return report.rows, report.summary, (f"computed here: {ranks} ranks, {redundant} redundant slot(s), fitted on "
                                         f"the first window of {window} steps"), \
        why_placements_coincide(experts, ranks, redundant)


def _traffic(store: Store, run_id: str, ranks: int, per_node: int, layer: int | None = None,
             tags: dict[str, str] | None = None) -> pd.DataFrame:
    from moescope.analyses.placement import Placement
    from moescope.analyses.traffic import Wire, default_home, node_layout, traffic_report

    nodes = node_layout(ranks, per_node)
    frame = traffic_report(store, run_id, Placement.contiguous(ranks), Wire(nodes, default_home(store, run_id)),
                           None, tags, layers=None if layer is None else [int(layer)]).layers
    return frame.assign(node_of_rank=[nodes] * len(frame))


def _rebalance_curve(store: Store, run_id: str, ranks: int, window: int, dispatch: str,
                     tags: dict[str, str] | None = None) -> tuple[pd.DataFrame, float]:
    from moescope.analyses.rebalance import RebalanceSetup, rebalance_report
    from moescope.metrics.rebalance import NEVER, EveryN, Policy, SglangPolicy, VllmPolicy

    totals = store.layer_totals(run_id, tags=tags)
    experts = max((int(r.num_experts) if pd.notna(r.num_experts) else len(r.expert_load)
                   for r in totals.itertuples()), default=ranks)
    redundant = -experts % ranks  # the fewest extra slots that split evenly over the ranks, as EPLB needs
    w = int(window)  # the page's window is the replay's step: every knob a multiple of it
    policies: list[Policy] = [EveryN(w), EveryN(4 * w), EveryN(16 * w), VllmPolicy(8 * w, 32 * w),
                              SglangPolicy(32 * w), NEVER]
    report = rebalance_report(store, run_id, RebalanceSetup(ranks=ranks, redundant=redundant, window_steps=w),
                              policies, tags=tags, dispatch=dispatch)
    return report.curve(), report.staleness.staleness


# (root, version, run_id, ranks, window, dispatch, tag): the placement report's rows per layer under the
# default (contiguous) layout over `ranks` ranks
placement_report = _cached(_placement_report, tagged=True)
# (root, version, run_id, ranks, window, dispatch, tag): (rows, summary, where they came from, why every
# placement must coincide or None): the what-if `moescope placement --whatif --save` stored for the run (no tag
# filter), else one computed with EPLB fitted on the first window of `window` steps
placement_whatif = _cached(_placement_whatif, tagged=True)
# (root, version, run_id, ranks, window, dispatch, tag): (the rebalance replay's curve, the default layout's
# staleness): every-N at 1, 4 and 16 windows, vLLM's and SGLang's schedules and never, each refit EPLB
rebalance_curve = _cached(_rebalance_curve, tagged=True)
# (root, version, run_id, ranks, per_node, layer, tag): `moescope.analyses.traffic.traffic_report`'s rows per layer
# (of `layer` alone, a pass over its routes rows; None: every layer) under the default layout, nodes of
# `per_node` consecutive ranks, with each rank's node (`node_of_rank`)
traffic = _cached(_traffic, tagged=True)


# -- the alerts table (its columns: store/schema.py) -------------------------------------------

def latest_alert_states(alerts: pd.DataFrame) -> pd.DataFrame:
    """The latest transition of each alert (by fingerprint), from `alerts` table rows.

    Several transitions of one alert can share a step (pending and firing at once when a rule has
    no `for`); the latest of those is the end of their chain: the one whose state no other of them
    left from."""
    if alerts is None or alerts.empty:
        return pd.DataFrame()
    latest = []
    for _, rows in alerts.groupby("fingerprint", sort=False):
        rows = rows[(rows.step == rows.step.max())]
        rows = rows[rows.ts == rows.ts.max()]
        if len(rows) > 1:
            left = set(rows.previous_state.astype(str))
            ends = rows[~rows.state.astype(str).isin(left)]
            rows = ends if not ends.empty else rows
        latest.append(rows.iloc[-1])
    return pd.DataFrame(latest).reset_index(drop=True)


def firing_now(alerts: pd.DataFrame) -> pd.DataFrame:
    """Alerts whose latest transition put them in the firing state."""
    latest = latest_alert_states(alerts)
    if latest.empty or "state" not in latest:
        return pd.DataFrame()
    return latest[latest.state.astype(str) == "firing"].reset_index(drop=True)

"""Cached access to the store for the pages: one connection per store, cached query results.

`st.cache_resource` holds the `Store` (one DuckDB connection per store folder, shared by every
browser session; a lock serialises its use because a DuckDB connection is not meant to be used
by two threads at once). Query results go through `st.cache_data` keyed by the widget values and
by the store's *version*, a fingerprint of its committed files: when the probe writes a new file
the version changes, the views are re-made and every query reads fresh data, while a finished
store is queried once per distinct question.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pandas as pd
import streamlit as st

from dashboard import queries
from store.store import EmptyStoreError, Store

T = TypeVar("T")
TTL_S = 600
_lock = threading.RLock()


class NoStore(Exception):
    """The dashboard's store folder does not exist (yet)."""


def store_version(root: str) -> str:
    """A fingerprint of the store's committed Parquet files: count, newest mtime and total size.

    Changes whenever a writer renames a new part into place; '' when the folder is missing."""
    if not os.path.isdir(root):
        return ""
    count, newest, size = 0, 0.0, 0
    for path in glob.iglob(os.path.join(root, "*", "run_id=*", "part-*.parquet")):
        try:
            stat = os.stat(path)
        except FileNotFoundError:  # compacted away between listing and stat
            continue
        count += 1
        newest = max(newest, stat.st_mtime)
        size += stat.st_size
    return f"{count}:{newest:.6f}:{size}"


@st.cache_resource(show_spinner=False)
def _open(root: str) -> dict[str, Any]:
    return {"store": Store(root), "version": None}


def with_store(root: str, version: str, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(store, *args)` on the cached store of `root`, first re-making its views if the
    store's files changed since they were made. Raises NoStore when the folder is missing."""
    if not os.path.isdir(root):
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


def _cached(fn: Callable[..., T]) -> Callable[..., T]:
    # The store version is an argument so new files make new cache entries; the widget values
    # (run, layer, tag filter, ...) are the rest of the key.
    def call(root: str, version: str, *args: Any) -> T:
        return with_store(root, version, fn, *args)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    call.__module__ = __name__
    return st.cache_data(ttl=TTL_S, max_entries=256, show_spinner=False)(call)


runs = _cached(queries.runs)
tag_values = _cached(queries.tag_values)
layers = _cached(queries.layers)
step_totals = _cached(queries.step_totals)
active_fraction_over_time = _cached(queries.active_fraction_over_time)
active_fraction_by_tag = _cached(queries.active_fraction_by_tag)
layer_totals = _cached(queries.layer_totals)
entropy_over_time = _cached(queries.entropy_over_time)
load_matrix = _cached(queries.load_matrix)
layer_expert_load = _cached(queries.layer_expert_load)
coselection = _cached(queries.coselection)
expert_tokens = _cached(queries.expert_tokens)
expert_tag_load = _cached(queries.expert_tag_load)
drift_windows = _cached(queries.drift_windows)
run_rows = _cached(queries.run_rows)
side_summary = _cached(queries.side_summary)
probe_stats = _cached(Store.probe_stats)


def _cache_report(store: Store, run_id: str, layer: int, max_tokens: int,
                  tag: tuple[str, str] | None = None) -> pd.DataFrame:
    from alerts.cache import cache_report

    return cache_report(store, run_id, layer, tags={str(tag[0]): str(tag[1])} if tag else None,
                        max_tokens=max_tokens)


# (root, version, run_id, layer, max_tokens, tag): `alerts.cache.cache_report` of one layer
cache_report = _cached(_cache_report)


@st.cache_data(max_entries=32, show_spinner=False)
def router_input_sample(root: str, run_id: str, layer: int, size: int, data_version: str) -> pd.DataFrame:
    """The cluster page's sample of router inputs, keyed by (run, layer, size, store version)."""
    return with_store(root, data_version, queries.router_input_sample, run_id, layer, size)


@st.cache_resource(show_spinner=False)
def tokenizer(path: str | None):
    """The tokenizer at a local folder (never downloaded), or None without a path."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def token_texts(token_ids: pd.Series, tokenizer_path: str | None) -> list[str]:
    """Each id as its token's text where a tokenizer is known, as '#id' otherwise."""
    tok = tokenizer(tokenizer_path)
    out = []
    for value in token_ids:
        if value is None or pd.isna(value):
            out.append("?")
        elif tok is None:
            out.append(f"#{int(value)}")
        else:
            out.append(tok.decode([int(value)]))
    return out


def context_text(ids: Any, positions: Any, centre: int, tokenizer_path: str | None) -> str:
    """The neighbouring tokens of a sequence as one line, the centre token in [brackets]."""
    if ids is None or isinstance(ids, float) or len(ids) == 0:  # NaN/None: no routes recorded
        return ""
    texts = token_texts(pd.Series(list(ids)), tokenizer_path)
    parts = [f"[{t}]" if int(p) == int(centre) else t for t, p in zip(texts, positions)]
    # Decoded tokens carry their own spaces; ids need one between them.
    return ("" if tokenizer(tokenizer_path) is not None else " ").join(parts)


@st.cache_data(ttl=10, max_entries=32, show_spinner=False)
def outbox_deliveries(root: str, fingerprints: tuple[str, ...]) -> pd.DataFrame | None:
    """The alerts outbox's deliveries of these alerts (re-read every 10 s: it is not Parquet)."""
    return queries.outbox_deliveries(root, fingerprints)

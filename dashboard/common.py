"""What every page shares: the run and tag filter chosen in the sidebar, empty states, guards.

The entry file (`dashboard/app.py`) draws the sidebar widgets (keys prefixed `ms_`, shared by all
pages); a page asks `page_context()` for the result and stops with a friendly message when there
is nothing to show. `guard()` turns the store's errors into a warning instead of a traceback.
`after_first_render()` keeps a heavy section out of a page's first render: it is computed off the
page's run and drawn on the run after, which a fragment asks for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import streamlit as st

from moescope.dashboard import data, settings
from moescope.dashboard.data import TagFilter
from moescope.store import schema
from moescope.store.store import StoreError

log = logging.getLogger(__name__)
T = TypeVar("T")

RUN_KEY = "ms_run"
TAG_KEY_KEY = "ms_tag_key"
TAG_VALUE_KEY = "ms_tag_value"
LIVE_KEY = "ms_live"
AWAIT_S = 1.0  # how often a page asks whether a section computed off its run is there (`after_first_render`)


@dataclass(frozen=True)
class PageContext:
    root: str  # the store's location url (a folder, or a URL): the data functions' key
    version: str
    run_id: str
    tag: TagFilter
    settings: settings.Settings
    layers: pd.DataFrame  # the run's MoE layers (may be empty for a run that recorded nothing yet)

    def layer_ids(self) -> list[int]:
        return [int(v) for v in self.layers.layer] if not self.layers.empty else []

    def num_experts(self, layer: int) -> int:
        rows = self.layers[self.layers.layer == layer]
        return int(rows.num_experts.iloc[0] + rows.zero_experts.fillna(0).iloc[0]) if not rows.empty else 0


def current_settings() -> settings.Settings | None:
    return settings.current()


def run_label(runs: pd.DataFrame, run_id: str) -> str:
    rows = runs[runs.run_id == run_id]
    if rows.empty:
        return run_id
    row = rows.iloc[0]
    started = pd.Timestamp(row.started_at).strftime("%Y-%m-%d %H:%M:%S") if pd.notna(row.started_at) else "?"
    return f"{run_id} · {row.model_class} · {int(row.steps)} steps · {started}"


def tag_filter_from_state() -> TagFilter:
    key, value = st.session_state.get(TAG_KEY_KEY), st.session_state.get(TAG_VALUE_KEY)
    return (str(key), str(value)) if key is not None and value is not None else None


def page_context() -> PageContext | None:
    """The sidebar's choices for this page, or None after showing why there is nothing to show."""
    conf = current_settings()
    if conf is None:
        st.info("No store given. Start the dashboard with `moescope dashboard STORE`.")
        return None
    try:
        location = conf.location
    except ValueError as e:  # a URL or options that cannot be used: what to change, never a traceback
        st.error(f"The store cannot be opened: {e}")
        return None
    root, name = location.url, location.redacted
    if not data.store_exists(root):
        st.info(f"There is no store at `{name}` yet. Record a run into it, e.g. "
                f"`moescope.attach(model, store={name!r}, routes=True)`, or run `moescope demo`; "
                "this page shows it as soon as the first files land.")
        return None
    with guard():
        version = data.store_version(root)
        runs = data.runs(root, version)
        if runs.empty:
            st.info(f"The store at `{name}` holds no run yet. Attach the probe to a model with "
                    f"`store={name!r}`; runs appear here while they are being written.")
            return None
        chosen = st.session_state.get(RUN_KEY)
        run_id = chosen if isinstance(chosen, str) and chosen in set(runs.run_id) else str(runs.run_id.iloc[0])
        return PageContext(root=root, version=version, run_id=run_id, tag=tag_filter_from_state(),
                           settings=conf, layers=data.layers(root, version, run_id))
    return None


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Show a store error as a warning (the page goes on with what it has drawn)."""
    try:
        yield
    except data.NoStore as e:
        st.info(f"There is no store at `{settings.location_of(str(e)).redacted}` yet.")
    except StoreError as e:
        log.warning("store query failed: %s", e)
        st.warning(f"The store could not answer this view: {e}")


def after_first_render(fn: Callable[..., T], *args: Any, what: str) -> T | None:
    """`fn(*args)` (a cached function of `moescope.dashboard.data`) where it is computed; else None,
    and the page's first render does not wait for it: the section says `what` it computes in its
    place, `data.off_the_run` computes it on the server's worker thread into `fn`'s own cache, and a
    fragment runs the page again once it is there (as the Semantic clusters page waits for its UMAP).
    A computation that failed is run again here, in the page's run, whose guard shows its error."""
    future = data.off_the_run(fn, *args)
    if not future.done():
        st.info(what)
        rerun_when_done(future, lambda: "The rest of the page is above; this part is drawn when it is computed.")
        return None
    return fn(*args)


@st.fragment(run_every=AWAIT_S)
def rerun_when_done(future: concurrent.futures.Future, caption: Callable[[], str]) -> None:
    """A fragment that asks every `AWAIT_S` whether `future` is done, runs the whole page again once it
    is, and meanwhile shows `caption()`: how a page waits for work computed off its run (a section
    after its first render, the clusters page's UMAP)."""
    if future.done():
        st.rerun(scope="app")
    st.caption(caption())


NOT_RECORDED = schema.NOT_RECORDED


def run_source(ctx: PageContext) -> str:
    """What recorded the run: "probe", or the engine an importer or the proxy read (`runs.source`)."""
    info = data.run_info(ctx.root, ctx.version, ctx.run_id)
    return "probe" if info is None else str(info["source"])  # stores before the column: all the probe's


def not_recorded(what: str, ctx: PageContext) -> str:
    """'<what>: not recorded by this source (<source>)', the text a view shows instead of zeros."""
    return f"{what}: {NOT_RECORDED} ({run_source(ctx)})"


def layer_picker(ctx: PageContext, key: str, label: str = "MoE layer") -> int | None:
    layers = ctx.layer_ids()
    if not layers:
        st.info("This run has no MoE layer recorded yet.")
        return None
    if st.session_state.get(key) not in layers:
        st.session_state[key] = layers[0]
    return st.selectbox(label, layers, key=key)


def tags_text(tags) -> str:
    """A tags map (as DuckDB returns it) as 'k=v, k=v'."""
    if tags is None or (not isinstance(tags, (dict, list)) and pd.isna(tags)):
        return ""
    items = tags.items() if isinstance(tags, dict) else tags
    return ", ".join(f"{k}={v}" for k, v in items)


def filter_caption(ctx: PageContext) -> None:
    if ctx.tag:
        st.caption(f"Only steps tagged {ctx.tag[0]}={ctx.tag[1]} (sidebar filter).")

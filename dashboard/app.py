"""moescope dashboard: the Streamlit entry file.

Run through `moescope dashboard STORE` (see `moescope/cli/dashboard.py`), or by hand with
`streamlit run dashboard/app.py -- STORE`. This file only draws the sidebar that every page
shares (run picker, tag filter, live refresh) and hands over to the page chosen in the
navigation; the pages live in `dashboard/views/` (not `pages/`: Streamlit would also
list a `pages/` folder as a second, automatic navigation).
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from moescope.dashboard import common, data
from moescope.store.store import StoreError

# The tab icon ships with the package: a ":material/...:" icon makes the browser fetch it from
# fonts.gstatic.com, which fails (and logs an error) where the dashboard runs offline. For the same
# reason the navigation has plain titles, no Material icons.
ICON = Path(__file__).parent / "icon.png"
st.set_page_config(page_title="moescope", page_icon=str(ICON), layout="wide")


def _home() -> None:
    st.switch_page(OVERVIEW)


# Streamlit serves its default page at "/" whatever url_path it is given, so with Overview as the
# default "/overview" was "Page not found". The default is a hidden page that opens Overview at its own
# URL instead, before anything is drawn: every page has the address its name says.
OVERVIEW = st.Page("views/overview.py", title="Overview", url_path="overview")
HOME = st.Page(_home, title="moescope", url_path="home", default=True, visibility="hidden")
PAGES = [
    HOME,
    OVERVIEW,
    st.Page("views/heatmaps.py", title="Heatmaps", url_path="heatmaps"),
    st.Page("views/cache.py", title="Expert cache", url_path="cache"),
    st.Page("views/placement.py", title="Placement", url_path="placement"),
    st.Page("views/clusters.py", title="Semantic clusters", url_path="clusters"),
    st.Page("views/drift.py", title="Drift and alerts", url_path="drift"),
    st.Page("views/health.py", title="Expert health", url_path="health"),
    st.Page("views/training.py", title="Training", url_path="training"),
    st.Page("views/compare.py", title="Compare", url_path="compare"),
    st.Page("views/jitter.py", title="Routing jitter", url_path="jitter"),
    st.Page("views/mismatch.py", title="Engine vs reference", url_path="mismatch"),
]
navigation = st.navigation(PAGES)
if navigation is HOME and get_script_run_ctx() is not None:  # not in a bare import of this file
    st.switch_page(OVERVIEW)


@st.fragment(run_every=conf.refresh_s if (conf := common.current_settings()) else None)
def _watch_store(root: str, seen: str) -> None:
    # Re-run the whole app only when a writer has committed a new file since this run began.
    if data.store_version(root) != seen:
        st.rerun(scope="app")
    st.caption(f"live · checked {time.strftime('%H:%M:%S')}")


def sidebar() -> None:
    conf = common.current_settings()
    st.sidebar.title("moescope")
    if conf is None:
        st.sidebar.info("No store given: start with `moescope dashboard STORE`.")
        return
    try:
        location = conf.location
    except ValueError as e:  # the page says so too
        st.sidebar.warning(f"The store cannot be opened: {e}")
        return
    root = location.url
    st.sidebar.caption(f"store `{location.redacted}`" + (" · writes allowed" if conf.allow_writes else ""))
    if not data.store_exists(root):
        return
    try:
        version = data.store_version(root)
        runs = data.runs(root, version)
        if runs.empty:
            return
        ids = list(runs.run_id)
        if st.session_state.get(common.RUN_KEY) not in ids:
            st.session_state[common.RUN_KEY] = ids[0]
        run_id = st.sidebar.selectbox("Run", ids, key=common.RUN_KEY,
                                      format_func=lambda r: common.run_label(runs, r),
                                      help="Runs in the store, newest first.")
        tags = data.tag_values(root, version, run_id)
        keys = sorted(set(tags.key))
        if st.session_state.get(common.TAG_KEY_KEY) not in [None, *keys]:
            st.session_state[common.TAG_KEY_KEY] = None
        key = st.sidebar.selectbox("Filter by tag", [None, *keys], key=common.TAG_KEY_KEY,
                                   format_func=lambda k: "— all steps —" if k is None else k)
        if key is not None:
            values = sorted(tags[tags.key == key].value)
            if st.session_state.get(common.TAG_VALUE_KEY) not in values:
                st.session_state[common.TAG_VALUE_KEY] = values[0]
            st.sidebar.selectbox(f"{key} =", values, key=common.TAG_VALUE_KEY)
    except data.NoStore:
        return
    except StoreError as e:
        st.sidebar.warning(f"The store could not be read: {e}")
        return
    last = runs.last_ts.max() if "last_ts" in runs and len(runs) else None
    # a store written in the last 5 minutes is live
    recent = last is not None and pd.notna(last) and time.time() - pd.Timestamp(last).timestamp() < 300
    if common.LIVE_KEY not in st.session_state:
        st.session_state[common.LIVE_KEY] = recent
    if st.sidebar.toggle("Live refresh", key=common.LIVE_KEY,
                         help=f"Re-draw when new data lands (checked every {conf.refresh_s:g} s)."):
        with st.sidebar:
            _watch_store(root, version)


sidebar()
navigation.run()

"""moescope's dashboard: a Streamlit app over the store's typed queries.

`moescope dashboard STORE` runs it (`moescope.cli.dashboard`); `app.py` is the entry file and `views/` the
pages. Figure builders (`dashboard.figures`) are pure functions from data frames to Plotly figures;
`dashboard.data` caches the store's queries for the pages. The dashboard only reads: a trust-gate
request goes through the store's writer (`dashboard.gate_requests`).
"""

from __future__ import annotations

__all__ = ["data", "figures", "gate_requests"]

"""moescope's dashboard: a Streamlit app over the store's typed queries.

`moescope dashboard STORE` runs it (`moescope.cli.dashboard`); `app.py` is the entry file and `views/`
the pages, scripts Streamlit runs by path. What a page imports are the modules named in `__all__`,
each loaded on first use (`moescope.dashboard.figures` imports Plotly, `moescope.dashboard.data`
Streamlit):

- `moescope.dashboard.figures`: the figure builders, pure functions from data frames to Plotly
  figures, a module per page and the layout they share;
- `moescope.dashboard.data`: every frame a page draws, the store's queries and the analyses'
  reports cached by store version and widget values; the pages read through it alone;
- `moescope.dashboard.common`: what every page shares (the sidebar's run and tag filter, guards);
- `moescope.dashboard.flips`: what the Routing jitter and Engine vs reference pages share;
- `moescope.dashboard.settings`: how the command line hands the app its store and options;
- `moescope.dashboard.embedding`: the Semantic clusters page's UMAP fits, off the page's run;
- `moescope.dashboard.gate_requests`: the one write, a trust-gate request through the store's writer.
"""

from __future__ import annotations

from moescope.core.lazy import lazy_exports

__all__ = ["common", "data", "embedding", "figures", "flips", "gate_requests", "settings"]

__getattr__, __dir__ = lazy_exports(__name__, {name: f"{__name__}.{name}" for name in __all__})

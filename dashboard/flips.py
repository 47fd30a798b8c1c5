"""What the Routing jitter and Engine vs reference pages (`views/jitter.py`, `views/mismatch.py`) draw
alike: the MoE layer picker with every layer together, the table of the decisions a check listed
with each token's text in its context, and the caption under it. Each page says what its rows are
(a token under a condition, or an engine's (token, layer) pair) and names its own columns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd
import streamlit as st

from moescope.analyses.jitter import expert_change
from moescope.dashboard import data

EVERY_LAYER = "every layer"
TOKENS_SHOWN = 200  # listed decisions a page reads from the store, narrowest margin first


def layer_choice(layers: Iterable[Any], key: str, container: Any = st) -> int | None:
    """The MoE layer picked in `container`'s selectbox (session key `key`) of every layer together then
    each of `layers`; None for every layer. A key holding no option (another run's layer) is reset."""
    options: list[Any] = [EVERY_LAYER, *sorted(int(v) for v in layers)]
    if st.session_state.get(key) not in options:
        st.session_state[key] = EVERY_LAYER
    chosen = container.selectbox("MoE layer", options, key=key)
    return None if chosen == EVERY_LAYER or chosen is None else int(chosen)


def listed_table(tokens: pd.DataFrame, tokenizer: str | None, before: Mapping[str, str], after: Mapping[str, str],
                 change: tuple[str, str, str]) -> pd.DataFrame:
    """The listed decisions as a table: the columns `before` names ({heading: column of `tokens`}), the
    token's text and the text around it (the token between « »: `data.context_text`; ids as '#id'
    without a tokenizer), the columns `after` names, and last `change` (heading, the reference's
    experts' column, the other's) as `[2, 4] → [4, 6]`."""
    texts = data.token_texts(tokens.token_id, tokenizer)
    contexts = [data.context_text(ids, list(range(int(start), int(start) + len(ids))), int(position), tokenizer)
                for ids, start, position in zip(tokens.context_ids, tokens.context_start, tokens.position)]
    heading, reference, other = change
    return pd.DataFrame({
        **{name: tokens[column] for name, column in before.items()}, "token": texts, "in context": contexts,
        **{name: tokens[column] for name, column in after.items()},
        heading: [expert_change(a, b, "→") for a, b in zip(tokens[reference], tokens[other])]})


def listed_caption(shown: int, listed: int, counted: str, bound: str, tokenizer: str | None, note: str = "") -> str:
    """The caption under the table: `shown` of the `listed` `counted` (the check keeps a bounded number
    per `bound`), where the token is, `note`, and how to see text instead of ids."""
    return (f"Narrowest margin first: {shown} of the {listed:,} {counted} the check listed (it keeps a bounded number "
            f"per {bound}). The token is between « »{note}"
            + ("." if tokenizer else "; start the dashboard with `--tokenizer DIR` to see text instead of ids."))

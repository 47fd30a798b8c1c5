"""Issue 34, part 6: `moescope summary` and the dashboard's Overview say forwards and tokens in one
unit (summed over the ranks), on a run two writers recorded as ranks 0 and 1."""

from __future__ import annotations

import pytest

from moescope.analyses.summary import format_summary
from tests.support.deltafiles import snapshot_rows, write_run
from tests.support.pages import app_for, assert_clean, open_page

RUN = "two-ranks"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Rank 0 writes 6 forwards of 16 tokens, rank 1 4 forwards of 24: per rank and summed differ."""
    root = tmp_path_factory.mktemp("ranks")
    write_run(root, RUN, steps=6, seed=0, rank=0, tokens=16)
    write_run(root, RUN, steps=4, seed=1, rank=1, tokens=24)
    return root


def _expected(root) -> tuple[int, int, int]:
    """Forwards, tokens and ranks by a plain loop over the raw `steps` rows."""
    forwards = tokens = 0
    ranks = set()
    for row in snapshot_rows(root, "steps").to_pylist():
        if row["run_id"] != RUN:
            continue
        forwards += row["forwards"] if row["forwards"] is not None else 1
        tokens += row["tokens"]
        ranks.add(row["rank"])
    return forwards, tokens, len(ranks)


def test_summary_counts_forwards_and_tokens_over_the_same_ranks(two_ranks):
    forwards, tokens, ranks = _expected(two_ranks)
    assert (forwards, tokens, ranks) == (10, 6 * 16 + 4 * 24, 2)
    text = format_summary(two_ranks, RUN)
    assert (f"{forwards:,} forwards and {tokens:,} tokens over {ranks} ranks "
            f"({forwards / ranks:,.0f} forwards per rank)") in text.splitlines()[1]


def test_overview_counts_forwards_and_tokens_over_the_same_ranks(monkeypatch, two_ranks):
    forwards, tokens, ranks = _expected(two_ranks)
    at = open_page(app_for(monkeypatch, str(two_ranks)), "views/overview.py")
    assert_clean(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Forwards"] == f"{forwards:,}"
    assert metrics["Tokens"] == f"{tokens:,}"
    captions = [c.value for c in at.caption]
    assert f"over {ranks} ranks" in captions
    assert f"over {ranks} ranks ({forwards / ranks:,.0f} per rank)" in captions

"""What `moescope jitter` and `moescope mismatch` print alike: the dashboard command after the results
runs as printed (the command line's own parser reads back the store and its storage options), the
margin table's bins are the check's edges with each count under its bin, and a count below its floor
is one line naming the option."""

from __future__ import annotations

import argparse
import re
import shlex

import numpy as np
import pytest

from moescope.analyses.jitter import MARGIN_EDGES, JitterError, margin_histogram
from moescope.analyses.mismatch_engine import MismatchError
from moescope.cli import build_parser
from moescope.cli.arguments import store_location
from moescope.cli.routing_checks import check_counts, margin_table, written_line
from moescope.store.location import open_location


@pytest.mark.parametrize("store,options", [
    ("s3://moe-runs/fleet/jitter", {"endpoint": "http://127.0.0.1:9000", "allow_http": "true"}),
    ("runs/with space", {}),
])
def test_the_printed_dashboard_command_opens_the_store_it_wrote(store, options, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = open_location(store, options)
    line = written_line(location, "jit-1", "Routing jitter")
    assert line.startswith(f"written to {location.redacted} as run jit-1; ")
    assert line.endswith('(page "Routing jitter")')
    [command] = re.findall(r"`([^`]*)`", line)
    words = shlex.split(command)
    args = build_parser(["dashboard"]).parse_args(words[words.index("dashboard"):])
    assert args.store == (store if "://" in store else str(tmp_path / store))
    assert len(args.storage_option) == len(options)
    opened = store_location(args)  # as `moescope dashboard` opens it
    assert (opened.url, opened.storage_options) == (location.url, location.storage_options)


def test_the_margin_table_puts_each_count_under_its_bin():
    margins = np.array([0.0, 5e-5, 2e-3, 2e-3, 0.05, 0.5, 7.0])
    counts = margin_histogram(margins)
    header, flipped = margin_table([("flipped", counts)], width=10)
    edges = header.split()
    assert edges == [f">={edge:g}" for edge in MARGIN_EDGES]
    cells = flipped[10:].split()
    assert flipped[:10].strip() == "flipped" and len(cells) == len(edges)
    expected = {edge: sum(lo <= m < hi for m in margins)
                for edge, lo, hi in zip(edges, MARGIN_EDGES, [*MARGIN_EDGES[1:], np.inf])}
    for edge, cell in zip(edges, cells):  # right-aligned: each count ends where its bin's label ends
        assert int(cell) == expected[edge]
        assert flipped.index(cell, 10 + header[10:].index(edge) + len(edge) - len(cell)) + len(cell) == (
            header.index(edge) + len(edge))


@pytest.mark.parametrize("values,says", [
    ({"batch_size": 0, "max_sequences": None, "max_listed": 5, "show": 1}, "--batch-size must be at least 1, got 0"),
    ({"batch_size": 2, "max_sequences": 0, "max_listed": 5, "show": 1}, "--max-sequences must be at least 1, got 0"),
    ({"batch_size": 2, "max_sequences": None, "max_listed": 5, "show": -1}, "--show must be 0 or more, got -1"),
])
@pytest.mark.parametrize("error", [JitterError, MismatchError])
def test_a_count_below_its_floor_names_its_option(values, says, error):
    with pytest.raises(error, match=f"^{re.escape(says)}$"):
        check_counts(argparse.Namespace(**values), error, ("batch_size", "max_sequences"))
    check_counts(argparse.Namespace(**{**values, "batch_size": 1, "max_sequences": None, "show": 0}), error,
                 ("batch_size", "max_sequences"))  # at the floors, or left out: nothing to say

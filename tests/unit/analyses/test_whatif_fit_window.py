"""The placement what-if's figures when it is fitted on a window other than the first (`--fit-window 1`):
the fit column is the fit window's balancedness, decay is fit - later, and gain is a candidate's later
windows against the default layout's later windows. Expected values are plain loops over the loads
the test wrote (each expert's slots on the rank that holds it) and an independent EPLB
(tests/support/eplb_reference.py); the traffic shifts so that window 0 and the fit window differ."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.analyses.placement import WhatIfSetup, placement_whatif
from moescope.cli import main
from moescope.store import Store
from moescope.store.writer import ParquetExporter
from tests.support.alert_records import layer_step, run_info, step_record
from tests.support.eplb_reference import reference_eplb

# One step per window; layer 1 sees layer 0's traffic mirrored. Window 1, the fit window, is nearly
# even under the default layout; window 0 crowds rank 0 and the later windows drift away from the fit.
LOADS = [
    [10, 10, 10, 10, 1, 1, 1, 1],
    [6, 5, 5, 5, 5, 5, 5, 4],
    [8, 8, 4, 4, 4, 4, 4, 4],
    [2, 2, 2, 2, 8, 8, 8, 8],
]
RANKS, FIT = 2, 1
DEFAULT = [[0, 1, 2, 3], [4, 5, 6, 7]]  # the contiguous layout of 8 experts on 2 ranks


def layer_loads(window: int) -> dict[int, list[int]]:
    return {0: LOADS[window], 1: LOADS[window][::-1]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("whatif-fit") / "store")
    exporter = ParquetExporter(root, run_info("w"))
    exporter.export([step_record(step, [layer_step(layer, load) for layer, load in layer_loads(step).items()],
                                 run_id="w") for step in range(len(LOADS))])
    exporter.shutdown()
    return root


def loop_balancedness(window: int, layout_of) -> float:
    """Sum over layers of the mean rank load / sum of the busiest rank's, by a loop over the experts."""
    means = peaks = 0.0
    for layer, load in layer_loads(window).items():
        ranks = [0.0] * RANKS
        for rank, experts in enumerate(layout_of(layer)):
            for expert in experts:
                ranks[rank] += load[expert]
        means += sum(ranks) / RANKS
        peaks += max(ranks)
    return means / peaks


def test_the_fit_column_is_the_fit_windows_and_gain_is_against_the_defaults_later_windows(root):
    with Store(root) as store:
        report = placement_whatif(store, "w", 1, WhatIfSetup(ranks=RANKS, fit_window=FIT), dispatch="even")
    figures = report.figures().set_index("candidate")

    default = [loop_balancedness(t, lambda layer: DEFAULT) for t in range(len(LOADS))]
    fitted = {layer: reference_eplb(np.array(load, float), RANKS, 1, 1, 0) for layer, load in layer_loads(FIT).items()}
    eplb = [loop_balancedness(t, fitted.get) for t in range(len(LOADS))]
    assert abs(default[0] - default[FIT]) > 0.3  # window 0 is not the fit window: a mix-up shows

    assert figures.loc["default", "fit"] == pytest.approx(default[FIT])
    assert figures.loc["default", "later"] == pytest.approx(np.mean(default[FIT + 1:]))
    assert figures.loc["default", "decay"] == pytest.approx(default[FIT] - np.mean(default[FIT + 1:]))
    assert figures.loc["default", "gain"] == 0  # the default against itself
    assert figures.loc["eplb", "fit"] == pytest.approx(eplb[FIT])
    assert figures.loc["eplb", "decay"] == pytest.approx(eplb[FIT] - np.mean(eplb[FIT + 1:]))
    assert figures.loc["eplb", "gain"] == pytest.approx(np.mean(eplb[FIT + 1:]) - np.mean(default[FIT + 1:]))
    assert (figures.windows == len(LOADS) - FIT - 1).all()
    # load-aware: its gain is its own later windows against the default's, whatever it placed
    summary = report.summary[report.summary.candidate == "load-aware"].sort_values("window_start")
    assert figures.loc["load-aware", "gain"] == pytest.approx(
        summary.balancedness.iloc[FIT + 1:].mean() - np.mean(default[FIT + 1:]))


def test_the_printed_table_shows_the_fit_windows_figures(root, capsys):
    assert main(["placement", root, "--ranks", str(RANKS), "--whatif", "--window", "1", "--fit-window", str(FIT),
                 "--dispatch", "even"]) == 0
    out = capsys.readouterr().out
    default = [loop_balancedness(t, lambda layer: DEFAULT) for t in range(len(LOADS))]
    later = np.mean(default[FIT + 1:])
    row = (f"  {'default':<18}{default[FIT]:>8.3f}{later:>8.3f}{default[-1]:>8.3f}{default[FIT] - later:>8.3f}"
           f"{0.0:>8.3f}")
    assert row in out, out

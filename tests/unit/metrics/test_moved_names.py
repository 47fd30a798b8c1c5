"""The names issue 46 moved into the metrics room (and the summary into analyses) are still found at
their old homes, as the same objects: each is defined once."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    # (old module, name, new module)
    *[("moescope.analyses.placement", name, "moescope.metrics.placement")
      for name in ("Placement", "PlacementError", "RankExperts", "DEFAULT_KEY", "contiguous_layout",
                   "parse_placement")],
    *[("moescope.analyses.placement", name, "moescope.metrics.dispatch")
      for name in ("DISPATCH", "ENGINE_OF_SOURCE", "TRTLLM_BLOCK_SLOTS", "slot_ranks")],
    *[("moescope.analyses.placement", name, "moescope.analyses.placement_whatif")
      for name in ("WhatIfSetup", "WhatIfReport", "placement_whatif", "write_whatif", "CANDIDATES",
                   "WHATIF_COLUMNS")],
    ("moescope.analyses.traffic", "wire_layout", "moescope.metrics.placement"),
    *[("moescope.analyses.eplb", name, "moescope.metrics.eplb")
      for name in ("eplb", "load_aware", "balanced_packing", "replicate", "HOT_SHARE", "MID_SHARE")],
    *[("moescope.metrics.signals", name, "moescope.metrics.ranks")
      for name in ("REPLICA_SPLITS", "replica_shares", "expected_rank_tokens", "balancedness_over_layers",
                   "rank_load")],
    *[("moescope.metrics.signals", name, "moescope.metrics.capacity")
      for name in ("CAPACITY_FACTORS", "WhatIfCapacity", "expert_capacity", "whatif_capacity")],
    *[("moescope.metrics.signals", name, "moescope.metrics.figures")
      for name in ("LayerFigures", "layer_figures", "RunFigures", "run_figures", "RunCounts", "run_counts",
                   "layer_figures_of")],
    *[("moescope.cli.summary", name, "moescope.analyses.summary")
      for name in ("format_summary", "layer_rows", "host_rows", "store_arguments")],
]


@pytest.mark.parametrize("old, name, new", MOVED)
def test_a_moved_name_is_the_same_object_at_its_old_home(old, name, new):
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("module", ["moescope.metrics.signals", "moescope.analyses.placement", "moescope.metrics",
                                    "moescope.analyses"])
def test_every_name_in_all_resolves(module):
    loaded = importlib.import_module(module)
    for name in loaded.__all__:
        assert getattr(loaded, name, None) is not None or importlib.import_module(f"{module}.{name}")


def test_an_unknown_name_is_still_an_attribute_error():
    from moescope.analyses import placement
    from moescope.metrics import signals

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        signals.nothing  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        placement.nothing  # noqa: B018

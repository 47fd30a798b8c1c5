"""`moescope import megatron`: Megatron-core router traces (`--moe-routing-trace-path`) into a store.

Megatron cannot run here (no GPU, no cluster), so the traces are built to the layout its router
tracer documents: one `router_trace_rank{r}.jsonl` per rank, one line per router call with
`step`, `stage`, `block`, `layer`, `rank`, `num_tokens`, `topk` and `top_indices`; several calls
of a layer in a step (micro-batches), several ranks, and an MTP record that must be left out.
Expected loads, co-selection and switches are counted from the drawn ids by plain loops.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from moescope.ingest.importers import SourceFormatError, import_files
from moescope.store import Store
from tests.support.importing import (
    loop_coselection,
    loop_loads,
    parquet_rows,
    store_files,
    stored_loads,
    top1_switches,
)

E, K = 8, 2


def build(folder: str, rng: np.random.Generator) -> tuple[list[tuple], list[tuple]]:
    os.makedirs(folder, exist_ok=True)
    rows, switches = [], []
    for rank in (0, 1):
        lines = []
        for step in range(4):
            for micro in range(2 if rank == 0 else 1):
                for layer in (1, 3):
                    n = 4 + step + micro
                    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)])
                    rows += [(step, layer, row.tolist()) for row in ids]
                    if layer == 3:
                        switches += [((step, rank, micro), pos, int(ids[pos, 0])) for pos in range(n)]
                    lines.append({"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
                                  "rank": rank, "num_tokens": n, "topk": K, "top_indices": ids.tolist()})
            lines.append({"step": step, "stage": "pre_dispatch", "block": "mtp", "layer": 1, "rank": rank,
                          "mtp_idx": 0, "num_tokens": 1, "topk": K, "top_indices": [[0, 1]]})
        with open(os.path.join(folder, f"router_trace_rank{rank}.jsonl"), "w") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))
    return rows, switches


def test_traces_of_two_ranks_with_micro_batches(tmp_path):
    folder = str(tmp_path / "trace")
    rows, switches = build(folder, np.random.default_rng(0))
    root = str(tmp_path / "store")
    summary = import_files("megatron", [folder], root, num_experts=E)
    assert (summary.steps, summary.layers, summary.ranks) == (4, 2, 2)
    assert sum(summary.notes.values()) == 8  # the MTP records, left out
    assert stored_loads(root, summary.run_id) == loop_loads(rows, E)
    with Store(root) as store:
        for layer in (1, 3):
            np.testing.assert_array_equal(store.coselection(summary.run_id, layer), loop_coselection(rows, layer, E))
        assert store.tag_values(summary.run_id).value.tolist() == ["pre_dispatch"]
    stored = [((r["step"], r["rank"], r["sequence"]), r["position"], r["expert_ids"][0])
              for r in parquet_rows(root, "routes", summary.run_id).to_pylist() if r["layer"] == 3]
    assert sorted(stored) == sorted(switches)
    assert top1_switches(stored) == top1_switches(switches)


@pytest.mark.parametrize("damage, expected", [
    (lambda text: text[:-25], "line 12: not valid JSON"),
    (lambda text: text.replace('"num_tokens": 4,', '"num_tokens": 5,', 1), "must hold num_tokens=5 rows"),
    (lambda text: text.replace('"topk": 2,', '"topk": 3,', 1), r"must be 4 x 3 integer expert ids"),
    (lambda text: text.replace('"layer": 1, ', "", 1), "needs the fields"),
])
def test_bad_traces_name_the_file_and_line_and_write_nothing(tmp_path, damage, expected):
    folder = str(tmp_path / "trace")
    build(folder, np.random.default_rng(1))
    path = os.path.join(folder, "router_trace_rank1.jsonl")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(damage(text))
    root = str(tmp_path / "store")
    with pytest.raises(SourceFormatError, match=expected) as error:
        import_files("megatron", [folder], root)
    assert "router_trace_rank1.jsonl" in str(error.value)
    assert store_files(root) == []

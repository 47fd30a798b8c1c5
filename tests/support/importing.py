"""What the importer tests share: raw Parquet rows, and expectations computed by plain loops.

Expected values never come from moescope's own code: loads and co-selection are counted token by
token from the arrays a test built, and the store's rows are read straight from the Parquet files.
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def parquet_rows(root: str, table: str, run_id: str | None = None) -> pa.Table:
    """Every row of a table (of one run), read from its Parquet files without moescope."""
    folder = f"run_id={run_id}" if run_id else "run_id=*"
    files = sorted(glob.glob(os.path.join(root, table, folder, "part-*.parquet")))
    if not files:
        return pa.table({})
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")


def store_files(root: str) -> list[str]:
    """Every file under a store folder (empty when nothing was written)."""
    return sorted(p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p))


def loop_loads(token_rows: list[tuple], num_experts: int) -> dict[tuple, list[int]]:
    """{(step, layer): tokens per expert} from (step, layer, ids) token rows; -1 slots are not experts."""
    loads: dict[tuple, list[int]] = defaultdict(lambda: [0] * num_experts)
    for step, layer, ids in token_rows:
        for expert in ids:
            if expert >= 0:
                loads[(step, layer)][expert] += 1
    return dict(loads)


def loop_coselection(token_rows: list[tuple], layer: int, num_experts: int) -> np.ndarray:
    """Tokens of `layer` choosing both i and j, counted pair by pair."""
    out = np.zeros((num_experts, num_experts), dtype=np.int64)
    for _, row_layer, ids in token_rows:
        if row_layer != layer:
            continue
        chosen = [e for e in ids if e >= 0]
        for i in chosen:
            for j in chosen:
                out[i, j] += 1
    return out


def stored_loads(root: str, run_id: str) -> dict[tuple, list[int]]:
    """{(step, layer): expert_load} from the raw layer_steps rows, ranks summed."""
    rows = parquet_rows(root, "layer_steps", run_id).to_pylist()
    out: dict[tuple, list[int]] = {}
    for row in rows:
        key = (row["step"], row["layer"])
        out[key] = [a + b for a, b in zip(out[key], row["expert_load"])] if key in out else list(row["expert_load"])
    return out


def top1_switches(rows: list[tuple]) -> tuple[int, int]:
    """(changes, adjacent pairs) of the top-1 expert between neighbouring positions of a sequence,
    from (sequence key, position, top1) rows, by sorting and walking them."""
    changes = pairs = 0
    ordered = sorted(rows)
    for (s0, p0, e0), (s1, p1, e1) in zip(ordered, ordered[1:]):
        if s0 == s1 and p1 == p0 + 1:
            pairs += 1
            changes += e0 != e1
    return changes, pairs

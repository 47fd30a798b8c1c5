"""`moescope import trtllm`: TensorRT-LLM's expert statistics folder into a store.

TensorRT-LLM cannot run here (no GPU, no engine), so the folder is built to the layout its
`EXPERT_STATISTIC_PATH` dump documents: `meta_info.json` with `num_experts` and
`num_experts_per_token`, and `rank{r}.safetensors` per rank (written with
`safetensors.torch.save_file`, as the engine does) whose keys `"{iter}_{layer}"` are bincounts
over the experts; the extra files it may write beside them are present and must be ignored.
Expected loads and tokens are counted from the drawn routes by plain loops.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moescope.ingest.importers import SourceFormatError, import_files
from moescope.store import Store
from tests.support.importing import loop_loads, parquet_rows, store_files, stored_loads

E, K = 8, 2
ITERS, LAYERS, RANKS = range(50, 54), (0, 1, 2), (0, 1)


def build(folder: str, rng: np.random.Generator) -> tuple[list[tuple], dict]:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "meta_info.json"), "w") as f:
        json.dump({"num_experts": E, "num_experts_per_token": K}, f)
    rows, tokens = [], {}
    for rank in RANKS:
        records = {}
        for it in ITERS:
            n = 3 + it % 4 + rank
            tokens[it] = tokens.get(it, 0) + n
            for layer in LAYERS:
                ids = np.stack([rng.choice(E, K, replace=False, p=np.arange(1, E + 1) / 36) for _ in range(n)])
                rows += [(it, layer, row.tolist()) for row in ids]
                counts = torch.bincount(torch.from_numpy(ids.reshape(-1)), minlength=E)
                records[f"{it}_{layer}"] = counts.to(torch.int32)
        save_file(records, os.path.join(folder, f"rank{rank}.safetensors"))
        save_file({"50_0": torch.zeros(3, 2)}, os.path.join(folder, f"rank{rank}_raw.safetensors"))
    return rows, tokens


def test_statistics_of_two_ranks_sum_per_iteration(tmp_path):
    folder = str(tmp_path / "expert_statistic")
    rows, tokens = build(folder, np.random.default_rng(0))
    root = str(tmp_path / "store")
    summary = import_files("trtllm", [folder], root)
    assert (summary.steps, summary.layers, summary.ranks) == (4, 3, 2)
    assert stored_loads(root, summary.run_id) == loop_loads(rows, E)
    with Store(root) as store:
        per_step = store.sql("SELECT step, sum(tokens) AS t FROM layer_steps WHERE layer = 0 GROUP BY step "
                             "ORDER BY step")
        layers = store.layers(summary.run_id)
    assert dict(zip(per_step.step, per_step.t)) == tokens
    assert layers.num_experts.tolist() == [E] * 3 and layers.top_k.tolist() == [K] * 3
    runs = parquet_rows(root, "runs", summary.run_id).to_pylist()
    assert {(r["rank"], r["world_size"], r["source"]) for r in runs} == {(0, 2, "trtllm"), (1, 2, "trtllm")}
    assert all(r["coselection"] is None and r["router_entropy_mean"] is None
               for r in parquet_rows(root, "layer_steps", summary.run_id).to_pylist())


def test_bad_statistics_name_the_file_and_write_nothing(tmp_path):
    root = str(tmp_path / "store")
    cases = {}
    for name in ("truncated", "length", "key", "meta"):
        folder = str(tmp_path / name)
        build(folder, np.random.default_rng(1))
        cases[name] = folder
    with open(os.path.join(cases["truncated"], "rank1.safetensors"), "rb") as f:
        raw = f.read()
    with open(os.path.join(cases["truncated"], "rank1.safetensors"), "wb") as f:
        f.write(raw[: len(raw) - 40])
    save_file({"50_0": torch.zeros(E - 1, dtype=torch.int32)}, os.path.join(cases["length"], "rank1.safetensors"))
    save_file({"iter50_layer0": torch.zeros(E, dtype=torch.int32)}, os.path.join(cases["key"], "rank1.safetensors"))
    with open(os.path.join(cases["meta"], "meta_info.json"), "w") as f:
        json.dump({"num_experts": E}, f)
    expected = {"truncated": "rank1.safetensors: not a readable", "length": "rank1.safetensors: 50_0 must be",
                "key": "rank1.safetensors: key 'iter50_layer0'", "meta": "meta_info.json must hold"}
    for name, folder in cases.items():
        with pytest.raises(SourceFormatError, match=expected[name]):
            import_files("trtllm", [folder], root)
    os.remove(os.path.join(cases["meta"], "meta_info.json"))
    with pytest.raises(SourceFormatError, match="expected one meta_info.json"):
        import_files("trtllm", [cases["meta"]], root)
    assert store_files(root) == []

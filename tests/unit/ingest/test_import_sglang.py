"""`moescope import sglang`: expert-distribution recorder dumps, the legacy CSV and per-request routing.

SGLang cannot run here (no GPU, no engine), so the files are built to the layouts SGLang's
recorder documents and writes with `torch.save`: `stat` dumps with a circular `logical_count`
buffer (unused zero rows, wrap-around, dense layers all zero), `per_pass` / `per_token` records
with physical expert ids mapped through `last_physical_to_logical_map`, `topk_ids_of_layer`
padded to 8 slots with -1, several ranks, the legacy CSV, and `/generate` responses carrying
base64 int32 `meta_info.routed_experts`. Routes are drawn as logical experts first; expected
loads and co-selection are counted from those by plain loops, never by moescope's own code.
"""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
import torch

from moescope.ingest.importers import SourceFormatError, import_files
from moescope.store import Store
from tests.support.importing import loop_coselection, loop_loads, parquet_rows, store_files, stored_loads

E, P, L, K = 6, 8, 4, 2  # logical experts, physical slots, layers (layer 0 dense), top-k
PHYSICAL_TO_LOGICAL = [0, 1, 2, 3, 4, 5, 0, 3]  # experts 0 and 3 have a second replica
MAP = torch.tensor([PHYSICAL_TO_LOGICAL] * L, dtype=torch.int32)


def draw(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """(tokens, L, K) logical ids; -1 on the dense layer 0."""
    out = np.full((tokens, L, K), -1, dtype=np.int64)
    for t in range(tokens):
        for layer in range(1, L):
            out[t, layer] = rng.choice(E, K, replace=False)
    return out


def to_physical(rng: np.random.Generator, logical: np.ndarray) -> np.ndarray:
    replicas = {e: [p for p, x in enumerate(PHYSICAL_TO_LOGICAL) if x == e] for e in range(E)}
    out = np.full(logical.shape, -1, dtype=np.int64)
    for index, e in np.ndenumerate(logical):
        if e >= 0:
            out[index] = rng.choice(replicas[int(e)])
    return out


def token_rows(step: int, logical: np.ndarray) -> list[tuple]:
    return [(step, layer, logical[t, layer].tolist()) for t in range(len(logical)) for layer in range(L)
            if logical[t, layer, 0] >= 0]


def dump_name(folder, t: float, rank: int | None = None) -> str:
    suffix = "" if rank is None else f"_{rank}"
    return os.path.join(str(folder), f"expert_distribution_recorder_{t}{suffix}.pt")


def stat_dump(folder, t: float, passes: list[np.ndarray], buffer: int) -> str:
    counts = torch.zeros((buffer, L, E), dtype=torch.int32)
    for row, logical in enumerate(passes):
        for layer in range(1, L):
            counts[row, layer] = torch.from_numpy(np.bincount(logical[:, layer].reshape(-1), minlength=E))
    path = dump_name(folder, t)
    torch.save(dict(rank=0, logical_count=counts, average_utilization_rate_over_window=None), path)
    return path


def test_stat_buffer_with_unused_rows_is_one_step_per_pass(tmp_path):
    rng = np.random.default_rng(0)
    passes = [draw(rng, 5 + i) for i in range(5)]
    path = stat_dump(tmp_path, 1700000000.25, passes, buffer=8)  # 3 rows unused
    root = str(tmp_path / "store")
    summary = import_files("sglang", [path], root, top_k=K)
    rows = [r for i, p in enumerate(passes) for r in token_rows(i, p)]
    assert stored_loads(root, summary.run_id) == loop_loads(rows, E)
    steps = sorted(parquet_rows(root, "steps", summary.run_id).to_pylist(), key=lambda s: s["step"])
    assert [s["tokens"] for s in steps] == [5 + i for i in range(5)]
    assert steps[0]["ts"].timestamp() == pytest.approx(1700000000.25)
    assert sorted({r["layer"] for r in parquet_rows(root, "layer_steps", summary.run_id).to_pylist()}) == [1, 2, 3]
    assert parquet_rows(root, "routes").num_rows == 0  # counts only: no per-token routes


def test_full_stat_buffer_may_have_wrapped_so_it_is_one_window_unless_in_order(tmp_path):
    rng = np.random.default_rng(1)
    passes = [draw(rng, 4) for _ in range(4)]
    path = stat_dump(tmp_path, 1700000001.0, passes, buffer=4)  # every row used
    root = str(tmp_path / "store")
    window = import_files("sglang", [path], root, top_k=K, run_id="window")
    assert window.steps == 1 and any("wrapped" in note for note in window.notes)
    total = [(0, layer, ids) for _, layer, ids in (r for i, p in enumerate(passes) for r in token_rows(i, p))]
    assert stored_loads(root, "window") == loop_loads(total, E)
    ordered = import_files("sglang", [path], root, top_k=K, run_id="ordered", in_order=True)
    assert ordered.steps == 4
    assert stored_loads(root, "ordered") == loop_loads([r for i, p in enumerate(passes) for r in token_rows(i, p)], E)


def test_per_pass_records_of_two_ranks_map_physical_counts_to_logical_experts(tmp_path):
    rng = np.random.default_rng(2)
    expected, paths = [], []
    for rank in (0, 1):
        records = []
        for fid in range(4):
            logical = draw(rng, 3 + fid + rank)
            physical = to_physical(rng, logical)
            count = torch.zeros((L, P), dtype=torch.int32)
            for layer in range(1, L):
                count[layer] = torch.from_numpy(np.bincount(physical[:, layer].reshape(-1), minlength=P))
            records.append(dict(forward_pass_id=fid, rank=rank, gatherer_key="primary", global_physical_count=count))
            expected += token_rows(fid, logical)
        paths.append(dump_name(tmp_path, 1700000002.0 + rank, rank))
        torch.save(dict(records=records, last_physical_to_logical_map=MAP), paths[-1])
    root = str(tmp_path / "store")
    summary = import_files("sglang", paths, root, top_k=K)
    assert (summary.steps, summary.ranks) == (4, 2)
    assert stored_loads(root, summary.run_id) == loop_loads(expected, E)
    with Store(root) as store:
        assert store.runs().ranks.tolist() == [2]
        tokens = store.sql("SELECT step, sum(tokens) AS t FROM steps GROUP BY step ORDER BY step").t.tolist()
    assert tokens == [(3 + f) + (3 + f + 1) for f in range(4)]


def per_token_dump(tmp_path, rng) -> tuple[str, list[tuple], set[tuple]]:
    records, rows, routes = [], [], set()
    layouts = [(1, [3, 4], None), (2, None, [7, 4, 9, 2, 5]), (1, [2], None)]  # (forward_mode, lens, positions)
    for fid, (mode, lens, positions) in enumerate(layouts):
        tokens = sum(lens) if lens else len(positions)
        if lens:
            positions = [p for n in lens for p in range(n)]
            sequences = [s for s, n in enumerate(lens) for _ in range(n)]
        else:
            sequences = list(range(tokens))
        logical = draw(rng, tokens)
        physical = to_physical(rng, logical)
        ids = torch.full((L, tokens, 8), -1, dtype=torch.int32)  # padded to 8 slots like the recorder
        ids[:, :, :K] = torch.from_numpy(physical.transpose(1, 0, 2).astype(np.int32))
        count = torch.zeros((L, P), dtype=torch.int32)
        for layer in range(L):
            valid = physical[:, layer][physical[:, layer] >= 0]
            count[layer] = torch.from_numpy(np.bincount(valid, minlength=P))
        input_ids = rng.integers(100, 200, tokens).tolist()
        records.append(dict(forward_pass_id=fid, rank=0, gatherer_key="primary", input_ids=input_ids,
                            positions=positions, extend_seq_lens=lens, forward_mode=mode, topk_ids_of_layer=ids,
                            misc_objects=[], global_physical_count=count))
        rows += token_rows(fid, logical)
        for t in range(tokens):
            for layer in range(1, L):
                routes.add((fid, layer, sequences[t], positions[t], input_ids[t], tuple(logical[t, layer].tolist()),
                            str(mode)))
    path = dump_name(tmp_path, 1700000003.5, 0)
    torch.save(dict(records=records, last_physical_to_logical_map=MAP), path)
    return path, rows, routes


def test_per_token_records_become_logical_routes(tmp_path):
    path, rows, routes = per_token_dump(tmp_path, np.random.default_rng(3))
    root = str(tmp_path / "store")
    summary = import_files("sglang", [path], root)  # top-k comes from the routes themselves
    assert stored_loads(root, summary.run_id) == loop_loads(rows, E)
    stored = parquet_rows(root, "routes", summary.run_id).to_pylist()
    assert {(r["step"], r["layer"], r["sequence"], r["position"], r["token_id"], tuple(r["expert_ids"]),
             dict(r["tags"])["forward_mode"]) for r in stored} == routes
    with Store(root) as store:
        for layer in (1, 2, 3):
            np.testing.assert_array_equal(store.coselection(summary.run_id, layer), loop_coselection(rows, layer, E))
        assert store.layers(summary.run_id).top_k.tolist() == [K, K, K]


def test_legacy_csv_counts(tmp_path):
    rng = np.random.default_rng(4)
    logical = draw(rng, 10)
    path = str(tmp_path / "expert_distribution.csv")
    with open(path, "w") as f:
        f.write("layer_id,expert_id,count\n")
        for layer in range(1, L):
            for expert, count in enumerate(np.bincount(logical[:, layer].reshape(-1), minlength=E)):
                if count:
                    f.write(f"{layer},{expert},{count}\n")
    root = str(tmp_path / "store")
    summary = import_files("sglang", [path], root, top_k=K, num_experts=E)
    assert stored_loads(root, summary.run_id) == loop_loads(token_rows(0, logical), E)
    assert [r["tokens"] for r in parquet_rows(root, "layer_steps", summary.run_id).to_pylist()] == [10, 10, 10]


def test_generate_responses_with_base64_routed_experts(tmp_path):
    rng = np.random.default_rng(5)
    rows, lines = [], []
    for r, (prompt, completion) in enumerate([(4, 3), (6, 2), (3, 5)]):
        n = prompt + completion
        logical = draw(rng, n - 1 if r != 1 else n)  # n-1 rows: the last token never ran a forward
        rows += token_rows(r, logical)
        payload = base64.b64encode(logical.astype("<i4").tobytes()).decode()
        body = {"text": "x", "meta_info": {"id": f"req-{r}", "prompt_tokens": prompt, "completion_tokens": completion,
                                           "routed_experts": payload}}
        if r == 2:  # a stream: earlier chunks carry no routing, the final one does
            lines.append(json.dumps({"text": "", "meta_info": {"id": "req-2", "prompt_tokens": 3,
                                                               "completion_tokens": 1}}))
        lines.append(json.dumps(body))
    path = str(tmp_path / "responses.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    root = str(tmp_path / "store")
    with pytest.raises(ValueError, match="--num-layers"):
        import_files("sglang", [path], root)
    assert store_files(root) == []
    summary = import_files("sglang", [path], root, num_layers=L, top_k=K, num_experts=E)
    assert summary.steps == 3
    assert stored_loads(root, summary.run_id) == loop_loads(rows, E)
    positions = sorted(r["position"] for r in parquet_rows(root, "routes", summary.run_id).to_pylist()
                       if r["step"] == 0 and r["layer"] == 1)
    assert positions == list(range(6))


class Payload:
    """Unpickling this would run a command: a pickle payload weights_only loading must refuse."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bad_dumps_name_the_file_and_write_nothing(tmp_path):
    rng = np.random.default_rng(6)
    good = stat_dump(tmp_path, 1700000010.0, [draw(rng, 4)], buffer=4)
    marker = str(tmp_path / "executed")
    cases = {}
    cases["payload"] = dump_name(tmp_path, 1700000011.0)
    torch.save({"logical_count": Payload(marker)}, cases["payload"])
    cases["truncated"] = dump_name(tmp_path, 1700000012.0)
    with open(good, "rb") as f:
        raw = f.read()
    with open(cases["truncated"], "wb") as f:
        f.write(raw[: len(raw) // 2])
    cases["list"] = dump_name(tmp_path, 1700000013.0)
    torch.save([torch.zeros(3)], cases["list"])
    cases["shape"] = dump_name(tmp_path, 1700000014.0)
    torch.save(dict(rank=0, logical_count=torch.zeros((4, E), dtype=torch.int32)), cases["shape"])
    cases["floats"] = dump_name(tmp_path, 1700000015.0)
    torch.save(dict(rank=0, logical_count=torch.zeros((2, L, E))), cases["floats"])
    cases["keys"] = dump_name(tmp_path, 1700000016.0)
    torch.save(dict(weights=torch.zeros(3)), cases["keys"])
    damaged, _, _ = per_token_dump(tmp_path, rng)
    payload = torch.load(damaged, weights_only=True)
    payload["records"][1]["global_physical_count"][2, 0] += 1
    cases["damaged"] = dump_name(tmp_path, 1700000017.0, 0)
    torch.save(payload, cases["damaged"])
    expected = {"payload": "weights_only=True", "truncated": "weights_only=True", "list": "holds a list",
                "shape": "3 dimensions", "floats": "integers", "keys": "not an expert-distribution dump",
                "damaged": "disagrees"}
    root = str(tmp_path / "store")
    for name, path in cases.items():
        with pytest.raises(SourceFormatError, match=expected[name]) as error:
            import_files("sglang", [good, path], root, top_k=K)
        assert os.path.basename(path) in str(error.value), name
    assert not os.path.exists(marker)
    assert store_files(root) == []
    with pytest.raises(ValueError, match="--top-k"):
        import_files("sglang", [good], root)
    with pytest.raises(SourceFormatError, match="mix SGLang formats"):
        import_files("sglang", [good, damaged], root, top_k=K)
    assert store_files(root) == []

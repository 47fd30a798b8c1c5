"""`moescope import` under hostile and careless input (issue 23, items 1, 3, 4 and 5).

Every file is real (JSON, JSON Lines, .npy, CSV, safetensors, torch dumps, Megatron traces written
into tmp_path). Bad input must give one line naming the file, where in it and what was expected,
exit non-zero from the command line without a traceback, and write nothing; good input must be
stored exactly as a plain loop over the raw values counts it, read back from the raw Parquet rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moescope.cli import main
from moescope.ingest.importers import SourceFormatError, import_files
from tests.support.importing import loop_loads, parquet_rows, store_files, stored_loads

E = 8


def vllm_body(prompt: list, rid: str = "cmpl-0", **extra) -> dict:
    body = {"id": rid, "object": "text_completion", "created": 1_700_000_000, "model": "m",
            "prompt_token_ids": list(range(10, 10 + len(prompt))), "prompt_routed_experts": prompt,
            "choices": [{"index": 0, "text": "", "token_ids": [], "routed_experts": []}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0}}
    body.update(extra)
    return body


def write_json(path, value) -> str:
    with open(path, "w") as f:
        json.dump(value, f)
    return str(path)


def trace_line(**fields) -> dict:
    record = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0, "num_tokens": 2,
              "topk": 2, "top_indices": [[0, 1], [2, 3]]}
    record.update(fields)
    return record


def write_trace(folder, *records, rank: int = 0) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(str(folder), f"router_trace_rank{rank}.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return path


def refused(capsys, kind: str, paths: list[str], root: str, *options: str) -> str:
    """The command's one error line (it must exit 1, print no traceback and write nothing)."""
    capsys.readouterr()
    assert main(["import", kind, *paths, "--store", root, *options]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err and out.err.count("\n") == 1, out.err
    assert store_files(root) == []
    return out.err


# -- item 1: ids outside [-1, E) never wrap ----------------------------------------------------------

WRAPPED = 2**32 + 1  # stored as expert 1 once narrowed to int32


@pytest.mark.parametrize("dtype, value, expected", [
    (np.int64, WRAPPED, str(WRAPPED)), (np.uint64, WRAPPED, str(WRAPPED)),
    (np.uint32, 2**32 - 1, str(2**32 - 1)),  # became -1 and was dropped as "not computed"
    (np.int32, 8, "8"), (np.int16, -2, "-2"),
])
def test_npy_ids_outside_the_experts_are_refused_with_their_position(tmp_path, capsys, dtype, value, expected):
    ids = np.tile(np.array([[[0, 1]], [[2, 3]], [[4, 5]]]), (1, 2, 1)).astype(dtype)  # 3 tokens, 2 layers, top-2
    ids[2, 1, 0] = value
    path = str(tmp_path / "output.npy")
    np.save(path, ids)
    root = str(tmp_path / "store")
    with pytest.raises(SourceFormatError) as error:
        import_files("vllm", [path], root, num_experts=E)
    message = str(error.value)
    assert path in message and f"expert id {expected} at token row 2, layer 1, slot 0" in message
    assert store_files(root) == []
    assert "token row 2, layer 1, slot 0" in refused(capsys, "vllm", [path], root, "--num-experts", str(E))


def test_wrapped_id_in_vllm_json_and_megatron_trace_is_refused(tmp_path, capsys):
    prompt = [[[0, 1]], [[2, WRAPPED]], [[3, 4]]]
    path = write_json(tmp_path / "r.json", vllm_body(prompt))
    root = str(tmp_path / "store")
    with pytest.raises(SourceFormatError, match=f"expert id {WRAPPED} at token row 1, layer 0, slot 1"):
        import_files("vllm", [path], root, num_experts=E)
    trace = write_trace(tmp_path / "trace", trace_line(top_indices=[[0, 1], [WRAPPED, 3]]))
    with pytest.raises(SourceFormatError, match=f"line 1 top_indices: expert id {WRAPPED} at token row 1, slot 0"):
        import_files("megatron", [trace], root, num_experts=E)
    err = refused(capsys, "megatron", [trace], root, "--num-experts", str(E))
    assert "router_trace_rank0.jsonl line 1" in err and str(WRAPPED) in err
    # -1 means "not computed" in vLLM's arrays, but never in a trace
    minus = write_trace(tmp_path / "minus", trace_line(top_indices=[[0, 1], [-1, 3]]))
    assert "outside 0..7" in refused(capsys, "megatron", [minus], root, "--num-experts", str(E))


def test_ids_in_range_are_stored_as_given_with_unsigned_arrays(tmp_path):
    rng = np.random.default_rng(11)
    ids = np.stack([[rng.choice(E, 2, replace=False) for _ in range(2)] for _ in range(40)]).astype(np.uint32)
    path = str(tmp_path / "output.npy")
    np.save(path, ids)
    root = str(tmp_path / "store")
    summary = import_files("vllm", [path], root, num_experts=E)
    rows = [(0, layer, ids[t, layer].tolist()) for t in range(40) for layer in range(2)]
    assert stored_loads(root, summary.run_id) == loop_loads(rows, E)
    stored = {(r["layer"], r["position"], tuple(r["expert_ids"])) for r in parquet_rows(root, "routes").to_pylist()}
    assert stored == {(layer, t, tuple(ids[t, layer].tolist())) for t in range(40) for layer in range(2)}


# -- item 2 (the bound on experts) -----------------------------------------------------------------

def test_expert_counts_above_the_limit_are_refused_unless_raised(tmp_path, capsys):
    ids = np.array([[[0, 1]], [[2, 70_000]]], dtype=np.int64)
    path = str(tmp_path / "output.npy")
    np.save(path, ids)
    root = str(tmp_path / "store")
    with pytest.raises(SourceFormatError, match="expert id 70000"):
        import_files("vllm", [path], root)  # the largest id + 1 would be 70 001 experts
    err = refused(capsys, "vllm", [path], root)
    assert "expert id 70000 at token row 1, layer 0, slot 1" in err and "--max-experts limit 65536" in err
    assert "--max-experts" in refused(capsys, "vllm", [path], root, "--num-experts", "100000")
    assert main(["import", "vllm", path, "--store", root, "--max-experts", "100000"]) == 0
    layers = parquet_rows(root, "layers").to_pylist()
    assert [(r["layer"], r["num_experts"]) for r in layers] == [(0, 70_001)]
    loads = parquet_rows(root, "layer_steps").to_pylist()[0]["expert_load"]
    assert len(loads) == 70_001 and [i for i, n in enumerate(loads) if n] == [0, 1, 2, 70_000]


# -- item 3: the same file twice ------------------------------------------------------------------

def test_the_same_file_twice_is_refused_by_path_and_by_content(tmp_path, capsys):
    prompt = [[[0, 1]], [[2, 3]]]
    path = write_json(tmp_path / "a.json", vllm_body(prompt))
    root = str(tmp_path / "store")
    same = os.path.join(str(tmp_path), "sub", "..", "a.json")
    os.makedirs(tmp_path / "sub")
    for twice in ([path, path], [path, same]):
        with pytest.raises(ValueError, match="the same file"):
            import_files("vllm", twice, root)
        err = refused(capsys, "vllm", twice, root)
        assert f"{twice[0]} and {twice[1]} are the same file" in err
    copy = str(tmp_path / "copy.json")
    shutil.copy(path, copy)
    with pytest.raises(ValueError, match="hold the same bytes"):
        import_files("vllm", [path, copy], root)
    err = refused(capsys, "vllm", [path, copy], root)
    assert f"{path} and {copy} hold the same bytes" in err
    # a trace folder and one of its files; a CSV and its copy
    trace = write_trace(tmp_path / "trace", trace_line())
    assert "are the same file" in refused(capsys, "megatron", [str(tmp_path / "trace"), trace], root)
    csv = tmp_path / "x.csv"
    csv.write_text("layer_id,expert_id,count\n1,0,4\n1,3,4\n")
    shutil.copy(csv, tmp_path / "y.csv")
    assert "hold the same bytes" in refused(capsys, "sglang", [str(csv), str(tmp_path / "y.csv")], root,
                                            "--top-k", "2")
    # different files import, once each
    other = write_json(tmp_path / "b.json", vllm_body(prompt, rid="cmpl-1", created=1_700_000_001))
    assert main(["import", "vllm", path, other, "--store", root]) == 0
    assert len(parquet_rows(root, "steps").to_pylist()) == 2


def test_a_response_read_twice_within_a_file_is_refused(tmp_path, capsys):
    body = vllm_body([[[0, 1]], [[2, 3]]])
    path = tmp_path / "r.jsonl"
    other = vllm_body([[[0, 1]]], rid="cmpl-9")
    path.write_text("".join(json.dumps(b) + "\n" for b in (body, other, body)))
    with pytest.raises(SourceFormatError, match="appears again"):
        import_files("vllm", [str(path)], str(tmp_path / "store"))
    err = refused(capsys, "vllm", [str(path)], str(tmp_path / "store"))
    assert "r.jsonl line 3: response 'cmpl-0' appears again" in err


# -- item 4: one line naming the file and the field, never a traceback -----------------------------

def _hostile(tmp_path) -> list[tuple[str, list[str], list[str], str]]:
    """(kind, paths, options, what the line must say) per hostile input."""
    ok = [[[0, 1]], [[2, 3]]]
    cases = []

    def vllm(name: str, body, expected: str, raw: str | None = None):
        path = tmp_path / name
        path.write_text(raw if raw is not None else json.dumps(body))
        cases.append(("vllm", [str(path)], [], expected))

    vllm("created_big.json", vllm_body(ok, created=1e20), "created must be a Unix time")
    vllm("created_nan.json", None, "created must be a Unix time",
         raw=json.dumps(vllm_body(ok, created=0)).replace('"created": 0', '"created": NaN'))
    body = vllm_body(ok)
    body["choices"][0]["index"] = None
    vllm("index_null.json", body, "choices[].index must be an integer")
    vllm("usage_str.json", vllm_body(ok, prompt_token_ids=None, usage="x"), "usage must be an object")
    vllm("deep.json", None, "nested too deeply", raw='{"prompt_routed_experts": ' + "[" * 200_000 + "]" * 200_000 + "}")
    vllm("token_str.json", vllm_body(ok, prompt_token_ids=["a", "b"]), "prompt_token_ids must be a list of integer")
    csv = tmp_path / "counts.csv"
    csv.write_text("layer_id,expert_id,count\n1,0,4\n1,3," + "1" + "0" * 30 + "\n")
    cases.append(("sglang", [str(csv)], ["--top-k", "2"], "line 3: count 1000000000000000000000000000000 is outside"))
    folder = tmp_path / "stats"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": 2}))
    save_file({f"{10**20}_0": torch.ones(E, dtype=torch.int32)}, str(folder / "rank0.safetensors"))
    cases.append(("trtllm", [str(folder)], [], f"key '{10**20}_0': the iteration must be in"))
    for field in ("layer", "rank"):
        path = write_trace(tmp_path / f"trace_{field}", trace_line(**{field: 2**40}))
        cases.append(("megatron", [path], [], f"line 1: {field} must be an integer in 0..2147483647, got {2**40}"))
    path = write_trace(tmp_path / "trace_topk", trace_line(topk=-1, num_tokens=0, top_indices=[]))
    cases.append(("megatron", [path], [], "line 1: topk must be an integer in 1..2147483647, got -1"))
    dump = tmp_path / "expert_distribution_recorder_99999999999999999999.0.pt"
    torch.save(dict(rank=0, logical_count=torch.ones((1, 2, E), dtype=torch.int32)), str(dump))
    cases.append(("sglang", [str(dump)], ["--top-k", "2"], "the time in the file name"))
    stat = tmp_path / "expert_distribution_recorder_1700000000.0.pt"
    torch.save(dict(rank=2**40, logical_count=torch.ones((1, 2, E), dtype=torch.int32)), str(stat))
    cases.append(("sglang", [str(stat)], ["--top-k", "2"], f"rank {2**40} is outside 0..2147483647"))
    return cases


def test_hostile_values_give_one_line_naming_the_file_and_the_field(tmp_path, capsys):
    root = str(tmp_path / "store")
    for kind, paths, options, expected in _hostile(tmp_path):
        with pytest.raises(SourceFormatError) as error:
            import_files(kind, paths, root, top_k=int(options[1]) if options else None)
        name = os.path.basename(paths[0].rstrip("/"))
        assert name in str(error.value) and expected in str(error.value), (name, str(error.value))
        err = refused(capsys, kind, paths, root, *options)
        assert name in err and expected in err, err


# -- item 5: what the formats mean ----------------------------------------------------------------

def test_sglang_dumps_tag_each_step_with_the_hash_of_their_map(tmp_path):
    rng = np.random.default_rng(5)
    maps = [torch.tensor([[0, 1, 2, 3, 0, 1]] * 2, dtype=torch.int64),
            torch.tensor([[3, 2, 1, 0, 3, 2]] * 2, dtype=torch.int64)]  # a rebalance between the two dumps
    paths, expected = [], []
    for dump, mapping in enumerate(maps):
        physical = rng.integers(0, 6, (2, 5))
        count = torch.from_numpy(np.stack([np.bincount(row, minlength=6) for row in physical]).astype(np.int32))
        path = str(tmp_path / f"expert_distribution_recorder_{1700000000 + dump}.0_0.pt")
        torch.save(dict(records=[dict(forward_pass_id=dump, rank=0, gatherer_key="primary",
                                      global_physical_count=count)], last_physical_to_logical_map=mapping), path)
        paths.append(path)
        digest = hashlib.sha256(mapping.numpy().astype("<i8").tobytes()).hexdigest()[:12]
        logical = [[0] * 4 for _ in range(2)]
        for layer in range(2):
            for slot in physical[layer]:
                logical[layer][int(mapping[layer, slot])] += 1
        expected.append((dump, digest, logical))
    root = str(tmp_path / "store")
    summary = import_files("sglang", paths, root, top_k=1)
    rows = parquet_rows(root, "layer_steps", summary.run_id).to_pylist()
    got = {(r["step"], dict(r["tags"])["expert_map"]) for r in rows}
    assert got == {(dump, digest) for dump, digest, _ in expected}
    assert expected[0][1] != expected[1][1]
    for dump, _, logical in expected:
        assert [r["expert_load"] for r in sorted(rows, key=lambda r: r["layer"]) if r["step"] == dump] == logical


def test_megatron_stage_is_tagged_as_the_trace_stage(tmp_path):
    trace = write_trace(tmp_path / "trace", trace_line())
    root = str(tmp_path / "store")
    summary = import_files("megatron", [trace], root, num_experts=E)
    assert {tuple(r["tags"]) for r in parquet_rows(root, "steps", summary.run_id).to_pylist()} == {
        (("trace_stage", "pre_dispatch"),)}


def test_trtllm_slot_counts_are_refused_when_the_model_has_other_experts(tmp_path, capsys):
    folder = tmp_path / "stats"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": 10, "num_experts_per_token": 2}))
    save_file({"0_0": torch.ones(10, dtype=torch.int32)}, str(folder / "rank0.safetensors"))
    with pytest.raises(SourceFormatError, match="load balancer"):
        import_files("trtllm", [str(folder)], str(tmp_path / "store"), num_experts=E)
    err = refused(capsys, "trtllm", [str(folder)], str(tmp_path / "store"), "--num-experts", str(E))
    assert "meta_info.json" in err and "load balancer" in err and "10 physical expert slots" in err


def test_import_help_documents_the_formats(capsys):
    with pytest.raises(SystemExit):
        main(["import", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("base64 of little-endian int32", "shape (seq_len - 1, num_hidden_layers, top_k)",
                   "last_physical_to_logical_map", "expert_map=<hash>", "count physical slots, not experts",
                   "trace_stage=<stage>", "not a pipeline stage", "--max-experts", "same bytes"):
        assert phrase in text, phrase

"""`moescope mismatch` end to end: a STAND-IN engine's vLLM responses imported, the reference model
loaded from a saved folder, the rules judged and written, the replay exported and loaded back the
way docs/mismatch.md tells a training loop to. Expected values come from the stand-in's own
routing and the raw Parquet rows."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from moescope.cli import main
from moescope.ingest.importers import import_files
from tests.support.deltafiles import snapshot_rows
from tests.support.engine_standin import engine_standin, fed, sglang_responses, token_sequences, vllm_responses
from tests.support.jitter import near_tied_mixtral


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mismatch_cli")
    model = near_tied_mixtral()
    model.save_pretrained(folder / "model")
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    sequences = {key: fed(requests[key[0]][0], requests[key[0]][1][key[1]]) for key in keys}
    engine = dict(zip(keys, engine_standin(model, [sequences[key] for key in keys])))
    (folder / "vllm.jsonl").write_text(vllm_responses(requests, engine))
    (folder / "sglang.jsonl").write_text(sglang_responses(requests, engine))
    return folder, requests, keys, sequences, engine


def test_the_command_measures_judges_and_exports_for_replay(setup, tmp_path, capsys):
    folder, requests, keys, sequences, engine = setup
    store = str(tmp_path / "store")
    import_files("vllm", [str(folder / "vllm.jsonl")], store, run_id="engine")
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\ndefaults: {for: 0s, cooldown: 0s}\nrules:\n"
                     "  - name: AnyMismatch\n    expr: mismatch_decision_share > 0.01 and mismatch_pairs >= 10\n")
    assert main(["mismatch", store, "--run", "engine", "--model", str(folder / "model"), "--run-id", "mm",
                 "--rules", str(rules), "--export", str(tmp_path / "replay"), "--quiet"]) == 0
    out = capsys.readouterr().out
    rows = snapshot_rows(store, "mismatch").to_pandas()
    per_layer = rows[(rows.grouping == "all") & rows.layer.notna()]
    firing = sorted(int(r.layer) for r in per_layer.itertuples() if r.set_changed / r.pairs > 0.01 and r.pairs >= 10)
    assert firing  # the stand-in differs enough somewhere
    alerts = snapshot_rows(store, "alerts").to_pylist()
    assert sorted(a["layer"] for a in alerts) == firing
    assert all(a["run_id"] == "mm" and a["source"] == "mismatch" and a["state"] == "firing" for a in alerts)
    for layer in firing:
        assert f"ALERT AnyMismatch firing on layer {layer}" in out
    [whole] = rows[(rows.grouping == "all") & rows.layer.isna()].to_dict("records")
    assert f"{whole['tokens_set_changed'] / whole['tokens']:.2%} of {whole['tokens']:,} tokens" in out

    # the replay, loaded as docs/mismatch.md shows
    index = pq.read_table(tmp_path / "replay" / "replay.parquet").to_pylist()
    assert len(index) == len(keys)
    for row in index:
        key = (row["step"], row["sequence"])
        prompt = requests[key[0]][0]
        want = np.concatenate([engine[(key[0], 0)][:len(prompt)], engine[key][len(prompt):]])
        ids = np.load(tmp_path / "replay" / row["npy_file"])  # [tokens, layers, top_k]
        assert ids.dtype == np.int16
        np.testing.assert_array_equal(ids, want)
        flat = np.asarray(row["expert_ids"], dtype=np.int16).reshape(row["tokens"], row["layers"], row["top_k"])
        np.testing.assert_array_equal(flat, want)
        assert row["token_ids"] == sequences[key] and row["layer_ids"] == [0, 1]


def test_the_engines_routing_alone_and_sglang_ids_from_a_file(setup, tmp_path, capsys):
    folder, requests, keys, sequences, engine = setup
    store = str(tmp_path / "store")
    import_files("sglang", [str(folder / "sglang.jsonl")], store, run_id="sg", num_layers=2, top_k=2)
    assert main(["mismatch", store, "--run", "sg", "--export", str(tmp_path / "replay")]) == 1
    assert "--token-ids FILE" in capsys.readouterr().err
    ids_file = tmp_path / "sent.jsonl"
    ids_file.write_text("".join(json.dumps({"step": step, "sequence": 0, "token_ids": sequences[key]}) + "\n"
                                for step, key in enumerate(keys)))
    assert main(["mismatch", store, "--run", "sg", "--token-ids", str(ids_file), "--export", str(tmp_path / "replay"),
                 "--export-format", "npy"]) == 0
    for step, key in enumerate(keys):
        np.testing.assert_array_equal(np.load(tmp_path / "replay" / f"{step}-0-0.npy"), engine[key])
    assert not (tmp_path / "replay" / "replay.parquet").exists()
    assert main(["mismatch", store, "--run", "sg"]) == 1
    assert "give --model MODEL" in capsys.readouterr().err

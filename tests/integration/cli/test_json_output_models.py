"""`--format json` of the two commands that run a model, `jitter` (the shipped demo model) and `mismatch`
(a stand-in engine's vLLM responses against the model it stood in for): stdout is one JSON document
whose keys are exactly the documented ones, and its figures equal those of the Python API's report
(`moescope.analyses.jitter.jitter`, `moescope.analyses.mismatch.mismatch`) run on the same inputs."""

from __future__ import annotations

import json

import pytest

from moescope.analyses.jitter import LAYER_COLUMNS, MARGIN_EDGES, jitter
from moescope.analyses.jitter import TOKEN_COLUMNS as JITTER_TOKENS
from moescope.analyses.mismatch import GROUP_COLUMNS, TOKEN_COLUMNS, mismatch
from moescope.cli import main
from moescope.cli.routing_checks import load_model
from moescope.demo.data import DOMAINS, domain_texts, load_demo_model
from moescope.ingest.importers import import_files
from tests.support.engine_standin import engine_standin, fed, token_sequences, vllm_responses
from tests.support.jitter import near_tied_mixtral
from tests.support.json_documents import check_keys, same, same_rows


def one_document(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out[:500]
    doc = json.loads(out)
    check_keys(doc)
    return doc


def test_jitter(capsys):
    conditions = ["repeat", "dtype"]
    doc = one_document(capsys, ["jitter", "demo", "--texts", "1", "--condition", "repeat", "--condition", "dtype",
                                "--dtype", "bfloat16", "--quiet"])
    model, tokenizer = load_demo_model()
    texts = [text for domain in DOMAINS for text in domain_texts(domain, 1, seed=0)]
    report = jitter(model, texts, tokenizer=tokenizer, conditions=conditions, dtypes=("bfloat16",), max_tokens=128)
    assert (doc["model_class"], doc["inputs"], doc["run_id"]) == (report.model_class, len(texts), None)
    assert doc["margin_edges"] == list(MARGIN_EDGES)
    same_rows(doc["layers"], report.layers, LAYER_COLUMNS)
    assert sum(row["set_changed"] for row in doc["layers"]) > 0  # bfloat16 moves some of the demo's tokens
    same_rows(doc["tokens"], report.tokens, JITTER_TOKENS)
    assert doc["skipped"] == [dict(condition=c, reason=r) for c, r in report.skipped.items()]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mismatch_json")
    model = near_tied_mixtral()
    model.save_pretrained(folder / "model")
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    sequences = {key: fed(requests[key[0]][0], requests[key[0]][1][key[1]]) for key in keys}
    engine = dict(zip(keys, engine_standin(model, [sequences[key] for key in keys])))
    (folder / "vllm.jsonl").write_text(vllm_responses(requests, engine))
    store = str(folder / "store")
    import_files("vllm", [str(folder / "vllm.jsonl")], store, run_id="engine")
    return folder, store, model


def test_mismatch(engine_run, capsys, tmp_path):
    folder, store, _ = engine_run
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\ndefaults: {for: 0s, cooldown: 0s}\nrules:\n"
                     "  - name: AnyMismatch\n    expr: mismatch_decision_share > 0.01 and mismatch_pairs >= 10\n")
    doc = one_document(capsys, ["mismatch", store, "--run", "engine", "--model", str(folder / "model"), "--no-write",
                                "--rules", str(rules), "--export", str(tmp_path / "replay"), "--quiet"])
    reference, _, _ = load_model(str(folder / "model"))  # as the command loads it (sdpa, not the built model's)
    report = mismatch(reference, store=store, run="engine", write=False)
    assert (doc["engine_run"], doc["run_id"], doc["top_k"], doc["layers"]) == ("engine", None, report.top_k,
                                                                                report.layers)
    same(doc["decision_share"], report.decision_share)
    same(doc["token_share"], report.token_share)
    fractions = [c for c in report.groups.columns if c.endswith("_fraction")]
    same_rows(doc["groups"], report.groups, [*GROUP_COLUMNS, *fractions])
    same_rows(doc["tokens"], report.tokens, TOKEN_COLUMNS)
    per_layer = report.groups[(report.groups.grouping == "all") & report.groups.layer.notna()]
    firing = sorted(int(r.layer) for r in per_layer.itertuples() if r.set_changed / r.pairs > 0.01 and r.pairs >= 10)
    assert firing and [a["layer"] for a in doc["alerts"]] == firing
    assert all(a["alertname"] == "AnyMismatch" for a in doc["alerts"])
    assert doc["replay"] == {"sequences": len(report.replay), "layers": report.layers,
                             "folder": str(tmp_path / "replay")}
    trace = report.trace  # the model-based trace checks (issue 49) ride in the same document
    assert doc["trace"]["verdict"] == trace.verdict() and doc["trace"]["flips"] == trace.flips
    assert [(o["offset"], o["pairs"]) for o in doc["trace"]["offsets"]] == [(d, trace.pairs.get(d, 0))
                                                                            for d in sorted(trace.agreement)]
    same([o["agreement"] for o in doc["trace"]["offsets"]], [trace.agreement[d] for d in sorted(trace.agreement)])
    assert doc["gap"] is None and report.gap is None  # the stand-in's responses carry no log-probs


def test_mismatch_export_alone(engine_run, capsys, tmp_path):
    _, store, _ = engine_run
    assert main(["mismatch", store, "--run", "engine", "--export", str(tmp_path / "replay"), "--export-format", "npy",
                 "--format", "json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert "written to" in captured.err
    assert doc["engine_run"] == "engine" and doc["groups"] == [] and doc["decision_share"] is None
    assert doc["replay"]["sequences"] == len(list((tmp_path / "replay").glob("*.npy")))

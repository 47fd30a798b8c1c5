"""`moescope import` on files larger than a chunk (issue 23, item 2): read in pieces, loads and
co-selection summed over them exactly, routes written in parts, memory following a piece rather
than the file, and progress on stderr for passes that take a while.

Expected values are counted by plain loops over the arrays the tests wrote; stored rows are read
from the raw Parquet files.
"""

from __future__ import annotations

import base64
import glob
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moescope.cli import main
from moescope.ingest.importers import SourceFormatError, import_files, responses, rows, tables
from tests.support.fixtures.store import REPO
from tests.support.importing import loop_coselection, loop_loads, parquet_rows, store_files, stored_loads

E, L, K = 6, 3, 2


def draw(rng: np.random.Generator, n: int) -> np.ndarray:
    ids = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(n)]).astype(np.int16)
    ids[rng.random(n) < 0.2] = -1  # prefix-cache hits: not computed
    return ids


def test_a_long_array_read_in_pieces_sums_to_a_loop_over_it(tmp_path, monkeypatch):
    monkeypatch.setattr(responses, "CHUNK_ROWS", 7)
    monkeypatch.setattr(rows, "ROUTE_ROWS_PER_PART", 20)
    ids = draw(np.random.default_rng(1), 50)
    path = str(tmp_path / "output.npy")
    np.save(path, ids)
    root = str(tmp_path / "store")
    summary = import_files("vllm", [path], root, num_experts=E)
    computed = [(0, layer, ids[t, layer].tolist()) for t in range(50) for layer in range(L) if ids[t, layer, 0] >= 0]
    assert (summary.steps, summary.routes) == (1, len(computed))
    assert sum(summary.notes.values()) == int((ids[:, 0, 0] < 0).sum())  # counted once, not once per pass
    assert stored_loads(root, summary.run_id) == loop_loads(computed, E)
    layer_steps = parquet_rows(root, "layer_steps", summary.run_id).to_pylist()
    for row in layer_steps:
        np.testing.assert_array_equal(np.array(row["coselection"]).reshape(E, E),
                                      loop_coselection(computed, row["layer"], E))
        assert row["tokens"] == sum(1 for _, layer, _ in computed if layer == row["layer"])
    stored = {(r["layer"], r["token"], r["position"], tuple(r["expert_ids"]))
              for r in parquet_rows(root, "routes", summary.run_id).to_pylist()}
    assert stored == {(layer, t, t, tuple(ids[t, layer].tolist())) for t in range(50) for layer in range(L)
                      if ids[t, layer, 0] >= 0}
    # a part is written once 20 rows are waiting, so none holds more than 20 + one piece (7 rows x L)
    assert len(glob.glob(os.path.join(root, "routes", "*", "part-*.parquet"))) >= len(computed) // (20 + 7 * L)
    steps = parquet_rows(root, "steps", summary.run_id).to_pylist()
    assert [(s["tokens"], s["seq_len"], s["batch_size"]) for s in steps] == [
        (int((ids[:, 0, 0] >= 0).sum()), int(np.flatnonzero(ids[:, 0, 0] >= 0).max()) + 1, 1)]


def test_an_id_in_a_later_piece_is_named_by_its_row_in_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(responses, "CHUNK_ROWS", 7)
    ids = draw(np.random.default_rng(2), 50).astype(np.int64)
    ids[45] = [[0, 1]] * L
    ids[45, 2, 1] = 2**32 + 1
    path = str(tmp_path / "output.npy")
    np.save(path, ids)
    root = str(tmp_path / "store")
    with pytest.raises(SourceFormatError, match=f"expert id {2**32 + 1} at token row 45, layer 2, slot 1"):
        import_files("vllm", [path], root, num_experts=E)
    assert store_files(root) == []


# VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's at the fork (this test's arrays)
CHILD = """
import sys
from moescope.ingest.importers import import_files, rows
rows.ROUTE_ROWS_PER_PART = 65536  # parts of one chunk's routes
import_files("vllm", [sys.argv[1]], sys.argv[2], num_experts=128)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def _peak_kib(path: str, root: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD, path, root], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def _responses(path: str, rng: np.random.Generator, requests: int, rows_each: int = 5000) -> None:
    """JSON Lines of vLLM responses, each a prompt of `rows_each` tokens x 4 layers x top-8 of 128
    experts as base64 of an int16 .npy, as vLLM returns it."""
    with open(path, "w") as f:
        for r in range(requests):
            scores = rng.random((rows_each, 4, 128), dtype=np.float32)
            buffer = io.BytesIO()
            np.save(buffer, np.argpartition(scores, 8, axis=2)[:, :, :8].astype(np.int16))
            f.write(json.dumps({"id": f"cmpl-{r}", "created": 1_700_000_000 + r, "prompt_token_ids": list(range(
                rows_each)), "prompt_routed_experts": base64.b64encode(buffer.getvalue()).decode()}) + "\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from /proc (Linux)")
def test_memory_follows_a_piece_not_the_file(tmp_path):
    """Four times the responses (100 000 -> 400 000 token rows, 12 -> 49 MiB of JSON Lines) may
    not cost more than a piece's worth of memory: a part of routes is 65 536 rows."""
    rng = np.random.default_rng(3)
    peaks = []
    for requests in (20, 80):
        path = str(tmp_path / f"responses{requests}.jsonl")
        _responses(path, rng, requests)
        peaks.append(_peak_kib(path, str(tmp_path / f"store{requests}")))
    grown_mib = (peaks[1] - peaks[0]) / 1024
    assert grown_mib < 24, f"peak grew by {grown_mib:.0f} MiB from 100 000 to 400 000 rows ({peaks} KiB)"
    assert parquet_rows(str(tmp_path / "store80"), "routes").num_rows == 400_000 * 4


def test_progress_shows_on_stderr_when_a_pass_takes_a_while(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tables, "PROGRESS_DELAY_S", 0)
    path = str(tmp_path / "output.npy")
    np.save(path, draw(np.random.default_rng(4), 30))
    assert main(["import", "vllm", path, "--store", str(tmp_path / "store")]) == 0
    err = capsys.readouterr().err
    assert f"checking {path}" in err and f"writing {path}" in err and "rows" in err
    monkeypatch.setattr(tables, "PROGRESS_DELAY_S", 3.0)
    assert main(["import", "vllm", path, "--store", str(tmp_path / "store2")]) == 0
    assert capsys.readouterr().err == ""  # a quick import stays quiet


def test_the_benchmark_runs_and_reports_its_figures(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "importers.py"), "--rows", "3000",
                           "--layers", "4", "--requests", "10", "--root", str(tmp_path / "bench")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "12,000 route rows, 10 steps" in done.stdout and "peak RSS" in done.stdout
    assert not os.path.exists(tmp_path / "bench")  # removed unless --keep
    json.dumps(done.stdout)


def _as_list_document(jsonl: str, path: str) -> None:
    """The same responses as one JSON document, a list (how `json.dump(responses, f)` saves them)."""
    with open(jsonl) as src, open(path, "w") as dst:
        dst.write("[\n" + ",\n".join(line.strip() for line in src if line.strip()) + "\n]\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from /proc (Linux)")
def test_a_list_document_is_read_an_item_at_a_time(tmp_path):
    """A vLLM capture saved as one JSON list (not JSON Lines) was read whole: four times the
    responses may cost no more than a piece's worth of memory, as for JSON Lines."""
    rng = np.random.default_rng(5)
    peaks = []
    for requests in (20, 80):
        lines = str(tmp_path / f"responses{requests}.jsonl")
        _responses(lines, rng, requests)
        path = str(tmp_path / f"responses{requests}.json")
        _as_list_document(lines, path)
        peaks.append(_peak_kib(path, str(tmp_path / f"store{requests}")))
    grown_mib = (peaks[1] - peaks[0]) / 1024
    assert grown_mib < 24, f"peak grew by {grown_mib:.0f} MiB from 100 000 to 400 000 rows ({peaks} KiB)"
    assert parquet_rows(str(tmp_path / "store80"), "routes").num_rows == 400_000 * 4


@pytest.mark.parametrize("read_chars", [7, 64, 1 << 20])
def test_a_list_document_stores_what_its_json_lines_store(tmp_path, monkeypatch, read_chars):
    """Items cut at any buffer boundary (7 characters, 64, a MiB) decode to the same responses: the
    stored routes equal those of the same responses as JSON Lines, row for row."""
    from moescope.ingest.importers import vllm

    rng = np.random.default_rng(6)
    lines = str(tmp_path / "r.jsonl")
    _responses(lines, rng, 3, rows_each=40)
    document = str(tmp_path / "r.json")
    _as_list_document(lines, document)
    monkeypatch.setattr(vllm, "READ_CHARS", read_chars)
    runs = [import_files("vllm", [path], str(tmp_path / name), num_experts=128).run_id
            for path, name in ((lines, "a"), (document, "b"))]

    def routes(name: str, run: str) -> list:
        table = parquet_rows(str(tmp_path / name), "routes", run)
        return sorted(zip(table.column("step").to_pylist(), table.column("layer").to_pylist(),
                          table.column("token").to_pylist(), table.column("expert_ids").to_pylist()))

    assert routes("a", runs[0]) == routes("b", runs[1]) and len(routes("a", runs[0])) == 3 * 40 * 4


@pytest.mark.parametrize("text,says", [
    ("[", "without its ']'"),
    ('[{"id": "a"}', "without its ']'"),
    ('[{"id": "a"} {"id": "b"}]', "not ',' or ']'"),
    ('[{"id": "a"}, ]', "item 1 of the JSON list is not valid JSON"),
    ('[{"id": "a"}] trailing', "text after the JSON list"),
    ('[{"id": "a", "x": [1, 2', "item 0 of the JSON list is not valid JSON"),
    ("[" + "[" * 200_000 + "]" * 200_000 + "]", "nested too deeply"),
])
def test_a_broken_list_document_is_one_line_naming_the_file(tmp_path, text, says):
    from moescope.ingest.importers import SourceFormatError

    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(SourceFormatError, match=says) as raised:
        import_files("vllm", [str(path)], str(tmp_path / "store"), num_experts=8)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "store").exists() or parquet_rows(str(tmp_path / "store"), "routes").num_rows == 0

"""The sampled tokens' log-probs, read by the importers from the responses vLLM and SGLang return:
vLLM completions (`logprobs.token_logprobs`, with and without echo), chat (`logprobs.content`), a
stream's chunks joined, vLLM's −9999 clamp read as not measured, SGLang's `output_token_logprobs`;
checked against the raw `engine_logprobs` Parquet rows, and refused in shapes the engines never send."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moescope.ingest.importers import import_files
from moescope.ingest.importers.tables import SourceFormatError
from tests.support.deltafiles import snapshot_rows

PROMPT, GENERATED = [5, 6, 7], [8, 9, 10]


def _routing(rows: int) -> list:
    return np.tile([0, 1], (rows, 2, 1)).tolist()  # 2 layers, top-2, distinct ids


def _vllm(logprobs, **extra) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1_700_000_000, "model": "m",
            "prompt_token_ids": PROMPT, "prompt_routed_experts": _routing(3),
            "choices": [{"index": 0, "text": "", "token_ids": GENERATED, "routed_experts": _routing(2),
                         "logprobs": logprobs, **extra}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3}}


def _rows(tmp_path, kind: str, bodies: list[dict], **options) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    root = str(tmp_path / "store")
    import_files(kind, [str(path)], root, run_id="engine", **options)
    rows = snapshot_rows(root, "engine_logprobs").to_pylist()
    return sorted(((r["sequence"], r["position"], r["token_id"], r["logprob"]) for r in rows))


def _same(rows, expected):
    assert [r[:3] for r in rows] == [e[:3] for e in expected]
    for r, e in zip(rows, expected):
        assert (r[3] is None and e[3] is None) or r[3] == pytest.approx(e[3], abs=0)


def test_vllm_completion_logprobs_sit_at_the_sampled_tokens_positions(tmp_path):
    body = _vllm({"token_logprobs": [-0.5, -1.25, -9999.0], "tokens": ["a", "b", "c"], "text_offset": [0, 1, 2],
                  "top_logprobs": None})
    # position 3 is the first generated token (the prompt holds 3); -9999.0 is vLLM's clamp: not measured
    _same(_rows(tmp_path, "vllm", [body]), [(0, 3, 8, -0.5), (0, 4, 9, -1.25), (0, 5, 10, None)])


def test_vllm_echo_chat_and_streams(tmp_path):
    echo = _vllm({"token_logprobs": [None, -0.1, -0.2, -0.3, -0.4, -0.5]})  # echo: the prompt's first
    _same(_rows(tmp_path / "echo", "vllm", [echo]), [(0, 3, 8, -0.3), (0, 4, 9, -0.4), (0, 5, 10, -0.5)])
    chat = _vllm({"content": [{"token": "a", "logprob": -0.7, "bytes": [97], "top_logprobs": []},
                              {"token": "b", "logprob": -0.8, "bytes": [98], "top_logprobs": []},
                              {"token": "c", "logprob": -0.9, "bytes": [99], "top_logprobs": []}]})
    _same(_rows(tmp_path / "chat", "vllm", [chat]), [(0, 3, 8, -0.7), (0, 4, 9, -0.8), (0, 5, 10, -0.9)])
    first = _vllm({"token_logprobs": [-0.1, -0.2]})
    first["choices"][0].update(token_ids=GENERATED[:2], routed_experts=_routing(2))
    second = {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "token_ids": GENERATED[2:], "routed_experts": [],
                                           "logprobs": {"token_logprobs": [-0.3]}}]}
    _same(_rows(tmp_path / "stream", "vllm", [first, second]), [(0, 3, 8, -0.1), (0, 4, 9, -0.2), (0, 5, 10, -0.3)])


def test_sglang_output_token_logprobs(tmp_path):
    ids = np.tile(np.array([0, 1], "<i4"), (5, 2, 1))
    body = {"text": "", "output_ids": GENERATED, "meta_info": {
        "id": "r", "prompt_tokens": 3, "completion_tokens": 3,
        "routed_experts": base64.b64encode(ids.tobytes()).decode(),
        "output_token_logprobs": [[-0.25, 8, None], [-0.5, 9, None], [-999999999.0, 10, None]]}}
    _same(_rows(tmp_path, "sglang", [body], num_layers=2, top_k=2),
          [(0, 3, 8, -0.25), (0, 4, 9, -0.5), (0, 5, 10, None)])  # SGLang's -inf clamp: not measured


@pytest.mark.parametrize("logprobs, message", [
    ({"token_logprobs": [-0.5, -1.0]}, "2 log-probs for 3 generated tokens"),
    ({"token_logprobs": [-0.5, 0.5, -1.0]}, "not a log-probability"),
    ({"token_logprobs": [-0.5, "x", -1.0]}, "must hold numbers"),
    ({"content": "x"}, "must be a list of objects"),
    ("x", "must be an object"),
])
def test_vllm_logprobs_in_other_shapes_are_refused(tmp_path, logprobs, message):
    with pytest.raises(SourceFormatError, match=message):
        _rows(tmp_path, "vllm", [_vllm(logprobs)])

"""Issue 33, part 2: the routing jitter the demo prints is stored in the run it names, the one the
dashboard opens, so the Routing jitter page shows it. Read from the raw Parquet files the Delta log
lists (tests/support/deltafiles.py), not through the store's queries."""

from __future__ import annotations

import re

from moescope.demo.data import DOMAINS, domain_texts, load_demo_model
from moescope.demo.rollout import ROLLOUT_SUFFIXES
from tests.support.deltafiles import snapshot_rows


def _named_run(out: str) -> str:
    """The run id the demo's summary names ("run <id>: <model class>, ...")."""
    return re.search(r"^run (\S+): ", out, re.MULTILINE).group(1)


def test_the_printed_jitter_is_stored_in_the_run_the_dashboard_opens(demo):
    root, out, summary = demo
    run_id = _named_run(out)
    runs = snapshot_rows(root, "runs").to_pandas()
    runs = runs[~runs.run_id.str.endswith(ROLLOUT_SUFFIXES)]  # the rollout's runs: moescope.demo.rollout
    assert runs.run_id.tolist() == [run_id]  # one run, one row: the check added no run of its own
    assert runs.source.iloc[0] in (None, "probe")
    layers = snapshot_rows(root, "layers").to_pandas()
    assert len(layers[layers.run_id == run_id]) == 4  # the run's layers, not written twice

    jitter = snapshot_rows(root, "jitter").to_pandas()
    assert set(jitter.run_id) == {run_id}
    conditions = list(dict.fromkeys(jitter.sort_values("condition_order").condition))
    assert conditions[0] == "repeat" and conditions[1].startswith("batch=") and conditions[2] == "bfloat16"
    assert sorted(jitter.layer.unique()) == [0, 1, 2, 3]
    # every (token, layer) pair of the demo's jitter inputs, compared once per condition and layer:
    # two held-out texts per domain (seed 0), cut to 400 characters, tokenized, cut to 128 tokens
    _, tokenizer = load_demo_model()
    texts = [domain_texts(d, 64, seed=0, max_chars=600)[i][:400] for d in DOMAINS for i in range(2)]
    tokens = sum(min(128, len(tokenizer(text)["input_ids"])) for text in texts)
    assert set(jitter.tokens) == {tokens}
    # the printed shares are the stored rows' (tokens whose expert set changed, over every layer)
    for condition in conditions:
        rows = jitter[jitter.condition == condition]
        assert f"{condition} {rows.set_changed.sum() / rows.tokens.sum():.2%}" in summary["jitter"]

    listed = snapshot_rows(root, "jitter_tokens").to_pandas()
    assert set(listed.run_id) <= {run_id}
    for (condition, layer), rows in jitter.groupby(["condition", "layer"]):
        assert len(listed[(listed.condition == condition) & (listed.layer == layer)]) == int(rows.listed.sum())
    assert int(jitter.listed.sum()) > 0, "batched and bfloat16 flip some tokens of the demo model"

"""`moescope whatif cache` on routes the probe recorded from a real LongCat-Flash (zero experts
included), checked against a brute-force replay of the raw Parquet rows."""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from moescope import probe
from moescope.analyses.expert_cache import cache_report
from moescope.cli import main, whatif
from moescope.metrics.expert_cache import POLICIES
from moescope.store import Store
from moescope.store.writer import ParquetExporter
from tests.support.cache_oracle import brute_force_hits
from tests.support.zoo import tiny_model

ROUTED_EXPERTS = 8  # the zoo's LongCat: 8 routed experts and 2 zero experts per layer


def _record(root: str, routes: bool = True) -> str:
    model = tiny_model("longcat_flash")
    generator = torch.Generator().manual_seed(0)
    session = probe.attach(model, exporters=[ParquetExporter(root)], routes=routes, window=1)
    try:
        for step in range(4):
            with session.tag(domain="ab"[step % 2]), torch.no_grad():
                model(torch.randint(1, 128, (2, 12), generator=generator))
    finally:
        session.close()
    return session.run.run_id


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[str, str]:
    root = str(tmp_path_factory.mktemp("whatif") / "store")
    return root, _record(root)


def _raw_accesses(root: str, run_id: str, layer: int, domain: str | None) -> list[list[int]]:
    """Each token's accesses from the raw routes rows, in (step, rank, token) order, by a plain loop."""
    rows = []
    for path in glob.glob(os.path.join(root, "routes", f"run_id={run_id}", "part-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            if row["layer"] == layer and (domain is None or dict(row["tags"])["domain"] == domain):
                rows.append(row)
    rows.sort(key=lambda r: (r["step"], r["rank"], r["token"]))
    accesses = []
    for row in rows:
        chosen: list[int] = []
        for expert, kept in zip(row["expert_ids"], row["kept"]):
            if kept and expert < ROUTED_EXPERTS and expert not in chosen:
                chosen.append(expert)
        accesses.append(chosen)
    return accesses


@pytest.mark.parametrize("domain", [None, "b"])
def test_report_equals_a_brute_force_replay_of_the_raw_rows(recorded, domain):
    root, run_id = recorded
    tags = {"domain": domain} if domain else None
    with Store(root) as store:
        report = cache_report(store, run_id, tags=tags)
    assert sorted(report.layer.unique()) == [0, 1] and set(report.policy) == set(POLICIES)
    zero_expert_slots = 0
    for layer in (0, 1):
        accesses = _raw_accesses(root, run_id, layer, domain)
        zero_expert_slots += 2 * len(accesses) - sum(len(a) for a in accesses)
        for policy in POLICIES:
            curve = report[(report.layer == layer) & (report.policy == policy)].sort_values("capacity")
            assert curve.capacity.tolist() == list(range(1, ROUTED_EXPERTS + 1))
            want = [brute_force_hits(accesses, c, policy) for c in range(1, ROUTED_EXPERTS + 1)]
            assert curve.hits.tolist() == want, (layer, policy)
            total = sum(len(a) for a in accesses)
            assert (curve.accesses == total).all() and (curve.tokens == sum(bool(a) for a in accesses)).all()
            np.testing.assert_allclose(curve.hit_rate, np.array(want) / total)
            assert not curve.truncated.any()
    assert zero_expert_slots > 0  # the zero experts were chosen, and are no access


def test_max_tokens_replays_the_first_tokens_only(recorded):
    root, run_id = recorded
    with Store(root) as store:
        report = cache_report(store, run_id, layer=1, policies=["lru"], max_tokens=30)
        with pytest.raises(ValueError, match="no MoE layer 7"):
            cache_report(store, run_id, layer=7)
    accesses = _raw_accesses(root, run_id, 1, None)[:30]
    assert report.truncated.all()
    assert report.hits.tolist() == [brute_force_hits(accesses, c, "lru") for c in range(1, ROUTED_EXPERTS + 1)]


def test_cli_prints_the_curves(recorded, capsys, tmp_path):
    root, run_id = recorded
    with Store(root) as store:
        report = cache_report(store, run_id, layer=0, tags={"domain": "a"})
    assert main(["whatif", "cache", root, "--layer", "0", "--tag", "domain=a"]) == 0
    out = capsys.readouterr().out
    assert f"run {run_id}, tags domain=a" in out and "layer 0:" in out and "layer 1:" not in out
    for capacity in (1, 4, 8):
        rates = report[report.capacity == capacity].set_index("policy").hit_rate
        assert f"{capacity:>4}  " + "  ".join(f"{100 * rates[p]:>6.1f}%" for p in POLICIES) in out
    plot = tmp_path / "cache.png"
    code = main(["whatif", "cache", root, "--plot", str(plot)])
    captured = capsys.readouterr()
    if whatif.plot_backend() is None:
        assert code == 1 and 'pip install "moescope[plot]"' in captured.err and not plot.exists()
    else:
        assert code == 0 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # argparse refuses a policy it does not know
        main(["whatif", "cache", root, "--policy", "fifo"])


def test_plot_with_matplotlib(recorded, tmp_path):
    pytest.importorskip("matplotlib")
    root, run_id = recorded
    with Store(root) as store:
        report = cache_report(store, run_id)
    assert whatif.write_plot(report, tmp_path / "c.png") == "matplotlib"
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_routes_says_how_to_record_them(tmp_path, capsys):
    root = str(tmp_path / "store")
    run_id = _record(root, routes=False)
    assert main(["whatif", "cache", root]) == 0
    out = capsys.readouterr().out
    assert f"run {run_id}: no routes recorded" in out and "routes=True" in out


def test_a_run_that_does_not_exist_says_so(recorded, capsys):
    root, run_id = recorded
    assert main(["whatif", "cache", root, "--run", "no-such-run"]) == 1
    captured = capsys.readouterr()
    assert "no routes recorded" not in captured.out
    assert captured.err.strip().count("\n") == 0  # one line
    assert captured.err.startswith("moescope whatif: run 'no-such-run' is not in the store")
    assert f"its latest run is {run_id!r}" in captured.err
    with Store(root) as store, pytest.raises(ValueError, match="not in the store"):
        cache_report(store, "no-such-run")


def test_capacity_replays_the_sizes_asked_for(recorded, capsys):
    root, run_id = recorded
    assert main(["whatif", "cache", root, "--layer", "1", "--capacity", "8,2", "--capacity", "5",
                 "--capacity", "12"]) == 0
    out = capsys.readouterr().out
    accesses = _raw_accesses(root, run_id, 1, None)
    total = sum(len(a) for a in accesses)
    printed = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in printed] == [2, 5, 8, 12]  # 12 > E: all 8 routed experts resident
    for row in printed:
        capacity = min(int(row[0]), ROUTED_EXPERTS)
        want = [f"{100 * brute_force_hits(accesses, capacity, p) / total:.1f}%" for p in POLICIES]
        assert row[1:] == want, row
    with Store(root) as store:
        report = cache_report(store, run_id, layer=0, capacities=[3], policies=["belady"])
    assert report.capacity.tolist() == [3]
    assert report.hits.tolist() == [brute_force_hits(_raw_accesses(root, run_id, 0, None), 3, "belady")]


@pytest.mark.parametrize("given", ["0", "4,x", "2.5", ""])
def test_a_bad_capacity_gets_one_line(recorded, capsys, given):
    root, _ = recorded
    assert main(["whatif", "cache", root, "--capacity", given]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moescope whatif: --capacity takes whole numbers of at least 1") and err.count("\n") == 1


def test_a_layer_with_more_experts_than_the_bound_is_refused(recorded, capsys):
    root, run_id = recorded
    assert main(["whatif", "cache", root, "--max-experts", "4"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert (f"layer 0 of run {run_id!r} has 8 routed experts, more than the cache replay takes (4;"
            in captured.err) and "--max-experts" in captured.err
    assert main(["whatif", "cache", root, "--layer", "1", "--max-experts", "8", "--capacity", "1"]) == 0


def test_an_html_plot_needs_nothing_but_the_dependencies(recorded, tmp_path, capsys, monkeypatch):
    """Issue 24: the README's `--plot cache.png` failed on a default install (matplotlib is not a
    dependency). An .html plot is drawn with plotly, which is; a PNG without matplotlib names the extra.
    Both checked with matplotlib and kaleido hidden, as on a default install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "kaleido") else real(name, *a))
    root, run_id = recorded
    page = tmp_path / "cache.html"
    assert main(["whatif", "cache", root, "--plot", str(page)]) == 0
    html = page.read_text()
    assert "<html" in html.lower() and "plotly" in html.lower()
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js is inside: the page opens offline
    assert all(f'"name":"layer 0 {policy}"' in html for policy in POLICIES)  # a line per layer and policy
    png = tmp_path / "cache.png"
    assert main(["whatif", "cache", root, "--plot", str(png)]) == 1
    err = capsys.readouterr().err
    assert 'pip install "moescope[plot]"' in err and "cache.html" in err and not png.exists()

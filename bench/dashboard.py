"""Dashboard page render time over a large store.

Builds a synthetic store in the real schema (vectorised with numpy/pyarrow, built with the store's
table builder and written by the run's writer, a part per table and chunk of steps): `--rows` route rows
(default 50 M) over `--layers` MoE layers of `--experts` experts with top-2 routing skewed towards
a few experts, the matching per-step
reductions (expert loads are the bincount of the routes, co-selection included), tags, and a
sample of router inputs. Then runs every page through Streamlit's AppTest `--repeats` times and
prints the p50 and max render time per page:

- cold: query caches cleared before each run (a new question: every query hits DuckDB);
- warm: the same page again with the caches in place (what a rerun after a click costs).

The cluster page is timed with its UMAP embedding already cached (the embedding is computed
once per sample; its first computation is reported separately).

    python bench/dashboard.py                     # 50 M route rows
    python bench/dashboard.py --rows 5000000 --store /tmp/bench-store --keep

`--first-render STORE` times instead what a user waits for in a browser: a fresh `moescope dashboard
STORE` (with an empty embedding cache; with `--cold-numba` an empty numba cache too, as on a fresh
install) opened in headless Chromium, each page visited once in the navigation's order, from asking
for the page to its first render (title shown, script run over, every chart drawn); the Semantic
clusters page's UMAP scatter, computed off the page's run, is timed apart until it is drawn, and so is the
Placement page's traffic section, computed on the run after its first render. Repeated
`--repeats` times with a new server each time; prints the median and the largest per page.

    python bench/dashboard.py --first-render runs/demo --repeats 3 [--cold-numba]
    python bench/dashboard.py --first-render STORE --repeats 3 --pages placement   # one page, first on its server
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

from moescope.store.schema import TAGS, table_from_columns
from moescope.store.writer import run_writer

RUN_ID = "bench-run"
DOMAINS = ("code", "prose", "math")
PAGES = ("views/overview.py", "views/heatmaps.py", "views/clusters.py", "views/drift.py", "views/health.py",
         "views/compare.py")


def _lists(values: np.ndarray, width: int, type_: pa.DataType) -> pa.Array:
    rows = len(values) // width
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32), pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=type_))


def _tags(domains: np.ndarray) -> pa.Array:
    """A map column {"domain": d, "router": "A"} per row, built without a Python loop."""
    n = len(domains)
    keys = np.empty(2 * n, dtype=object)
    keys[0::2], keys[1::2] = "domain", "router"
    items = np.empty(2 * n, dtype=object)
    items[0::2], items[1::2] = np.asarray(DOMAINS, dtype=object)[domains], "A"
    offsets = pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32), pa.int32())
    return pa.MapArray.from_arrays(offsets, pa.array(keys, pa.string()), pa.array(items, pa.string()), type=TAGS)


def _table(name: str, columns: dict[str, pa.Array]) -> pa.Table:
    return table_from_columns(name, columns, len(next(iter(columns.values()))))


def build_store(root: str, rows: int, layers: int, experts: int, tokens_per_step: int, seed: int = 0) -> dict:
    """Write the synthetic store; returns what was written. Raises OSError if the disk refused a part."""
    with run_writer(root, RUN_ID) as writer:
        def write(table: str, data) -> None:
            if not writer.write(table, data):
                raise OSError(f"the store {root!r} did not take a part of {table}: {writer.last_error}")

        return _build(write, rows, layers, experts, tokens_per_step, seed)


def _build(write, rows: int, layers: int, experts: int, tokens_per_step: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    top_k, seq_len, hidden = 2, 256, 64
    steps = max(1, rows // (layers * tokens_per_step))
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    params_per_expert, shared = 1_000_000, 50_000_000
    total = shared + layers * experts * params_per_expert
    write("runs", [{
        "run_id": RUN_ID, "started_at": start, "model_class": "SyntheticMoE", "total_params": total,
        "routed_expert_params": layers * experts * params_per_expert, "tags": [("router", "A")], "rank": 0,
        "world_size": 1}])
    write("layers", [{
        "run_id": RUN_ID, "layer": i, "module": f"model.layers.{i}.mlp", "family": "mixtral", "num_experts": experts,
        "zero_experts": 0, "top_k": top_k, "params_per_expert": params_per_expert, "expert_capacity": None, "rank": 0}
        for i in range(layers)])
    popularity = 1.0 / np.sqrt(np.arange(1, experts + 1))
    popularity /= popularity.sum()
    chunk = max(1, 2_000_000 // (layers * tokens_per_step))  # steps per routes file: ~2 M rows
    written = 0
    for first in range(0, steps, chunk):
        n_steps = min(chunk, steps - first)
        step_ids = np.arange(first, first + n_steps, dtype=np.int64)
        ts = np.datetime64("2026-01-01T00:00:00", "us") + step_ids.astype("timedelta64[s]")
        domain = (step_ids % len(DOMAINS)).astype(np.int64)
        n = n_steps * layers * tokens_per_step
        step_of = np.repeat(step_ids, layers * tokens_per_step)
        layer_of = np.tile(np.repeat(np.arange(layers, dtype=np.int32), tokens_per_step), n_steps)
        token = np.tile(np.arange(tokens_per_step, dtype=np.int32), n_steps * layers)
        # Layer- and domain-dependent skew: a rotation of the popularity per layer and domain.
        shift = (layer_of.astype(np.int64) * 3 + np.repeat(domain, layers * tokens_per_step) * 5) % experts
        first_choice = (rng.choice(experts, size=n, p=popularity) + shift) % experts
        second_choice = (first_choice + 1 + rng.integers(0, experts - 1, size=n)) % experts
        ids = np.stack([first_choice, second_choice], axis=1).astype(np.int32).reshape(-1)
        weights = rng.uniform(0.5, 0.9, size=n).astype(np.float32)
        gate = np.stack([weights, 1 - weights], axis=1).reshape(-1)
        routes = _table("routes", {
            "run_id": pa.array(np.full(n, RUN_ID, dtype=object), pa.string()), "step": pa.array(step_of),
            "layer": pa.array(layer_of), "token": pa.array(token), "sequence": pa.array(token // seq_len),
            "position": pa.array(token % seq_len), "token_id": pa.array(rng.integers(0, 32000, size=n)),
            "expert_ids": _lists(ids, top_k, pa.int32()), "gate_weights": _lists(gate, top_k, pa.float32()),
            "kept": _lists(np.ones(n * top_k, dtype=bool), top_k, pa.bool_()),
            "tags": _tags(np.repeat(domain, layers * tokens_per_step)), "rank": pa.array(np.zeros(n, np.int32)),
        })
        write("routes", routes)
        written += n
        # Per (step, layer): the load is the bincount of the routes, co-selection the pair counts.
        group = ((step_of - first) * layers + layer_of).astype(np.int64)
        groups = n_steps * layers
        load = np.bincount(np.repeat(group, top_k) * experts + ids, minlength=groups * experts).reshape(groups, experts)
        pair = np.bincount(group * experts * experts + first_choice * experts + second_choice,
                           minlength=groups * experts * experts).reshape(groups, experts, experts)
        cosel = pair + pair.transpose(0, 2, 1)
        cosel[:, np.arange(experts), np.arange(experts)] = load
        g_step = np.repeat(step_ids, layers)
        g_layer = np.tile(np.arange(layers, dtype=np.int32), n_steps)
        entropy = rng.normal(2.5, 0.05, size=groups)
        layer_steps = _table("layer_steps", {
            "run_id": pa.array(np.full(groups, RUN_ID, dtype=object), pa.string()), "step": pa.array(g_step),
            "ts": pa.array(np.repeat(ts, layers), pa.timestamp("us", tz="UTC")), "layer": pa.array(g_layer),
            "tokens": pa.array(np.full(groups, tokens_per_step, np.int64)),
            "expert_load": _lists(load.reshape(-1).astype(np.int64), experts, pa.int64()),
            "gate_weight_sum": _lists(load.reshape(-1).astype(np.float64) * 0.5, experts, pa.float64()),
            "router_entropy_mean": pa.array(entropy), "router_entropy_p95": pa.array(entropy + 0.3),
            "top1_margin_mean": pa.array(rng.uniform(0, 0.2, groups)),
            "dropped_tokens": pa.array(np.zeros(groups, np.int64)),
            "dropped_assignments": pa.array(np.zeros(groups, np.int64)),
            "active_params_per_token": pa.array(np.full(groups, top_k * params_per_expert, np.float64)),
            "coselection": _lists(cosel.reshape(-1).astype(np.int64), experts * experts, pa.int64()),
            "tags": _tags(np.repeat(domain, layers)), "rank": pa.array(np.zeros(groups, np.int32)),
        })
        write("layer_steps", layer_steps)
        active = (shared + layers * top_k * params_per_expert) / total
        steps_table = _table("steps", {
            "run_id": pa.array(np.full(n_steps, RUN_ID, dtype=object), pa.string()), "step": pa.array(step_ids),
            "ts": pa.array(ts, pa.timestamp("us", tz="UTC")), "duration_s": pa.array(rng.uniform(0.05, 0.08, n_steps)),
            "tokens": pa.array(np.full(n_steps, tokens_per_step, np.int64)),
            "batch_size": pa.array(np.full(n_steps, tokens_per_step // seq_len, np.int32)),
            "seq_len": pa.array(np.full(n_steps, seq_len, np.int32)),
            "active_params": pa.array(np.full(n_steps, active * total)),
            "total_params": pa.array(np.full(n_steps, total)),
            "active_param_fraction": pa.array(np.full(n_steps, active)), "tags": _tags(domain),
            "rank": pa.array(np.zeros(n_steps, np.int32)),
        })
        write("steps", steps_table)
        sample = 16  # router inputs sampled per layer and step, as `router_inputs=16` would
        s_rows = groups * sample
        picks = (np.arange(groups).repeat(sample) * tokens_per_step
                 + rng.integers(0, tokens_per_step, size=s_rows))
        inputs = _table("router_inputs", {
            "run_id": pa.array(np.full(s_rows, RUN_ID, dtype=object), pa.string()), "step": pa.array(step_of[picks]),
            "layer": pa.array(layer_of[picks]), "token": pa.array(token[picks]),
            "token_id": pa.array(rng.integers(0, 32000, size=s_rows)),
            "top1_expert": pa.array(first_choice[picks].astype(np.int32)),
            "hidden": _lists((rng.normal(size=(s_rows, hidden)) + first_choice[picks, None] * 0.3)
                             .astype(np.float32).reshape(-1), hidden, pa.float32()),
            "tags": _tags(np.repeat(domain, layers * sample)), "rank": pa.array(np.zeros(s_rows, np.int32)),
        })
        write("router_inputs", inputs)
    return {"route_rows": written, "steps": steps, "layers": layers, "experts": experts}


def folder_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def time_pages(root: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from moescope.dashboard import settings
    from moescope.dashboard.embedding import embedding_jobs

    os.environ[settings.ENV_STORE] = root
    app = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dashboard", "app.py")
    out: dict[str, dict[str, list[float]]] = {}
    for page in PAGES:
        at = AppTest.from_file(app, default_timeout=900)
        at.run()
        if page != PAGES[0]:
            at.switch_page(page)
        at.run()  # first run: fills the connection, and for clusters asks for the embedding
        if embedding_jobs().pending():  # computed off the page's run: drawn on the run after it is there
            embedding_jobs().wait()
            at.run()
        if at.exception:
            raise RuntimeError(f"{page}: {at.exception[0].value}")
        cold, warm = [], []
        for _ in range(repeats):
            # Clear the query caches but keep the embedding: UMAP is computed once per sample.
            for fn in _query_caches():
                fn.clear()
            t = time.perf_counter()
            at.run()
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            at.run()
            warm.append(time.perf_counter() - t)
        out[page] = {"cold": cold, "warm": warm}
    del st
    return out


def _query_caches():
    from streamlit.runtime.caching.cache_utils import CachedFunc

    from moescope.dashboard import data

    return [fn for name, fn in vars(data).items()
            if isinstance(fn, CachedFunc) and name not in ("tokenizer", "_open")]


def _server_cpu_s() -> float:
    """CPU seconds (user + system, every thread) of the dashboard servers this process started (and
    their children): what a page cost the server, which a loaded machine does not inflate as it does
    the wall time."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "streamlit" in " ".join(child.cmdline()):
                times = child.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            pass
    return total


def first_renders(root: str, repeats: int, cold_numba: bool, only: list[str] | None = None,
                  cpu_s: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds to each page's first render over `repeats` fresh servers, and to the clusters scatter
    and the Placement page's traffic; `only`: the pages (url paths) to visit, in this order, each
    server's first page first. `cpu_s`, where given, gets the server's CPU seconds for each."""
    cpu_s = {} if cpu_s is None else cpu_s
    from playwright.sync_api import sync_playwright

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:  # the browser helpers the tests use: tests/support/
        sys.path.insert(0, repo)
    from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, running_dashboard
    from tests.support.first_render import SCATTER, TRAFFIC, app_pages, first_render

    out: dict[str, list[float]] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            for _ in range(repeats):
                with tempfile.TemporaryDirectory(prefix="moescope-bench-first-") as scratch:
                    os.environ["XDG_CACHE_HOME"] = os.path.join(scratch, "xdg")
                    if cold_numba:
                        os.environ["NUMBA_CACHE_DIR"] = os.path.join(scratch, "numba")
                    with running_dashboard(root, scratch) as url:
                        page = browser.new_page(viewport={"width": 1500, "height": 2400})
                        pages = dict(app_pages())
                        for path, title in ([(p, pages[p]) for p in only] if only else pages.items()):
                            started, cpu = time.perf_counter(), _server_cpu_s()
                            out.setdefault(title, []).append(first_render(page, url, path, title))
                            cpu_s.setdefault(title, []).append(_server_cpu_s() - cpu)
                            if path == "clusters":
                                page.wait_for_selector(SCATTER, timeout=900_000)
                                out.setdefault("  UMAP scatter drawn", []).append(time.perf_counter() - started)
                            if path == "placement":
                                page.wait_for_selector(TRAFFIC, timeout=900_000)
                                out.setdefault("  traffic drawn", []).append(time.perf_counter() - started)
                                cpu_s.setdefault("  traffic drawn", []).append(_server_cpu_s() - cpu)
                        page.close()
        finally:
            browser.close()
    return out


def main_first_render(root: str, repeats: int, cold_numba: bool, only: list[str] | None = None) -> int:
    load = os.getloadavg()[0]
    t = time.perf_counter()
    cpu_s: dict[str, list[float]] = {}
    results = first_renders(root, repeats, cold_numba, only, cpu_s)
    print(f"first render per page, a fresh server each time ({repeats} runs, {os.cpu_count()} CPUs, load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}; numba cache {'empty' if cold_numba else 'as installed'}):")
    print(f"{'page':<22}{'median':>9}{'max':>9}{'server CPU-s':>14}")
    for title, times in results.items():
        cpu = f"{statistics.median(cpu_s[title]):>13.2f}" if title in cpu_s else ""
        print(f"{title:<22}{statistics.median(times):>8.1f}s{max(times):>8.1f}s{cpu}")
    print(f"(goal: every page's first render under 10 s)   [{time.perf_counter() - t:.0f} s in all]")
    return 0


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.getLogger("streamlit").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000_000, help="route rows (default 50 M)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tokens-per-step", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store", help="folder for the store (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the store (and reuse it if it exists)")
    parser.add_argument("--first-render", metavar="STORE",
                        help="time each page's first render in Chromium on this store (e.g. runs/demo)")
    parser.add_argument("--pages", metavar="PATH,...",
                        help="with --first-render: only these pages (url paths, e.g. placement), in this order, the "
                             "first one on a server that has opened nothing yet")
    parser.add_argument("--cold-numba", action="store_true",
                        help="with --first-render: an empty numba cache too (a fresh install)")
    args = parser.parse_args(argv)
    if args.first_render:
        only = [p.strip() for p in args.pages.split(",") if p.strip()] if args.pages else None
        return main_first_render(args.first_render, args.repeats, args.cold_numba, only)
    root = args.store or tempfile.mkdtemp(prefix="moescope-bench-dashboard-")
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="moescope-bench-cache-"))
    try:
        if not os.path.isdir(os.path.join(root, "routes")):
            t = time.perf_counter()
            info = build_store(root, args.rows, args.layers, args.experts, args.tokens_per_step)
            print(f"store: {info['route_rows']:,} route rows, {info['steps']:,} steps x {info['layers']} layers x "
                  f"{info['experts']} experts, {folder_bytes(root) / 2**30:.2f} GiB, built in "
                  f"{time.perf_counter() - t:.0f} s at {root}")
        else:
            print(f"store: reusing {root} ({folder_bytes(root) / 2**30:.2f} GiB)")
        t = time.perf_counter()
        results = time_pages(root, args.repeats)
        print(f"\npage render time over {args.repeats} runs (AppTest, whole script incl. queries and figures):")
        print(f"{'page':<22}{'cold p50':>10}{'cold max':>10}{'warm p50':>10}")
        for page, times in results.items():
            print(f"{page.split('/')[-1]:<22}{statistics.median(times['cold']):>9.2f}s{max(times['cold']):>9.2f}s"
                  f"{statistics.median(times['warm']):>9.2f}s")
        all_cold = [x for times in results.values() for x in times["cold"]]
        print(f"{'all pages':<22}{statistics.median(all_cold):>9.2f}s{max(all_cold):>9.2f}s"
              f"   (target: p50 <= 2 s)   [{time.perf_counter() - t:.0f} s in all]")
    finally:
        if not args.keep and not args.store:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

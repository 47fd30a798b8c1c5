"""What `moescope traffic`'s figures cost: 1 M route rows of a 64-expert, top-8 layer on 32 ranks in
8 nodes of 4, under a placement with 8 redundant slots (the 8 hottest experts copied).

The routes are synthetic and fixed by a seed (Gumbel top-8 over Dirichlet-0.5 popularities that
drift every 50 000 tokens, as bench/whatif.py draws them), with gate weights, 8 tokens a step and
one sequence per token row, in pages of 65 536 rows as `Store.routes_in_order(weights=True)` yields
them. Timed, `--repeat` times each (median wall and CPU seconds):

- fan-out: every token's remote ranks and nodes, the rank x rank matrix, floors and bytes
  (`metrics.traffic.token_fanout` + `TrafficTally`), what `moescope traffic` computes per layer;
- + node-limited: the same and DeepSeek-V3's node-limited routing at M = 4;
- co-selection placement: `coselection_layout` for the layer (64 experts on 32 ranks);
- store: the same rows written to a store and `analyses.traffic.traffic_report` over it (query +
  count), with `--store` only (writing 1 M rows takes a while);
- the per-token loop (the tests' oracle) on the first `--loop-tokens` tokens, beside the fan-out on
  the same tokens: the ratio is what vectorising buys.

    python bench/traffic.py                       # 1 M rows, 3 runs each
    python bench/traffic.py --rows 200000 --repeat 1 --store

With `--stores DIR,DIR,...` (stores bench/scale.py wrote and kept, smallest first: `python bench/scale.py
--rows 5e6,50e6 --engines duckdb --root /tmp/scale --keep`) it times instead, per store, what an operator
waits for at fleet size, wall and CPU seconds (every thread of the process) beside the load average:
the store's open with every file checked (a `Store`, which reads the tables' logs, then `check_files()`:
every file's footer and page checksums, which a reader otherwise checks when a query first reads its
table, here before the figures after it);
`moescope placement --ranks 8`'s report (slots, and distinct tokens per rank from the routes rows);
`moescope traffic --ranks 8`'s report; the Placement page's data (its slots heatmap, the what-if over
windows of 32 steps, the traffic of the layer it shows); and the token-by-token count the reports made
before DuckDB counted the rows per group (`Store.routes_in_order` pages, `token_fanout` and a
`TrafficTally` per page), on one layer, beside the grouped count of the same layer: the ratio is what
counting where the data is buys; then the modes counted the same way since: the placement report under
DeepSeek's EPLB with 8 redundant slots, with vLLM's and TensorRT-LLM's choice of copy (numbered in the
store), and the traffic report under node-limited routing, at M = 1 on the one node of 8 ranks and on
16 ranks in 2 nodes at M = 1 and 2 (the tokens over M nodes read row by row). A table gives each
figure's growth beside the growth in rows.

    python bench/traffic.py --stores /tmp/scale/store-0-5000000,/tmp/scale/store-1-50000000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

if __name__ == "__main__":  # run as a script: the repository's moescope, not an installed one
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moescope.metrics import traffic as wire  # noqa: E402

PAGE_ROWS = 65_536
RANKS, PER_NODE = 32, 4


def routes(rows: int, experts: int, top_k: int, seed: int, drift: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights): (rows, top_k) expert ids by a Gumbel top-k over drifting popularities, and
    their softmax weights over the top-k scores."""
    rng = np.random.default_rng(seed)
    ids = np.empty((rows, top_k), dtype=np.int64)
    weights = np.empty((rows, top_k), dtype=np.float32)
    for lo in range(0, rows, drift):
        hi = min(rows, lo + drift)
        log_popularity = np.log(rng.dirichlet(np.full(experts, 0.5)))
        scores = rng.gumbel(size=(hi - lo, experts)) + log_popularity
        top = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
        ids[lo:hi] = top
        chosen = np.take_along_axis(scores, top, axis=1)
        e = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        weights[lo:hi] = e / e.sum(axis=1, keepdims=True)
    return ids, weights


def layout(ids: np.ndarray, experts: int) -> tuple[list[list[int]], wire.WireLayout]:
    """The contiguous layout (2 experts a rank) plus a copy of each of the 8 hottest experts on the
    ranks of another node, one per rank, round-robin."""
    per_rank = [[2 * r, 2 * r + 1] for r in range(RANKS)]
    hot = np.argsort(-np.bincount(ids.ravel(), minlength=experts))[:8]
    for i, expert in enumerate(hot):
        home = int(expert) // 2
        per_rank[(home + PER_NODE + i) % RANKS].append(int(expert))
    slot_rank = np.array([r for r, es in enumerate(per_rank) for _ in es])
    slot_expert = np.array([e for es in per_rank for e in es])
    return per_rank, wire.WireLayout(slot_rank, slot_expert, wire.default_rank_node(RANKS, PER_NODE), experts)


def count(pages, wl: wire.WireLayout, max_nodes: int | None) -> dict:
    tally = wire.TrafficTally.for_layout(wl)
    for step, sequence, ids, kept, weights in pages:
        home = wire.home_ranks("sequence", wl.ranks, sequence, sequence, sequence)
        fan = wire.token_fanout(wl, home, ids, kept)
        limited = wire.node_limited(wl, fan, home, ids, weights, max_nodes) if max_nodes else None
        tally.add(wl, home, fan, step, limited)
    return tally.figures(hidden_size=7168, dispatch_bytes=1, combine_bytes=2)


def loop(per_rank, nodes, homes, ids) -> float:
    """The tests' oracle: mean remote ranks, one token and one expert at a time."""
    total = 0
    for home, row in zip(homes, ids):
        dests = set()
        for e in row:
            copies = sorted(r for r, es in enumerate(per_rank) if e in es)
            near = [r for r in copies if nodes[r] == nodes[home]]
            far = [r for r in copies if nodes[r] != nodes[home]]
            dests.add(home if home in copies else near[0] if near else far[home % len(far)])
        total += len(dests - {home})
    return total / len(ids)


def timed(fn, repeat: int) -> tuple[float, float, object]:
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), result


def store_report(ids: np.ndarray, weights: np.ndarray, per_rank, experts: int) -> tuple[float, float, dict]:
    """Write the rows to a store (not timed), then time `traffic_report` over it once."""
    import datetime as dt

    from moescope.analyses.placement import Placement
    from moescope.analyses.traffic import Wire, traffic_report
    from moescope.core.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord
    from moescope.store import Store
    from moescope.store.writer import ParquetExporter

    root = tempfile.mkdtemp(prefix="moescope-bench-traffic-")
    info = RunInfo(run_id="bench", started_at=dt.datetime.now(dt.timezone.utc), model_class="Synthetic",
                   total_params=1, routed_expert_params=1, tags={}, rank=0, world_size=1,
                   layers=(LayerInfo(layer=0, module="moe", family="synthetic", num_experts=experts, top_k=ids.shape[1],
                                     params_per_expert=1),))
    exporter = ParquetExporter(root, info, max_rows=PAGE_ROWS * 4)
    per_step = 4096
    for s, lo in enumerate(range(0, len(ids), per_step)):
        chunk, w = ids[lo:lo + per_step], weights[lo:lo + per_step]
        n = len(chunk)
        exporter.export([StepRecord(
            run_id="bench", step=s, ts=dt.datetime.now(dt.timezone.utc), duration_s=0.0, tokens=n, batch_size=n,
            seq_len=1, active_params=1.0, total_params=1, tags={},
            layers=[LayerStep(layer=0, tokens=n, expert_load=np.bincount(chunk.ravel(), minlength=experts),
                              gate_weight_sum=np.zeros(experts), router_entropy_mean=0.0, router_entropy_p95=0.0,
                              top1_margin_mean=0.0, dropped_tokens=0, dropped_assignments=0, capacity=None,
                              capacity_use=None, active_params_per_token=1.0,
                              routes=Routes(expert_ids=chunk.astype(np.int32), gate_weights=w,
                                            kept=np.ones(chunk.shape, dtype=bool), token_ids=None,
                                            sequence=np.arange(n, dtype=np.int32),
                                            position=np.zeros(n, dtype=np.int32)))])])
    exporter.shutdown()
    placement = Placement(RANKS, default=tuple(tuple(r) for r in per_rank), source="bench")
    setup = Wire(wire.default_rank_node(RANKS, PER_NODE), "sequence", 7168, 1, 2, 4)
    with Store(root) as store:
        wall, cpu = time.perf_counter(), time.process_time()
        report = traffic_report(store, "bench", placement, setup)
        return time.perf_counter() - wall, time.process_time() - cpu, report.layers.iloc[0].to_dict()


def fleet(roots: list[str], repeat: int) -> None:
    """The fleet-size figures of `--stores` (module doc), a row per store, then their growth."""
    from streamlit import logger as streamlit_logger

    from moescope.analyses.placement import Placement, placement_report
    from moescope.analyses.traffic import Wire, default_home, eplb_placement, node_layout, traffic_report
    from moescope.dashboard.data import _placement_report, _placement_whatif, _traffic
    from moescope.metrics.placement import wire_layout
    from moescope.store import Store

    streamlit_logger.set_log_level("error")  # the page's caches warn when called outside a server, as here
    names = ["open, every file checked", "placement --ranks 8", "traffic --ranks 8", "Placement page data",
             "traffic, 1 layer", "token by token, 1 layer", "placement, EPLB+8, vllm", "placement, EPLB+8, trtllm",
             "traffic --max-nodes 1", "traffic 2 nodes, max 1", "traffic 2 nodes, max 2"]
    table: list[tuple[int, dict[str, tuple[float, float]]]] = []
    for root in roots:
        load = os.getloadavg()
        wall, cpu = time.perf_counter(), time.process_time()
        store = Store(root)
        store.check_files()
        opened = (time.perf_counter() - wall, time.process_time() - cpu)
        with store:
            run = store.latest_run()
            rows = int(store.sql("SELECT count(*) AS n FROM routes WHERE run_id = ?", [run]).n.iloc[0])
            layer = int(store.layers(run).layer.iloc[0])
            contiguous = Placement.contiguous(8)
            setup = Wire(node_layout(8, 8), default_home(store, run), 4096)

            def page() -> None:
                _placement_report(store, run, 8, None, "even")
                _placement_whatif(store, run, 8, 32, "even")
                _traffic(store, run, 8, 8, layer)

            def token_by_token() -> dict:
                layout = wire_layout(contiguous, layer, int(store.layers(run).num_experts.iloc[0]),
                                          setup.rank_node)
                tally = wire.TrafficTally.for_layout(layout)
                for chunk in store.routes_in_order(run, layer):
                    home = wire.home_ranks(setup.home, 8, chunk.rank, chunk.sequence, chunk.token)
                    tally.add(layout, home, wire.token_fanout(layout, home, chunk.expert_ids, chunk.kept), chunk.step)
                return tally.figures(4096)

            # EPLB with 8 redundant slots on the 8 ranks: vLLM's and TensorRT-LLM's copy counted in the store
            fitted = eplb_placement(store, run, 8, node_layout(8, 8), redundant=8)

            def limited(ranks: int, max_nodes: int) -> Wire:  # node-limited routing, nodes of 8 ranks
                return Wire(node_layout(ranks, 8), default_home(store, run), 4096, max_nodes=max_nodes)

            figures = {"open, every file checked": opened}
            for name, fn in [("placement --ranks 8", lambda: placement_report(store, run, contiguous)),
                             ("traffic --ranks 8", lambda: traffic_report(store, run, contiguous, setup)),
                             ("Placement page data", page),
                             ("traffic, 1 layer", lambda: traffic_report(store, run, contiguous, setup,
                                                                         layers=[layer])),
                             ("token by token, 1 layer", token_by_token),
                             ("placement, EPLB+8, vllm", lambda: placement_report(store, run, fitted, dispatch="vllm")),
                             ("placement, EPLB+8, trtllm",
                              lambda: placement_report(store, run, fitted, dispatch="trtllm")),
                             ("traffic --max-nodes 1", lambda: traffic_report(store, run, contiguous, limited(8, 1))),
                             ("traffic 2 nodes, max 1", lambda: traffic_report(store, run, Placement.contiguous(16),
                                                                               limited(16, 1))),
                             ("traffic 2 nodes, max 2", lambda: traffic_report(store, run, Placement.contiguous(16),
                                                                               limited(16, 2)))]:
                w, c, result = timed(fn, repeat)
                figures[name] = (w, c)
                if name == "traffic, 1 layer":
                    grouped = result.layers.iloc[0].rank_matrix  # type: ignore[attr-defined]
                elif name == "token by token, 1 layer":  # the same figures both ways
                    assert (result["rank_matrix"] == grouped).all()  # type: ignore[index]
        table.append((rows, figures))
        print(f"\n{rows:,} route rows in {root} (load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after; {os.cpu_count()} CPUs; median of {repeat})")
        print(f"{'':<28}{'wall s':>9}{'cpu s':>9}")
        for name in names:
            print(f"{name:<28}{figures[name][0]:>9.2f}{figures[name][1]:>9.2f}", flush=True)
        ratio = figures["token by token, 1 layer"][1] / figures["traffic, 1 layer"][1]
        print(f"token by token / grouped, one layer: {ratio:.1f}x the CPU")
    if len(table) > 1:
        print(f"\ngrowth from {table[0][0]:,} to {table[-1][0]:,} rows ({table[-1][0] / table[0][0]:.1f}x), CPU s:")
        for name in names:
            print(f"{name:<28}{table[-1][1][name][1] / max(table[0][1][name][1], 1e-9):>9.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="route rows of the layer (default 1 M)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the median is printed")
    parser.add_argument("--loop-tokens", type=int, default=20_000, help="tokens for the per-token loop (0: skip)")
    parser.add_argument("--store", action="store_true", help="also time traffic_report over a store of the rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stores", help="time the fleet-size figures over these stores instead (module doc)")
    args = parser.parse_args(argv)
    if args.stores:
        fleet([part for part in args.stores.split(",") if part], args.repeat)
        return 0

    ids, weights = routes(args.rows, args.experts, args.top_k, args.seed)
    per_rank, wl = layout(ids, args.experts)
    index = np.arange(args.rows)
    pages = [(index[lo:lo + PAGE_ROWS] // 8, index[lo:lo + PAGE_ROWS], ids[lo:lo + PAGE_ROWS],
              np.ones((min(PAGE_ROWS, args.rows - lo), args.top_k), dtype=bool), weights[lo:lo + PAGE_ROWS])
             for lo in range(0, args.rows, PAGE_ROWS)]
    print(f"{args.rows:,} route rows, {args.experts} experts, top-{args.top_k}, {RANKS} ranks in "
          f"{RANKS // PER_NODE} nodes of {PER_NODE}, {wl.slot_rank.size - args.experts} redundant slots; "
          f"median of {args.repeat}")
    print(f"{'figure':<34} {'wall s':>8} {'cpu s':>8} {'rows/s':>12}")
    fan_wall, fan_cpu, figures = timed(lambda: count(pages, wl, None), args.repeat)
    print(f"{'fan-out, matrix, floors, bytes':<34} {fan_wall:>8.2f} {fan_cpu:>8.2f} {args.rows / fan_wall:>12,.0f}")
    lim_wall, lim_cpu, limited = timed(lambda: count(pages, wl, 4), args.repeat)
    print(f"{'+ node-limited routing (M = 4)':<34} {lim_wall:>8.2f} {lim_cpu:>8.2f} {args.rows / lim_wall:>12,.0f}"
          f"   ({lim_wall / fan_wall:.2f}x the fan-out)")
    cosel = np.zeros((args.experts, args.experts), dtype=np.int64)
    onehot = np.zeros((min(args.rows, 200_000), args.experts), dtype=np.int64)
    onehot[np.arange(len(onehot))[:, None], ids[:len(onehot)]] = 1
    cosel = onehot.T @ onehot
    co_wall, co_cpu, _ = timed(lambda: wire.coselection_layout(cosel, np.diag(cosel), np.full(RANKS, 2),
                                                               wl.rank_node), args.repeat)
    print(f"{'co-selection placement (1 layer)':<34} {co_wall:>8.3f} {co_cpu:>8.3f}")
    if args.store:
        st_wall, st_cpu, row = store_report(ids, weights, per_rank, args.experts)
        print(f"{'traffic_report over a store':<34} {st_wall:>8.2f} {st_cpu:>8.2f} {args.rows / st_wall:>12,.0f}"
              f"   ({st_wall / lim_wall:.2f}x the in-memory count)")
        assert abs(row["remote_ranks_mean"] - limited["remote_ranks_mean"]) < 1e-9
    if args.loop_tokens:
        n = min(args.loop_tokens, args.rows)
        homes = index[:n] % RANKS
        nodes = wl.rank_node.tolist()
        lp_wall, lp_cpu, expected = timed(lambda: loop(per_rank, nodes, homes, ids[:n]), 1)
        vec_wall, _, fan = timed(lambda: wire.token_fanout(wl, homes, ids[:n], np.ones((n, args.top_k), bool)),
                                 args.repeat)
        assert abs(fan.remote_ranks.mean() - expected) < 1e-12
        print(f"{f'per-token loop ({n:,} tokens)':<34} {lp_wall:>8.2f} {lp_cpu:>8.2f} {n / lp_wall:>12,.0f}"
              f"   (fan-out on the same tokens {vec_wall:.3f} s: {lp_wall / vec_wall:,.0f}x)")
    print(f"\nremote ranks per token {figures['remote_ranks_mean']:.2f} (floor {figures['floor_remote_ranks']:.2f}), "
          f"remote nodes {figures['remote_nodes_mean']:.2f} (floor {figures['floor_remote_nodes']:.2f}), "
          f"intra-node share {figures['intra_node_share']:.3f}; node-limited M = 4 changes "
          f"{100 * limited['limited_changed_share']:.1f}% of tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

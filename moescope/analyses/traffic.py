"""What a placement costs on the wire, per layer, window and tag: `moescope traffic` and the placement page.

For a run's recorded routes and a placement (`moescope.metrics.placement.Placement`) with ranks
grouped into nodes, every token's dispatch fan-out is counted by `moescope.metrics.traffic` (the
one definition): remote ranks and nodes per token against the floor a perfect placement could
reach, the rank x rank matrix of tokens sent and its node x node sum, the busiest link, the
intra-node share, bytes per forward, and, with `max_nodes`, what DeepSeek-V3's node-limited
routing would change. `compare_placements` gives the same figures under other placements: the
default layout, a co-selection placement (`coselection_placement`, from the counts the probe
records) and any other `Placement` (the EPLB what-if).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from moescope.analyses.placement import placement_for_run
from moescope.metrics import traffic as wire
from moescope.metrics.eplb import eplb
from moescope.metrics.placement import Placement, PlacementError, contiguous_layout, wire_layout
from moescope.store import Store

DEFAULT_RANKS_PER_NODE = wire.DEFAULT_RANKS_PER_NODE
# node-limited routing: the largest top-k whose gate weights' order is a key of the routes groups (k!
# orders at most: beyond, the groups would stand for few rows each)
WEIGHT_ORDER_TOP_K = 4
# bytes per element of the hidden state by the model config's torch_dtype
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "fp8": 1}
# DeepEP's fp8 dispatch sends with each token one float32 scale per 128 elements of its hidden state
# (csrc/kernels/internode_ll.cu: kNumPerChannels = 128, hidden + hidden / 128 * sizeof(float) bytes;
# the normal kernels take x_scales [tokens, hidden / 128] float32 alike)
FP8_SCALE_ELEMENTS, FP8_SCALE_BYTES = 128, 4
# DeepEP's kernels: "normal" (prefill) sends a token once per remote GPU holding any of its experts and
# once per remote node over RDMA; "low-latency" (decode, csrc/kernels/internode_ll.cu) sends one
# message per top-k slot, a warp each, so a token's slots on one remote GPU are that many sends, and
# a slot on another node is an RDMA message of its own (no forwarding inside the node)
MODES = ("normal", "low-latency")
# the figures that count sends, which the mode changes; the per-token fan-out figures it does not
SEND_COLUMNS = ("rank_matrix", "node_matrix", "gpu_sends", "rdma_sends", "intra_node_share", "busiest_link",
                "busiest_link_tokens", "busiest_node_link", "busiest_node_link_tokens", "dispatch_bytes_per_forward",
                "combine_bytes_per_forward", "rdma_dispatch_bytes_per_forward", "rdma_combine_bytes_per_forward")

COLUMNS = [
    "layer", "window_start", "window_end", "tokens", "forwards", "remote_ranks_mean", "floor_remote_ranks",
    "remote_nodes_mean", "floor_remote_nodes", "remote_ranks_histogram", "remote_nodes_histogram",
    "rank_matrix", "node_matrix", "gpu_sends", "rdma_sends", "intra_node_share", "busiest_link",
    "busiest_link_tokens", "busiest_node_link", "busiest_node_link_tokens", "dispatch_bytes_per_forward",
    "combine_bytes_per_forward", "rdma_dispatch_bytes_per_forward", "rdma_combine_bytes_per_forward",
    "limited_changed_share", "limited_moved_weight", "limited_moved_weight_changed", "limited_rule",
    *(f"limited_{name}" for name in wire.LIMITED_FIGURES),
]


@dataclass(frozen=True)
class Wire:
    """How tokens travel: the nodes ranks sit in, how tokens get home ranks, the hidden state's size.

    Attributes:
        rank_node: (R,) the node of each rank (`node_layout`).
        home: "recorded", "sequence" or "token" (`moescope.metrics.traffic.home_ranks`).
        hidden_size: the model's hidden size (None: no bytes are given).
        dispatch_bytes: bytes per element sent at dispatch (2 for bf16; 1 for DeepEP's fp8 dispatch,
            which also sends a float32 scale per 128 elements: `dispatch_wire_bytes`).
        combine_bytes: bytes per element sent back at combine (2: DeepEP combines in bf16, whatever
            the dispatch).
        max_nodes: M of node-limited routing (None: not evaluated).
        mode: DeepEP's kernels, "normal" or "low-latency" (`MODES`): what a send is; in low-latency
            mode the send figures (`SEND_COLUMNS`) count remote top-k slots, the matrix slots.
    """

    rank_node: np.ndarray
    home: str = "token"
    hidden_size: int | None = None
    dispatch_bytes: float = 2.0
    combine_bytes: float = 2.0
    max_nodes: int | None = None
    mode: str = "normal"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: one of {', '.join(MODES)}")

    @property
    def dispatch_wire_bytes(self) -> float:
        """Bytes per hidden element on the wire at dispatch: `dispatch_bytes`, and for fp8 (1 byte) the
        float32 scale of each block of 128 elements (a partial block has its own scale)."""
        if self.dispatch_bytes != 1 or not self.hidden_size:
            return float(self.dispatch_bytes)
        blocks = -(-int(self.hidden_size) // FP8_SCALE_ELEMENTS)
        return 1.0 + blocks * FP8_SCALE_BYTES / int(self.hidden_size)


def node_layout(ranks: int, ranks_per_node: int = DEFAULT_RANKS_PER_NODE,
                nodes: list[int] | None = None) -> np.ndarray:
    """(R,) the node of each rank: consecutive ranks fill nodes of `ranks_per_node` (the last one
    may be smaller), or of the sizes `nodes` lists (uneven nodes). Raises PlacementError when the
    sizes do not add up to the ranks."""
    if nodes is not None:
        if sum(nodes) != ranks:
            raise PlacementError(f"--nodes {','.join(map(str, nodes))} holds {sum(nodes)} ranks, but the placement "
                                 f"has {ranks}; list each node's ranks so they add up to {ranks}")
        return wire.nodes_from_sizes(nodes)
    if ranks_per_node < 1:
        raise PlacementError(f"--ranks-per-node must be at least 1, not {ranks_per_node}")
    return wire.default_rank_node(ranks, ranks_per_node)


def read_model_config(path: str) -> tuple[int, float]:
    """(hidden_size, bytes per element) from a transformers `config.json` (its `hidden_size` and
    `torch_dtype`, bf16 when absent). Raises PlacementError for a file without `hidden_size`."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlacementError(f"{path}: cannot read a model config (a transformers config.json): {e}") from e
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = text.get("hidden_size") if isinstance(text, dict) else None
    if not isinstance(hidden, int) or hidden < 1:
        raise PlacementError(f"{path}: no hidden_size; give --hidden-size")
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return hidden, float(DTYPE_BYTES.get(dtype, 2))


def default_home(store: Store, run_id: str) -> str:
    """The run's default home rule (`moescope.metrics.traffic.default_home`, the rule every view
    uses): "recorded" when the run's routes come from more than one rank, else "token"."""
    ranks = store.sql("SELECT count(DISTINCT rank) AS n FROM routes WHERE run_id = ?", [run_id])
    return wire.default_home(int(ranks.n.iloc[0]) if len(ranks) else 0)


@dataclass(frozen=True)
class TrafficReport:
    """What `traffic_report` found.

    `layers`: one row per (layer, window): layer, window_start, window_end (NaN for the whole run);
    tokens (routed tokens), forwards (distinct steps); remote_ranks_mean / remote_nodes_mean (per
    token: distinct remote GPUs / nodes its kept experts sit on, DeepEP's GPU and RDMA sends) and
    floor_remote_ranks / floor_remote_nodes (the perfect placement's, `metrics.traffic.floor_remote`);
    remote_ranks_histogram / remote_nodes_histogram (tokens per count, index = count);
    rank_matrix (R x R tokens from home rank h that reach rank r; diagonal: served at home),
    node_matrix (its node x node sum); gpu_sends, rdma_sends; intra_node_share (GPU sends within a
    node / all); busiest_link (h, r) and its tokens, busiest_node_link likewise;
    dispatch/combine bytes per forward over GPU sends and over RDMA (NaN without a hidden size);
    with `max_nodes`: limited_changed_share (tokens whose routing would change),
    limited_moved_weight (top-k gate weight moved per token, all tokens), limited_moved_weight_changed
    (per changed token; 0 when none changes), and every figure above under the limit as
    limited_<name> (`moescope.metrics.traffic.LIMITED_FIGURES`: remote ranks and nodes per token and
    their histograms, the matrices, sends, intra-node share, busiest links, bytes; under the
    kept-weights approximation the replaced experts are unknown, so its remote nodes are exact and
    its remote ranks, sends and bytes a lower bound), limited_rule (which
    rule gave them: `moescope.metrics.traffic.LIMIT_RULES`; DeepSeek-V3's rule on the router's
    scores where the run kept every token's router logits); NaN (None) otherwise.
    """

    layers: pd.DataFrame
    ranks: int
    nodes: int
    source: str
    home: str
    replica_rule: str = wire.REPLICA_RULE
    mode: str = "normal"


def traffic_report(store: Store, run_id: str, placement: Placement, setup: Wire, window_steps: int | None = None,
                   tags: dict[str, str] | None = None, layers: list[int] | None = None,
                   step_from: int | None = None, step_to: int | None = None) -> TrafficReport:
    """Per layer (and window of `window_steps` steps; None: the whole run) of the run's routes rows
    carrying `tags` (in steps `step_from` <= step < `step_to` where given), what the placement costs on
    the wire (`TrafficReport`). Layers without routes
    have no row. Raises PlacementError where the placement does not fit a layer, and ValueError for
    a home rule the routes cannot follow."""
    if window_steps is not None and window_steps < 1:
        raise ValueError(f"window_steps must be at least 1, not {window_steps}")
    rows = []
    placement = placement_for_run(store, run_id, placement)
    info = store.layers(run_id)
    for row in info.itertuples():
        layer = int(row.layer)
        if layers is not None and layer not in layers:
            continue
        layout = wire_layout(placement, layer, int(row.num_experts), setup.rank_node)
        tallies: dict[int | None, wire.TrafficTally] = {}
        slot_sends: dict[int | None, wire.TrafficTally] = {}  # low-latency mode: a send per remote slot

        def tally(key: int | None) -> wire.TrafficTally:
            return tallies.setdefault(key, wire.TrafficTally.for_layout(layout))

        def windows(keys_of: np.ndarray) -> Iterator[tuple[int | None, np.ndarray]]:
            for key in np.unique(keys_of):
                yield None if window_steps is None else int(key), keys_of == key

        # every figure is a sum over tokens of a function of (home, kept top-k): DuckDB counts the rows
        # per (window, home key, routing) and the fan-out is computed once per group
        keys: dict[str, dict[str, Any]] = {"recorded": dict(by_rank=True),
                                           "sequence": dict(sequence_modulo=layout.ranks),
                                           "token": dict(token_modulo=layout.ranks)}
        if setup.home not in keys:
            wire.home_ranks(setup.home, layout.ranks, np.zeros(0), None, np.zeros(0))  # its error
        max_nodes = setup.max_nodes
        # node-limited routing: a token whose kept experts span at most M nodes and whose router logits
        # were not stored keeps its routing (the kept-weights rule changes only tokens over M nodes), so it
        # is counted with its group; the others read their own gate weights and logits (`rows_of_groups`)
        # (as are those whose limited routing their gate weights' order decides, for a top-k of at most
        # WEIGHT_ORDER_TOP_K: the weights' order is then a key of the groups)
        # (no token spans more than M nodes where the layout has at most M)
        one_by_one: list[int] = []
        over = max_nodes is not None and layout.nodes > max_nodes
        ordered = over and pd.notna(row.top_k) and int(row.top_k) <= WEIGHT_ORDER_TOP_K
        logits_key = max_nodes is not None and store.has_router_logits(run_id, layer, step_from, step_to)
        for group in store.route_groups(run_id, layer, window_steps, step_from, step_to, tags, logits_key=logits_key,
                                        keyed=over,
                                        weight_order=int(row.num_experts) if ordered else None, **keys[setup.home]):
            page = group.routes
            home = wire.home_ranks(setup.home, layout.ranks, page.rank, page.sequence, page.token)
            fan = wire.token_fanout(layout, home, page.expert_ids, page.kept)
            apart = np.zeros(len(home), dtype=bool)
            if max_nodes is not None:
                has_logits = page.has_logits if page.has_logits is not None else np.zeros(len(home), dtype=bool)
                limited, apart = _limited_by_group(layout, group, home, fan, has_logits, max_nodes)
                if apart.any():
                    assert group.key is not None  # a group is read apart only where it has a key
                    one_by_one += group.key[apart].tolist()
            step_window = np.zeros_like(group.steps) if window_steps is None else group.steps // window_steps
            for key, pick in windows(group.window):
                steps = group.steps[step_window == (key or 0)]
                tally(key).add(layout, home[pick], _select(fan, pick), steps, None, group.count[pick])
                if setup.mode == "low-latency":
                    slot_sends.setdefault(key, wire.TrafficTally.for_layout(layout)).add(
                        layout, *_per_slot(layout, home[pick], _select(fan, pick), steps, group.count[pick]))
                if max_nodes is not None:
                    grouped = pick & ~apart
                    tally(key).add_limited(layout, home[grouped], _select_limited(limited, grouped),
                                           group.count[grouped])
        if max_nodes is not None and one_by_one:
            for page in store.rows_of_groups(run_id, layer, sorted(set(one_by_one)), step_from, step_to, tags,
                                             **keys[setup.home]):
                home = wire.home_ranks(setup.home, layout.ranks, page.rank, page.sequence, page.token)
                fan = wire.token_fanout(layout, home, page.expert_ids, page.kept)
                assert page.has_logits is not None
                mine = _read_apart(layout, fan, home, page.has_logits, max_nodes, ordered)[0]  # not in a group
                keys_of = np.zeros(len(home), dtype=np.int64) if window_steps is None else page.step // window_steps
                for rule, which in _limit_rules(layout, page, mine).items():
                    if not which.any():
                        continue
                    limited = _node_limited(layout, _select(fan, which), home[which], page, which, max_nodes,
                                            row.family, rule)
                    for key, pick in windows(keys_of[which]):
                        tally(key).add_limited(layout, home[which][pick], _select_limited(limited, pick))
        width = window_steps or 0
        for key, counted in sorted(tallies.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            figures = counted.figures(setup.hidden_size, setup.dispatch_wire_bytes, setup.combine_bytes)
            if key in slot_sends:
                sent = slot_sends[key].figures(setup.hidden_size, setup.dispatch_wire_bytes, setup.combine_bytes)
                figures.update({name: sent[name] for name in SEND_COLUMNS})
            if setup.max_nodes is None:
                for name in ("limited_changed_share", "limited_moved_weight", "limited_moved_weight_changed"):
                    figures[name] = float("nan")
                figures["limited_rule"] = None
            rows.append(dict(layer=layer, window_start=np.nan if key is None else key * width,
                             window_end=np.nan if key is None else (key + 1) * width, **figures))
    return TrafficReport(pd.DataFrame(rows, columns=COLUMNS), placement.ranks, int(setup.rank_node.max()) + 1,
                         placement.source, setup.home, mode=setup.mode)


def _per_slot(layout, home: np.ndarray, fan: wire.TokenFanout, steps: np.ndarray, counts: np.ndarray | None = None
              ) -> tuple[np.ndarray, wire.TokenFanout, np.ndarray, None, np.ndarray | None]:
    """(home, fan-out, steps, no node limit, counts) with a row per kept slot instead of per token: DeepEP
    low-latency's sends, one per slot, so a `TrafficTally` over them counts a send per remote slot."""
    token, slot = np.nonzero(fan.dest >= 0)
    dest, home = fan.dest[token, slot], np.asarray(home, dtype=np.int64)[token]
    reached = np.zeros((len(dest), layout.ranks), dtype=bool)
    reached[np.arange(len(dest)), dest] = True
    node = layout.rank_node
    per_slot = wire.TokenFanout(dest[:, None], reached, (dest != home).astype(np.int64),
                                (node[dest] != node[home]).astype(np.int64), np.ones(len(dest), dtype=np.int64))
    return home, per_slot, np.asarray(steps), None, None if counts is None else np.asarray(counts)[token]


def _read_apart(layout: wire.WireLayout, fan: wire.TokenFanout, home: np.ndarray, has_logits: np.ndarray,
                max_nodes: int, ordered: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the tokens read one by one under node-limited routing, those the order of their gate weights
    decides), as functions of a token's routing, home and stored logits alone, so that the groups and
    the rows read back agree on every token: a token with stored logits is read; one without, whose
    experts span at most `max_nodes` nodes, keeps its routing; over the limit, where `ordered` (the
    weights' order is a group key), the order decides the kept-weights rule wherever every node the
    token reaches scores its single heaviest weight (one slot per node, or k // M = 1), else it is read."""
    n, k = fan.dest.shape
    over = _spans(layout, fan, home) > max_nodes
    decided = np.zeros(n, dtype=bool)
    if ordered and over.any():
        valid = fan.dest >= 0
        node = np.where(valid, layout.rank_node[np.maximum(fan.dest, 0)], layout.nodes)
        per_node = np.zeros((n, layout.nodes + 1), dtype=np.int64)
        np.add.at(per_node, (np.broadcast_to(np.arange(n)[:, None], (n, k)), node), 1)
        single = (max(1, k // max_nodes) == 1) | (per_node[:, :-1].max(axis=1, initial=0) <= 1)
        decided = over & ~has_logits & single
    return has_logits | (over & ~decided), decided


def _limited_by_group(layout: wire.WireLayout, group, home: np.ndarray, fan: wire.TokenFanout,
                      has_logits: np.ndarray, max_nodes: int) -> tuple[wire.NodeLimited, np.ndarray]:
    """(node-limited routing of a page of groups, the groups whose rows are read one by one instead:
    `_read_apart`). A group the order of its gate weights (`weight_rank`) decides moves the group's
    summed shares of the slots it loses."""
    page = group.routes
    n, k = fan.dest.shape
    valid = fan.dest >= 0
    ids = np.where(valid, page.expert_ids, -1)
    unchanged = wire.NodeLimited(np.zeros(n, dtype=bool), np.zeros(n), fan.remote_nodes, ids)
    apart, decided = _read_apart(layout, fan, home, has_logits, max_nodes, group.weight_rank is not None)
    if not decided.any():
        return unchanged, apart
    # weights in the same order, ties kept: the rule's choice of nodes is the same as on the rows' own
    rank = group.weight_rank[decided]
    order = wire.node_limited(layout, _select(fan, decided), home[decided], page.expert_ids[decided],
                              np.where(rank > 0, k + 1 - rank, 0).astype(np.float64), max_nodes)
    lost = valid[decided] & (order.expert_ids < 0)
    moved = (np.where(lost, group.weight_share[decided], 0.0).sum(axis=1)
             / group.count[decided].astype(np.float64))
    changed, moved_weight = unchanged.changed.copy(), unchanged.moved_weight.copy()
    remote, after = unchanged.remote_nodes.copy(), ids.copy()
    changed[decided], moved_weight[decided] = order.changed, moved
    remote[decided], after[decided] = order.remote_nodes, order.expert_ids
    return wire.NodeLimited(changed, moved_weight, remote, after), apart


def _spans(layout: wire.WireLayout, fan: wire.TokenFanout, home: np.ndarray) -> np.ndarray:
    """(n,) the nodes each token's kept experts run on, its home's included where it has one there."""
    at_home = ((fan.dest >= 0) & (layout.rank_node[np.maximum(fan.dest, 0)]
                                  == layout.rank_node[np.asarray(home, dtype=np.int64)][:, None])).any(axis=1)
    return fan.remote_nodes + at_home


def _limit_rules(layout: wire.WireLayout, page, rows: np.ndarray) -> dict[str, np.ndarray]:
    """{rule: the rows it applies to} among `rows`: DeepSeek-V3's rule on the router's scores ("scores")
    for a token whose router logits were stored, every routed expert's; the kept-weights approximation
    ("kept") for the others."""
    logits = page.logits
    scored = np.zeros(len(rows), dtype=bool)
    if logits is not None and logits.shape[1] >= layout.num_experts:
        scored = ~np.isnan(logits[:, :layout.num_experts]).any(axis=1)
    return {"scores": rows & scored, "kept": rows & ~scored}


def _node_limited(layout: wire.WireLayout, fan: wire.TokenFanout, home: np.ndarray, page, rows: np.ndarray,
                  max_nodes: int, family: str | None, rule: str) -> wire.NodeLimited:
    """The page's `rows` under node-limited routing by `rule` (`_limit_rules`); `fan` and `home` are theirs."""
    ids = page.expert_ids[rows]
    weights = page.gate_weights[rows] if page.gate_weights is not None else np.zeros(ids.shape)
    if rule == "scores":
        scores = wire.router_scores(page.logits[rows][:, :layout.num_experts], family)
        return wire.node_limited_on_scores(layout, fan, home, ids, weights, scores, max_nodes)
    return wire.node_limited(layout, fan, home, ids, weights, max_nodes)


def _select_limited(limited: wire.NodeLimited, pick: np.ndarray) -> wire.NodeLimited:
    return wire.NodeLimited(limited.changed[pick], limited.moved_weight[pick], limited.remote_nodes[pick],
                            limited.expert_ids[pick], limited.rule)


def _select(fan: wire.TokenFanout, pick: np.ndarray) -> wire.TokenFanout:
    return wire.TokenFanout(fan.dest[pick], fan.reached[pick], fan.remote_ranks[pick], fan.remote_nodes[pick],
                            fan.experts[pick])


def coselection_placement(store: Store, run_id: str, like: Placement, rank_node: np.ndarray,
                          tags: dict[str, str] | None = None, step_from: int | None = None,
                          step_to: int | None = None) -> Placement:
    """A placement with `like`'s ranks and slots per rank (its contiguous layout's, one slot per
    expert) that co-locates experts often chosen together, per layer, fitted on the run's
    co-selection counts (`Store.coselection`) in steps `step_from` <= step < `step_to` (None: the
    whole run), each expert's load being the tokens that chose it (the counts' diagonal;
    `moescope.metrics.traffic.coselection_layout`). A layer without co-selection counts keeps the
    contiguous layout. Raises PlacementError where no layer has counts."""
    layers: dict[int, tuple[tuple[int, ...], ...]] = {}
    for row in store.layers(run_id).itertuples():
        layer, experts = int(row.layer), int(row.num_experts)
        counts = store.coselection(run_id, layer, step_from, step_to, tags=tags)
        if counts.shape[0] < experts:
            continue
        counts = counts[:experts, :experts]
        capacity = np.array([len(r) for r in contiguous_layout(experts, like.ranks)])
        per_rank = wire.coselection_layout(counts, np.diag(counts).astype(np.float64), capacity, rank_node)
        layers[layer] = tuple(tuple(r) for r in per_rank)
    if not layers:
        span = "" if step_from is None else f" in steps {step_from}-{step_to - 1 if step_to is not None else ''}"
        raise PlacementError(f"run {run_id!r} recorded no co-selection counts{span} (top-1 routers, or more experts "
                             "than the probe counts pairs for); a co-selection placement needs them")
    return Placement(ranks=like.ranks, layers=layers, source="co-selection placement")


COSELECTION_BY_WINDOW = "co-selection (fitted on the window before)"


def coselection_by_window(store: Store, run_id: str, like: Placement, setup: Wire, window_steps: int,
                          tags: dict[str, str] | None = None) -> tuple[pd.DataFrame, Placement | None]:
    """The co-selection placement as an engine would run it: fitted on each window of `window_steps`
    steps (`coselection_placement`) and scored on the next (`traffic_report`'s figures there).

    Returns (rows, latest): one row per (layer, scored window) with placement
    (`COSELECTION_BY_WINDOW`), fit_start (the first step of the window it was fitted on) and
    `traffic_report`'s columns; and the placement fitted on the run's last window, the one to deploy
    next (None when no window had counts). A window after one without counts is not scored.
    Raises ValueError for window_steps < 1."""
    if window_steps < 1:
        raise ValueError(f"window_steps must be at least 1, not {window_steps}")
    starts = sorted({int(w) for w in store.window_loads(run_id, window_steps, tags).window_start})
    frames, fitted = [], {}
    for start in starts:
        try:
            fitted[start] = coselection_placement(store, run_id, like, setup.rank_node, tags, start,
                                                  start + window_steps)
        except PlacementError:
            continue
        before = start - window_steps
        if before in fitted:
            frame = traffic_report(store, run_id, fitted[before], setup, window_steps, tags, step_from=start,
                                   step_to=start + window_steps).layers
            frames.append(frame.assign(placement=COSELECTION_BY_WINDOW, fit_start=before))
    latest = fitted[max(fitted)] if fitted else None
    if not frames:
        return pd.DataFrame(columns=["placement", "fit_start", *COLUMNS]), latest
    return pd.concat(frames, ignore_index=True)[["placement", "fit_start", *COLUMNS]], latest


def eplb_placement(store: Store, run_id: str, ranks: int, rank_node: np.ndarray, groups: int = 1,
                   redundant: int = 0, tags: dict[str, str] | None = None) -> Placement:
    """DeepSeek's EPLB (`moescope.metrics.eplb.eplb`, issue 35's what-if) fitted on the run's loads
    (the steps carrying `tags`), on `ranks` ranks in the nodes of `rank_node` (the hierarchical
    policy where the nodes are even and divide `groups`, else the global one). Raises
    PlacementError for a run without loads or a shape EPLB cannot place."""
    totals = store.layer_totals(run_id, tags=tags)
    if totals.empty:
        raise PlacementError(f"run {run_id!r} recorded no expert load (under these tags) to fit EPLB on")
    experts = {int(r.num_experts) if pd.notna(r.num_experts) else len(r.expert_load) for r in totals.itertuples()}
    if len(experts) > 1:
        raise PlacementError(f"the run's layers have different expert counts ({sorted(experts)}); EPLB places one")
    width = experts.pop()
    loads = np.stack([np.asarray(r.expert_load[:width], dtype=np.float64) for r in totals.itertuples()])
    sizes = np.bincount(rank_node)
    nodes = len(sizes) if (sizes == sizes[0]).all() else 1
    return eplb(loads, ranks, nodes, groups, redundant, [int(v) for v in totals.layer])


def compare_placements(store: Store, run_id: str, placements: Mapping[str, Placement], setup: Wire,
                       tags: dict[str, str] | None = None) -> pd.DataFrame:
    """The whole run's traffic under each named placement: one row per (placement, layer) with the
    placement's name and `traffic_report`'s columns."""
    frames = []
    for name, placement in placements.items():
        frame = traffic_report(store, run_id, placement, setup, None, tags).layers
        frames.append(frame.assign(placement=name))
    if not frames:
        return pd.DataFrame(columns=["placement", *COLUMNS])
    out = pd.concat(frames, ignore_index=True)
    return out[["placement", *COLUMNS]]


def bytes_text(value: float) -> str:
    """Bytes in the largest unit that keeps a number >= 1 (B, KiB, MiB, GiB)."""
    if not np.isfinite(value):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.1f} {unit}" if unit != "B" else f"{value:,.0f} B"
        value /= 1024
    return f"{value:,.1f} GiB"


"""What a placement costs on the wire: per-token dispatch fan-out over ranks and nodes.

Pure functions of one layer's routes (top-k expert ids, kept slots, gate weights), each token's
home rank, and a placement given as arrays (`WireLayout`). The analysis (`moescope traffic`), the
rules and the Prometheus exporter all count through these, so every view shows the same number.

Conventions, stated once:

- A token's *home rank* is the rank whose attention produced it (the rank that recorded it, or one
  assigned by `home_ranks`). Its kept top-k experts each run on one rank; with redundant slots
  (an expert on several ranks) the copy is chosen by `REPLICA_RULE`.
- *Sends* follow DeepEP: a token is sent once to each remote GPU that holds any of its experts
  (not once per expert), and once to each remote node over RDMA (then forwarded inside the node).
  `remote_ranks` counts the first, `remote_nodes` the second. Combine sends the results back
  along the same links: its rank x rank matrix is the dispatch matrix transposed.
- The *rank matrix* `[h, r]` counts tokens of home rank h that reach rank r: off the diagonal a
  send, on the diagonal a token with at least one expert at home (no wire).
- The *floor* is what a perfect placement with one copy per expert could reach for the same
  routing: a token's k experts need at least m ranks (the fewest ranks whose slots hold k experts),
  and with home ranks independent of the routing (data-parallel attention spreads sequences
  without looking at experts) a reached rank is the home with chance 1/R, so E[remote ranks] >=
  m (1 - 1/R); nodes alike, the m' largest nodes each being home with chance (its ranks) / R.
  Redundant copies can go below it: a copy at home serves the token there whatever its home.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

REPLICA_RULE = ("a token's expert runs on its home rank if a copy is there, else on the lowest-numbered "
                "rank of its home node holding a copy, else on copy number (home rank mod copies) of the "
                "copies on other nodes, in rank order")
HOME_RULES = ("recorded", "sequence", "token")
# how node-limited routing was applied: DeepSeek-V3's rule on the router's scores over all experts
# (`node_limited_on_scores`), or on the kept top-k's gate weights alone (`node_limited`)
LIMIT_RULES = {"scores": "deepseek-v3 on router scores",
               "kept": "kept-weights approximation (no router logits stored)"}
DEFAULT_RANKS_PER_NODE = 8


@dataclass(frozen=True)
class WireLayout:
    """One layer's placement as arrays.

    Attributes:
        slot_rank: (P,) the rank of each physical slot.
        slot_expert: (P,) the logical expert each slot holds.
        rank_node: (R,) the node of each rank (nodes numbered 0..N-1; uneven sizes allowed).
        num_experts: E, the layer's routed experts.
    """

    slot_rank: np.ndarray
    slot_expert: np.ndarray
    rank_node: np.ndarray
    num_experts: int
    serving: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        slot_rank = np.asarray(self.slot_rank, dtype=np.int64)
        slot_expert = np.asarray(self.slot_expert, dtype=np.int64)
        rank_node = np.asarray(self.rank_node, dtype=np.int64)
        object.__setattr__(self, "slot_rank", slot_rank)
        object.__setattr__(self, "slot_expert", slot_expert)
        object.__setattr__(self, "rank_node", rank_node)
        if slot_rank.shape != slot_expert.shape or slot_rank.ndim != 1:
            raise ValueError("slot_rank and slot_expert must be 1-d arrays of the same length (one entry per slot)")
        if rank_node.ndim != 1 or not rank_node.size:
            raise ValueError("rank_node must list the node of every rank")
        if slot_rank.size and (slot_rank.min() < 0 or slot_rank.max() >= rank_node.size):
            raise ValueError(f"a slot is on a rank outside 0..{rank_node.size - 1}")
        if rank_node.min() < 0 or set(np.unique(rank_node).tolist()) != set(range(int(rank_node.max()) + 1)):
            raise ValueError("nodes must be numbered 0..N-1, each holding at least one rank")
        outside = slot_expert[(slot_expert < 0) | (slot_expert >= self.num_experts)]
        if outside.size:
            raise ValueError(f"a slot holds expert {int(outside[0])}, outside 0..{self.num_experts - 1}")
        object.__setattr__(self, "serving", _serving_table(slot_rank, slot_expert, rank_node, self.num_experts))

    @property
    def ranks(self) -> int:
        return int(self.rank_node.size)

    @property
    def nodes(self) -> int:
        return int(self.rank_node.max()) + 1

    def rank_slots(self) -> np.ndarray:
        """(R,) physical slots per rank."""
        return np.bincount(self.slot_rank, minlength=self.ranks)


def _serving_table(slot_rank: np.ndarray, slot_expert: np.ndarray, rank_node: np.ndarray,
                   num_experts: int) -> np.ndarray:
    """(R, E): the rank that serves expert e for a token of home rank h (`REPLICA_RULE`); -1 where
    the expert has no slot."""
    ranks = rank_node.size
    table = np.full((ranks, num_experts), -1, dtype=np.int64)
    for expert in range(num_experts):
        copies = np.unique(slot_rank[slot_expert == expert])  # sorted
        if not copies.size:
            continue
        for home in range(ranks):
            if home in copies:
                table[home, expert] = home
                continue
            near = copies[rank_node[copies] == rank_node[home]]
            if near.size:
                table[home, expert] = near[0]
                continue
            far = copies[rank_node[copies] != rank_node[home]]
            table[home, expert] = far[home % far.size]
    return table


def nodes_from_sizes(sizes: list[int] | tuple[int, ...]) -> np.ndarray:
    """(R,) the node of each rank when consecutive ranks fill nodes of the given sizes.
    Raises ValueError for an empty list or a size below 1."""
    if not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"node sizes must be whole numbers of at least 1, got {list(sizes)}")
    return np.repeat(np.arange(len(sizes)), [int(s) for s in sizes])


def default_rank_node(ranks: int, ranks_per_node: int = DEFAULT_RANKS_PER_NODE) -> np.ndarray:
    """(R,) the node of each rank when consecutive ranks fill nodes of `ranks_per_node` (8, an
    HGX/DGX server's GPUs; the last node may hold fewer). Raises ValueError for a size below 1."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be at least 1, not {ranks_per_node}")
    full, rest = divmod(int(ranks), int(ranks_per_node))
    return nodes_from_sizes([ranks_per_node] * full + ([rest] if rest else []))


def default_home(recording_ranks: int) -> str:
    """The home rule every view uses unless told (`moescope traffic`, the dashboard, the rules engine,
    the Prometheus exporter): "recorded" where more than one rank recorded the routes (a row's rank is
    its token's home), else "token" (the row in its forward's batch modulo R). Not "sequence": an
    imported run holds one request a step with `sequence` the choice index (0 for most), so every
    token would have home 0; spreading rows evenly, apart from their routing, gives each rank 1/R of
    the tokens, as an engine's data-parallel batch does (docs/traffic.md)."""
    return "recorded" if recording_ranks > 1 else "token"


def home_ranks(rule: str, ranks: int, recorded: np.ndarray, sequence: np.ndarray | None,
               token: np.ndarray) -> np.ndarray:
    """Each routed token's home rank under `rule`.

    "recorded": the rank that recorded it (a multi-process run); "sequence": its batch row
    (sequence) modulo R, as data-parallel attention spreads a batch's sequences round-robin over
    its ranks; "token": its row in the forward's batch modulo R (tokens spread evenly).
    Raises ValueError for an unknown rule, a recorded rank outside 0..R-1, or "sequence" without
    sequences.
    """
    if rule == "recorded":
        home = np.asarray(recorded, dtype=np.int64)
        if home.size and (home.min() < 0 or home.max() >= ranks):
            raise ValueError(f"the run recorded rank {int(home.max())}, but the placement has {ranks} ranks; "
                             "give the placement the run's ranks, or spread tokens with --home token")
        return home
    if rule == "sequence":
        if sequence is None:
            raise ValueError("these routes carry no sequence numbers; use --home token")
        return np.asarray(sequence, dtype=np.int64) % ranks
    if rule == "token":
        return np.asarray(token, dtype=np.int64) % ranks
    raise ValueError(f"unknown home rule {rule!r}; choose one of {', '.join(HOME_RULES)}")


@dataclass(frozen=True)
class TokenFanout:
    """Per token of one page of routes: where its kept experts run.

    Attributes:
        dest: (n, k) the rank serving each slot, -1 for a slot not kept (dropped or padding).
        reached: (n, R) bool, the ranks the token reaches (home included where an expert is there).
        remote_ranks: (n,) distinct ranks other than home (DeepEP's GPU sends).
        remote_nodes: (n,) distinct nodes other than home's (DeepEP's RDMA sends).
        experts: (n,) distinct kept experts.
    """

    dest: np.ndarray
    reached: np.ndarray
    remote_ranks: np.ndarray
    remote_nodes: np.ndarray
    experts: np.ndarray


def token_fanout(layout: WireLayout, home: np.ndarray, expert_ids: np.ndarray, kept: np.ndarray) -> TokenFanout:
    """Where each token's kept top-k experts run under `layout` (see `TokenFanout`).

    Experts outside 0..E-1 (zero experts, padding) are never sent anywhere. Raises ValueError for
    a kept expert the layout gives no slot."""
    home = np.asarray(home, dtype=np.int64)
    ids = np.asarray(expert_ids, dtype=np.int64)
    n, k = ids.shape if ids.ndim == 2 else (len(ids), 0)
    valid = np.asarray(kept, dtype=bool) & (ids >= 0) & (ids < layout.num_experts)
    dest = np.full((n, k), -1, dtype=np.int64)
    rows = np.broadcast_to(home[:, None], (n, k))
    dest[valid] = layout.serving[rows[valid], ids[valid]]
    if (valid & (dest < 0)).any():
        missing = int(ids[valid & (dest < 0)][0])
        raise ValueError(f"expert {missing} has no slot in the placement")
    ranks, nodes = layout.ranks, layout.nodes
    reached = np.zeros((n, ranks), dtype=bool)
    token_of = np.broadcast_to(np.arange(n)[:, None], (n, k))
    reached[token_of[valid], dest[valid]] = True
    node_reached = np.zeros((n, nodes), dtype=bool)
    node_reached[token_of[valid], layout.rank_node[dest[valid]]] = True
    remote_ranks = reached.sum(axis=1) - reached[np.arange(n), home]
    remote_nodes = node_reached.sum(axis=1) - node_reached[np.arange(n), layout.rank_node[home]]
    experts = np.zeros((n, layout.num_experts), dtype=bool)
    experts[token_of[valid], ids[valid]] = True
    return TokenFanout(dest, reached, remote_ranks.astype(np.int64), remote_nodes.astype(np.int64),
                       experts.sum(axis=1).astype(np.int64))


def floor_remote(layout: WireLayout, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token, the fewest remote ranks and remote nodes a perfect placement (one copy per expert,
    the layout's slots per rank) could average for a token of `experts` distinct experts, with home
    ranks independent of the routing (module doc).

    Returns (ranks floor, nodes floor), float arrays like `experts`."""
    experts = np.asarray(experts, dtype=np.int64)
    ranks, nodes = layout.ranks, layout.nodes
    per_rank = np.sort(layout.rank_slots())[::-1]
    node_ranks = np.bincount(layout.rank_node, minlength=nodes)
    node_slots = np.sort(np.bincount(layout.rank_node, weights=layout.rank_slots(), minlength=nodes))[::-1]
    home_chance = np.sort(node_ranks / ranks)[::-1]
    # m(k): the fewest ranks (nodes) whose slots add up to k
    need_ranks = np.searchsorted(np.cumsum(per_rank), experts, side="left") + 1
    need_nodes = np.searchsorted(np.cumsum(node_slots), experts, side="left") + 1
    need_ranks = np.where(experts > 0, np.minimum(need_ranks, ranks), 0)
    need_nodes = np.where(experts > 0, np.minimum(need_nodes, nodes), 0)
    rank_floor = need_ranks * (1.0 - 1.0 / ranks)
    chance = np.concatenate([[0.0], np.cumsum(home_chance)])
    node_floor = need_nodes - chance[need_nodes]
    return rank_floor, node_floor


@dataclass(frozen=True)
class NodeLimited:
    """Per token, DeepSeek-V3's node-limited routing applied to its recorded top-k.

    Attributes:
        changed: (n,) bool, the token's kept experts span more nodes than allowed, so its routing
            would change.
        moved_weight: (n,) the share of its kept top-k gate weight on the nodes it may not use.
        remote_nodes: (n,) remote nodes it could reach at most under the limit (its chosen nodes
            other than home's; at most `max_nodes`).
        expert_ids: (n, k) its top-k under the limit (-1: sent nowhere): the rule's own on the router's
            scores (`node_limited_on_scores`); the experts that stay under the kept-weights
            approximation (`node_limited`), which cannot name their replacements.
        rule: which rule gave the figures (a value of `LIMIT_RULES`).
    """

    changed: np.ndarray
    moved_weight: np.ndarray
    remote_nodes: np.ndarray
    expert_ids: np.ndarray
    rule: str = LIMIT_RULES["kept"]


def node_limited(layout: WireLayout, fanout: TokenFanout, home: np.ndarray, expert_ids: np.ndarray,
                 gate_weights: np.ndarray, max_nodes: int) -> NodeLimited:
    """DeepSeek-V3's node-limited routing (at most `max_nodes` nodes per token) on recorded routes.

    The rule: score each node by the sum of the highest k / M affinity scores of the experts it
    holds, keep the M best nodes, take the top-k among their experts. Routes record only the
    top-k, so the scores are the kept slots' gate weights (a per-token rescaling, as top-k
    normalisation makes, changes no choice) and an expert outside the top-k is taken as adding
    nothing to its node; ties go to the lower node. A token whose kept experts span at most M nodes
    keeps its routing; the others lose the weight on the nodes not kept. Their replacements are not
    known (they sit on the kept nodes): `NodeLimited.expert_ids` holds the experts that stay, -1 for
    the others, so the nodes a token reaches under the limit are exact and its ranks a lower bound.
    Raises ValueError for max_nodes < 1."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, not {max_nodes}")
    weights = np.where(fanout.dest >= 0, np.nan_to_num(np.asarray(gate_weights, dtype=np.float64)), 0.0)
    n, k = fanout.dest.shape
    node = np.where(fanout.dest >= 0, layout.rank_node[np.maximum(fanout.dest, 0)], -1)
    per_node = max(1, k // max_nodes)
    order = np.argsort(-weights, axis=1, kind="stable")
    w_sorted = np.take_along_axis(weights, order, axis=1)
    node_sorted = np.take_along_axis(node, order, axis=1)
    same_before = np.zeros((n, k), dtype=np.int64)
    for j in range(1, k):
        same_before[:, j] = (node_sorted[:, :j] == node_sorted[:, j:j + 1]).sum(axis=1)
    counted = (node_sorted >= 0) & (same_before < per_node)
    score = np.zeros((n, layout.nodes))
    rows = np.broadcast_to(np.arange(n)[:, None], (n, k))
    np.add.at(score, (rows[counted], node_sorted[counted]), w_sorted[counted])
    spans = np.zeros((n, layout.nodes), dtype=bool)
    spans[rows[node >= 0], node[node >= 0]] = True
    # the M best nodes among those the token reaches (ties: lower node first)
    rank_of = np.argsort(np.argsort(np.where(spans, -score, np.inf), axis=1, kind="stable"), axis=1)
    allowed = spans & (rank_of < max_nodes)
    changed = spans.sum(axis=1) > max_nodes
    slot_allowed = np.zeros((n, k), dtype=bool)
    slot_allowed[node >= 0] = allowed[rows[node >= 0], node[node >= 0]]
    total = weights.sum(axis=1)
    lost = np.where(node >= 0, weights * ~slot_allowed, 0.0).sum(axis=1)
    moved = np.divide(lost, total, out=np.zeros(n), where=total > 0)
    home_node = layout.rank_node[np.asarray(home, dtype=np.int64)]
    chosen_remote = np.where(changed, max_nodes - allowed[np.arange(n), home_node], fanout.remote_nodes)
    ids = np.where(slot_allowed, np.asarray(expert_ids, dtype=np.int64), -1)  # -1: not sent (any more)
    return NodeLimited(changed, moved, chosen_remote.astype(np.int64), ids)


# Families whose router scores experts by sigmoid(logits) and limits groups DeepSeek-V3's way (each
# one's transformers router: `router_logits.sigmoid()`, then group scores from `topk(2)`); every
# other router's scores are softmax(logits).
SIGMOID_ROUTERS = ("deepseek_v3", "deepseek_v32", "dots1", "exaone_moe", "glm4_moe", "glm4_moe_lite",
                   "mimo_v2_flash", "solar_open")
# DeepSeek-V3's group score: the sum of the group's best two experts (`topk(2, dim=-1)` in its Gate
# and transformers' DeepseekV3TopkRouter; the paper's K_r / M = 8 / 4).
NODE_SCORE_EXPERTS = 2


def router_scores(logits: np.ndarray, family: str | None) -> np.ndarray:
    """(n, E) the router's affinity scores from its logits: sigmoid for `SIGMOID_ROUTERS`, else softmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if family in SIGMOID_ROUTERS:
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def node_limited_on_scores(layout: WireLayout, fanout: TokenFanout, home: np.ndarray, expert_ids: np.ndarray,
                           gate_weights: np.ndarray, scores: np.ndarray, max_nodes: int,
                           per_node: int = NODE_SCORE_EXPERTS) -> NodeLimited:
    """DeepSeek-V3's node-limited routing on the router's scores over all experts, with nodes as groups.

    As its router does (transformers' `DeepseekV3TopkRouter.forward`): each node scores the sum of
    the `per_node` highest scores among the experts it serves to the token (a node serving fewer
    sums those it has), the `max_nodes` best nodes are kept (ties: the lower node), and the token's
    experts are the top-k of the scores within them. A token whose recorded experts all sit on kept
    nodes keeps its routing; otherwise its experts on the other nodes are replaced by the best-scoring
    experts of the kept nodes it did not choose. An expert's node is that of the copy serving the
    token (`REPLICA_RULE`). The correction bias of a DeepSeek-V3 router is not recorded: nodes
    rank by the scores alone, so the rule is exact for a router without one (or with a zero bias).

    `scores` is (n, E) (`router_scores`); `expert_ids`, `gate_weights` the recorded top-k. Returns
    `NodeLimited` with `expert_ids` the routing under the limit. Raises ValueError for
    max_nodes < 1 or scores that are not (tokens, E)."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, not {max_nodes}")
    home = np.asarray(home, dtype=np.int64)
    ids = np.asarray(expert_ids, dtype=np.int64)
    n, k = fanout.dest.shape
    scores = np.asarray(scores, dtype=np.float64)
    if scores.shape != (n, layout.num_experts):
        raise ValueError(f"router scores are {scores.shape}, expected ({n}, {layout.num_experts})")
    serving = layout.serving[home]  # (n, E) rank serving each expert to the token
    expert_node = np.where(serving >= 0, layout.rank_node[np.maximum(serving, 0)], -1)
    node_score = np.full((n, layout.nodes), -np.inf)
    for node in range(layout.nodes):
        masked = np.where(expert_node == node, scores, -np.inf)
        best = -np.sort(-masked, axis=1)[:, :per_node]
        held = np.isfinite(best)
        node_score[:, node] = np.where(held.any(axis=1), np.where(held, best, 0.0).sum(axis=1), -np.inf)
    order = np.argsort(-node_score, axis=1, kind="stable")[:, :max_nodes]
    allowed = np.zeros((n, layout.nodes), dtype=bool)
    np.put_along_axis(allowed, order, True, axis=1)
    allowed &= np.isfinite(node_score)
    valid = fanout.dest >= 0
    rows = np.broadcast_to(np.arange(n)[:, None], (n, k))
    slot_node = np.where(valid, layout.rank_node[np.maximum(fanout.dest, 0)], -1)
    slot_allowed = valid & allowed[rows, np.maximum(slot_node, 0)]
    dropped = valid & ~slot_allowed
    changed = np.asarray(dropped.any(axis=1))
    # the replacements: the best-scoring experts of the kept nodes the token did not choose
    candidate = np.where(allowed[np.arange(n)[:, None], np.maximum(expert_node, 0)] & (expert_node >= 0),
                         scores, -np.inf)
    candidate[rows[valid], ids[valid]] = -np.inf
    ranked = np.argsort(-candidate, axis=1, kind="stable")
    fill = np.cumsum(dropped, axis=1) - 1  # the j-th dropped slot takes the j-th best candidate
    replacement = np.take_along_axis(ranked, np.maximum(fill, 0), axis=1)
    found = np.isfinite(np.take_along_axis(candidate, replacement, axis=1))  # kept nodes hold too few experts
    limited_ids = np.where(dropped, np.where(found, replacement, -1), np.where(valid, ids, -1))
    weights = np.where(valid, np.nan_to_num(np.asarray(gate_weights, dtype=np.float64)), 0.0)
    total = weights.sum(axis=1)
    moved = np.divide(np.where(dropped, weights, 0.0).sum(axis=1), total, out=np.zeros(n), where=total > 0)
    after = token_fanout(layout, home, limited_ids, limited_ids >= 0)
    return NodeLimited(changed, moved, after.remote_nodes, limited_ids, LIMIT_RULES["scores"])


# the figures `TrafficTally.figures` also gives under node-limited routing, each as limited_<name>
LIMITED_FIGURES = ("remote_ranks_mean", "remote_nodes_mean", "remote_ranks_histogram", "remote_nodes_histogram",
                   "rank_matrix", "node_matrix", "gpu_sends", "rdma_sends", "intra_node_share", "busiest_link",
                   "busiest_link_tokens", "busiest_node_link", "busiest_node_link_tokens",
                   "dispatch_bytes_per_forward", "combine_bytes_per_forward", "rdma_dispatch_bytes_per_forward",
                   "rdma_combine_bytes_per_forward")


@dataclass
class TrafficTally:
    """Running sums of one layer's traffic over pages of routes (one window, or one tag)."""

    ranks: int
    nodes: int
    rank_node: np.ndarray
    tokens: int = 0
    remote_ranks_sum: int = 0
    remote_nodes_sum: int = 0
    floor_ranks_sum: float = 0.0
    floor_nodes_sum: float = 0.0
    ranks_histogram: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    nodes_histogram: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rank_matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    forwards: set = field(default_factory=set)
    limited_changed: int = 0
    limited_moved: float = 0.0
    limited_rules: set = field(default_factory=set)
    limited: TrafficTally | None = None  # the same figures under node-limited routing

    def __post_init__(self) -> None:
        self.ranks_histogram = np.zeros(self.ranks, dtype=np.int64)
        self.nodes_histogram = np.zeros(self.nodes, dtype=np.int64)
        self.rank_matrix = np.zeros((self.ranks, self.ranks), dtype=np.int64)

    @classmethod
    def for_layout(cls, layout: WireLayout) -> TrafficTally:
        return cls(layout.ranks, layout.nodes, layout.rank_node)

    def add(self, layout: WireLayout, home: np.ndarray, fanout: TokenFanout, steps: np.ndarray,
            limited: NodeLimited | None = None, counts: np.ndarray | None = None) -> None:
        """Count one page of tokens (their home ranks, fan-out and forwards), and with `limited` the same
        tokens under node-limited routing (`add_limited`). `counts` (n,): the tokens each row stands for
        (rows grouped by home and routing, `moescope.store.queries.RouteGroups`); None: one each."""
        home = np.asarray(home, dtype=np.int64)
        weight = None if counts is None else np.asarray(counts, dtype=np.int64)
        self.tokens += len(home) if weight is None else int(weight.sum())
        self.remote_ranks_sum += int(_total(fanout.remote_ranks, weight))
        self.remote_nodes_sum += int(_total(fanout.remote_nodes, weight))
        floor_ranks, floor_nodes = floor_remote(layout, fanout.experts)
        self.floor_ranks_sum += float(_total(floor_ranks, weight))
        self.floor_nodes_sum += float(_total(floor_nodes, weight))
        self.ranks_histogram += _tally(fanout.remote_ranks, self.ranks, weight)[:self.ranks]
        self.nodes_histogram += _tally(fanout.remote_nodes, self.nodes, weight)[:self.nodes]
        pairs = home[:, None] * self.ranks + np.arange(self.ranks)[None, :]
        self.rank_matrix += _tally(pairs[fanout.reached], self.ranks * self.ranks, weight, fanout.reached).reshape(
            self.ranks, self.ranks)
        self.forwards.update(np.unique(steps).tolist())
        if limited is not None:
            self.add_limited(layout, home, limited, counts)

    def add_limited(self, layout: WireLayout, home: np.ndarray, limited: NodeLimited,
                    counts: np.ndarray | None = None) -> None:
        """Count tokens under node-limited routing alone (their figures without the limit counted apart,
        by `add`): changed tokens, moved weight, the rule, and every figure of the routing under the limit
        (`LIMITED_FIGURES`, per forward over the forwards `add` counted). `counts` as in `add`."""
        home = np.asarray(home, dtype=np.int64)
        weight = None if counts is None else np.asarray(counts, dtype=np.int64)
        self.limited_changed += int(_total(limited.changed.astype(np.int64), weight))
        self.limited_moved += float(_total(limited.moved_weight, weight))
        if len(home):
            self.limited_rules.add(limited.rule)
        if self.limited is None:
            self.limited = TrafficTally.for_layout(layout)
        ids = limited.expert_ids
        self.limited.add(layout, home, token_fanout(layout, home, ids, ids >= 0), np.zeros(0), counts=weight)

    def node_matrix(self) -> np.ndarray:
        """(N, N): the rank matrix summed over node blocks (GPU-level sends; diagonal: within a node)."""
        onehot = np.zeros((self.ranks, self.nodes), dtype=np.int64)
        onehot[np.arange(self.ranks), self.rank_node] = 1
        return onehot.T @ self.rank_matrix @ onehot

    def figures(self, hidden_size: int | None = None, dispatch_bytes: float = 2.0,
                combine_bytes: float = 2.0, forwards: int | None = None) -> dict:
        """The tally's figures (see `moescope.analyses.traffic.TrafficReport` for each column); with
        node-limited routing counted, also each of `LIMITED_FIGURES` under it as limited_<name>.
        `forwards`: the forwards bytes are counted over (None: those the tally saw)."""
        tokens = self.tokens
        sends = self.rank_matrix.copy()
        np.fill_diagonal(sends, 0)
        total_sends = int(sends.sum())
        same_node = self.rank_node[:, None] == self.rank_node[None, :]
        intra = int(sends[same_node].sum())
        busiest = np.unravel_index(int(np.argmax(sends)), sends.shape) if total_sends else (-1, -1)
        node_sends = self.node_matrix()
        np.fill_diagonal(node_sends, 0)
        busiest_node = (np.unravel_index(int(np.argmax(node_sends)), node_sends.shape)
                        if node_sends.sum() else (-1, -1))
        forwards = len(self.forwards) if forwards is None else int(forwards)

        def per_forward(count: float, element_bytes: float) -> float:
            if hidden_size is None or not forwards:
                return float("nan")
            return count * hidden_size * element_bytes / forwards

        def mean(total: float) -> float:
            return total / tokens if tokens else float("nan")

        out = dict(
            tokens=tokens, forwards=forwards,
            remote_ranks_mean=mean(self.remote_ranks_sum), remote_nodes_mean=mean(self.remote_nodes_sum),
            floor_remote_ranks=mean(self.floor_ranks_sum), floor_remote_nodes=mean(self.floor_nodes_sum),
            remote_ranks_histogram=self.ranks_histogram.copy(), remote_nodes_histogram=self.nodes_histogram.copy(),
            rank_matrix=self.rank_matrix.copy(), node_matrix=self.node_matrix(),
            gpu_sends=total_sends, rdma_sends=self.remote_nodes_sum,
            intra_node_share=intra / total_sends if total_sends else float("nan"),
            busiest_link=(int(busiest[0]), int(busiest[1])),
            busiest_link_tokens=int(sends[busiest]) if total_sends else 0,
            busiest_node_link=(int(busiest_node[0]), int(busiest_node[1])),
            busiest_node_link_tokens=int(node_sends[busiest_node]) if node_sends.sum() else 0,
            dispatch_bytes_per_forward=per_forward(total_sends, dispatch_bytes),
            combine_bytes_per_forward=per_forward(total_sends, combine_bytes),
            rdma_dispatch_bytes_per_forward=per_forward(self.remote_nodes_sum, dispatch_bytes),
            rdma_combine_bytes_per_forward=per_forward(self.remote_nodes_sum, combine_bytes),
            limited_changed_share=mean(self.limited_changed),
            limited_moved_weight=mean(self.limited_moved),
            limited_moved_weight_changed=(self.limited_moved / self.limited_changed if self.limited_changed
                                          else 0.0 if tokens else float("nan")),
            limited_rule=" + ".join(sorted(self.limited_rules)) if self.limited_rules else None,
        )
        under = (self.limited.figures(hidden_size, dispatch_bytes, combine_bytes, forwards)
                 if self.limited is not None else {})
        for name in LIMITED_FIGURES:
            out[f"limited_{name}"] = under.get(name, float("nan"))
        return out


def _total(values: np.ndarray, weight: np.ndarray | None) -> float:
    return values.sum() if weight is None else (values * weight).sum()


def _tally(values: np.ndarray, width: int, weight: np.ndarray | None, where: np.ndarray | None = None) -> np.ndarray:
    """Counts of each value, each row weighted (`where`: the (n, m) mask `values` was taken by)."""
    w = weight if weight is None or where is None else np.broadcast_to(weight[:, None], where.shape)[where]
    out = np.bincount(values, weights=None if w is None else w.astype(np.float64), minlength=width)
    return np.rint(out).astype(np.int64)  # integer counts below 2**53: exact in float64


def coselection_layout(coselection: np.ndarray, load: np.ndarray, rank_capacity: np.ndarray,
                       rank_node: np.ndarray) -> list[list[int]]:
    """A placement that puts experts often chosen together on the same node, then the same rank.

    Greedy and hierarchical: experts are shared out over nodes (capacity: the slots of the node's
    ranks), then within each node over its ranks. A group is seeded with the heaviest expert left;
    then the group with the least load that has room takes the expert left with the most
    co-selections with its members (ties: the heavier, then the lower id), so load stays spread.
    `coselection` is (E, E) tokens choosing both; `load` (E,) tokens per expert. Returns per rank
    its experts (one slot each). Raises ValueError when the ranks hold fewer slots than experts.
    """
    coselection = np.asarray(coselection, dtype=np.float64)
    load = np.asarray(load, dtype=np.float64)
    rank_capacity = np.asarray(rank_capacity, dtype=np.int64)
    rank_node = np.asarray(rank_node, dtype=np.int64)
    experts = load.size
    if coselection.shape != (experts, experts):
        raise ValueError(f"co-selection counts are {coselection.shape}, expected ({experts}, {experts})")
    if rank_capacity.sum() < experts:
        raise ValueError(f"{experts} experts do not fit in {int(rank_capacity.sum())} slots")
    pair = coselection.copy()
    np.fill_diagonal(pair, 0.0)
    nodes = int(rank_node.max()) + 1
    node_groups = _group(list(range(experts)), pair, load,
                         [int(rank_capacity[rank_node == n].sum()) for n in range(nodes)])
    out: list[list[int]] = [[] for _ in range(rank_node.size)]
    for n, members in enumerate(node_groups):
        node_ranks = np.flatnonzero(rank_node == n)
        for r, group in zip(node_ranks, _group(members, pair, load, [int(rank_capacity[r]) for r in node_ranks])):
            out[int(r)] = sorted(group)
    return out


def _group(members: list[int], pair: np.ndarray, load: np.ndarray, capacity: list[int]) -> list[list[int]]:
    left = sorted(members, key=lambda e: (-load[e], e))
    groups: list[list[int]] = [[] for _ in capacity]
    weight = [0.0] * len(capacity)
    while left:
        open_groups = [g for g in range(len(capacity)) if len(groups[g]) < capacity[g]]
        g = min(open_groups, key=lambda g: (weight[g], g))
        if groups[g]:
            affinity = pair[np.ix_(left, groups[g])].sum(axis=1)
            best = max(range(len(left)), key=lambda i: (affinity[i], load[left[i]], -left[i]))
        else:
            best = 0
        expert = left.pop(best)
        groups[g].append(expert)
        weight[g] += load[expert]
    return groups

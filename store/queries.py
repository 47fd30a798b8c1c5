"""Typed queries over a store, for the dashboard and the alerts engine.

Every aggregate is computed inside DuckDB; Python only reshapes small results (a list per layer,
an E x E matrix). Conventions shared by every query:

- A step window is half-open: `step_from <= step < step_to`; None leaves that side open.
- `tags` filters rows whose step tags hold every given key=value (`{"split": "eval"}`).
- Rows of all ranks of a run are summed: a run's step n is every rank's step n.
- An unknown run or an empty window gives an empty result, never an error; `latest_run` is the
  one query that raises EmptyStoreError ("no data yet").
- Expert ids are 0-based positions in `expert_load` (routed experts first, then zero experts).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import pyarrow as pa

from moescope.store.errors import EmptyStoreError, UnknownRunError


@dataclass(frozen=True)
class Selection:
    """A slice of a store to compare: a run, optionally narrowed to tag values and a step window.

    Args:
        run_id: the run.
        tags: keep only the steps carrying every one of these key=value tags (default: no filter).
        step_from: first forward kept (inclusive); None: from the start.
        step_to: first forward left out: the window is half-open, `step_from <= step < step_to`;
            None: to the end.
    """

    run_id: str
    tags: dict[str, str] = field(default_factory=dict)
    step_from: int | None = None
    step_to: int | None = None


# Steps a selection covers: a row covers `forwards` forwards (a window; 1 in stores written before
# windows existed), and every rank sees every step, so the forwards of all rows over the ranks.
STEPS = "(sum(coalesce(forwards, 1)) / count(DISTINCT rank))::BIGINT"
# routes rows `StoreQueries.route_groups` counts in one query: its memory bound where no two rows share a
# group (2 M rows of top-8 are about 200 MB in Arrow and numpy together)
GROUP_PAGE_ROWS = 1 << 21


def where(run_id: str, layer: int | None = None, step_from: int | None = None, step_to: int | None = None,
          tags: dict[str, str] | None = None) -> tuple[str, list]:
    """A WHERE clause of fixed SQL fragments and its parameters: values never enter the text."""
    clauses: list[str] = ["run_id = ?"]
    params: list[object] = [str(run_id)]
    if layer is not None:
        clauses.append("layer = ?")
        params.append(int(layer))
    if step_from is not None:
        clauses.append("step >= ?")
        params.append(int(step_from))
    if step_to is not None:
        clauses.append("step < ?")
        params.append(int(step_to))
    for key, value in (tags or {}).items():
        clauses.append("map_extract_value(tags, ?) = ?")
        params += [str(key), str(value)]
    return " AND ".join(clauses), params


@dataclass(frozen=True)
class RoutePage:
    """Consecutive routes rows of one layer, in recording order (step, rank, token).

    `expert_ids` is (rows, k) int64 in the router's slot order, padded with -1 where a row holds
    fewer than k slots; `kept` is (rows, k) bool, False on padding and on slots dropped at
    capacity (True where the source did not record drops).
    """

    step: np.ndarray  # (rows,) int64
    rank: np.ndarray  # (rows,) int32
    token: np.ndarray  # (rows,) int32, row in its forward's flattened batch
    expert_ids: np.ndarray
    kept: np.ndarray
    sequence: np.ndarray | None = None  # (rows,) int32 batch row, read with `weights=True`
    gate_weights: np.ndarray | None = None  # (rows, k) float32, 0 on padding, read with `weights=True`
    logits: np.ndarray | None = None  # (rows, E) float32 router logits, NaN where none was kept, `logits=True`
    copy: np.ndarray | None = None  # (rows, k) int64 copy number of each slot's expert, `SlotCopies`
    has_logits: np.ndarray | None = None  # (rows,) bool: a `router_logits` row holds the row's logits


@dataclass(frozen=True)
class SlotCopies:
    """Which copy of its expert each slot of a routes row takes, numbered where the rows are
    (`StoreQueries.route_groups`): copy number = counter mod copies[expert] for a kept slot whose
    expert (0 <= e < len(copies)) has more than one copy; 0 for every other slot.

    The counters, each an engine's (`moescope.metrics.dispatch.COPY_COUNTERS` names which):
    "position", the slot's flat place in its forward's top-k ids, token * k + slot (k: the layer's
    top-k, its longest `expert_ids`); "block", block + n, plus the row's rank mod `rank_modulo` where
    given, with block = (token * k + slot) // `block_slots` and n the number of kept slots of the same
    expert before it in its (step, rank, block), in (token, slot) order (a window over the page's slots,
    after which a row is a (step, rank, token) again: a layer records one row per token of a forward
    and rank).
    """

    copies: tuple[int, ...]
    counter: str = "position"
    block_slots: int = 1024
    rank_modulo: int | None = None

    def __post_init__(self) -> None:
        if self.counter not in ("position", "block"):
            raise ValueError(f"unknown copy counter {self.counter!r}: position or block")
        if self.block_slots < 1 or (self.rank_modulo is not None and self.rank_modulo < 1):
            raise ValueError("block_slots and rank_modulo must be at least 1")
        if any(int(c) < 0 for c in self.copies):
            raise ValueError("copy counts cannot be negative")


@dataclass(frozen=True)
class RouteGroups:
    """A page of one layer's routes rows counted by group (`StoreQueries.route_groups`).

    `routes` has one row per group: `step` holds the group's window (step // window_steps; 0 for the
    whole run), `rank`, `token` and `sequence` the keys asked for (0 where not asked), `expert_ids` and
    `kept` as `RoutePage` reads them, `copy` each slot's copy number where `SlotCopies` were asked for;
    `count` (groups,) int64 the rows each group stands for; `steps` the page's steps that hold rows of
    the layer (sorted), for the figures that count forwards. With `logits_key`: `routes.has_logits`, the
    group's rows have router logits stored (a key too). With `keyed` or `logits_key`: `key` (groups,)
    int64 the group's key apart from its window, by which `StoreQueries.rows_of_groups` reads a group's
    rows back one by one.
    With `weight_order`: `weight_rank` (groups, k) int64, each slot's place among the row's kept slots of
    experts 0..E-1 by gate weight (1 + the slots heavier: equal weights, equal places; a NaN or missing
    weight is 0; 0 for the other slots), a key too; and `weight_share` (groups, k) float64, the sum over the
    group's rows of each such slot's share of the row's weight on them (0 where that is 0).
    """

    window: np.ndarray
    routes: RoutePage
    count: np.ndarray
    steps: np.ndarray
    key: np.ndarray | None = None
    weight_rank: np.ndarray | None = None
    weight_share: np.ndarray | None = None


def _padded(column: pa.ChunkedArray | pa.Array, fill: float, dtype: type) -> np.ndarray:
    """A list column as a (rows, longest list) array, `fill` where a list is shorter or null."""
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = lists.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    width = int(lengths.max()) if len(lengths) else 0
    out: np.ndarray = np.full((len(lists), width), fill, dtype=dtype)
    values = lists.flatten().to_numpy(zero_copy_only=False)
    if values.size:
        rows = np.repeat(np.arange(len(lists)), lengths)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, np.arange(values.size) - starts] = values
    return out


def _step_pages(sizes: np.ndarray, page_rows: int) -> Iterator[tuple[int, int]]:
    """(first, last) indexes of consecutive steps holding about `page_rows` rows together (a step alone
    when it holds more)."""
    ends = np.cumsum(sizes)
    first = 0
    while first < len(sizes):
        last = max(first, int(np.searchsorted(ends, ends[first] - sizes[first] + page_rows, side="right")) - 1)
        yield first, last
        first = last + 1


@dataclass(frozen=True)
class _GroupKeys:
    """The SQL of `StoreQueries.route_groups`' keys: the window, then the recorded rank, token and sequence
    keys asked for (0 where not); `params` are the values of their placeholders, in that order."""

    window_steps: int | None
    by_rank: bool
    token_modulo: int | None
    sequence_modulo: int | None

    def __post_init__(self) -> None:
        for name in ("window_steps", "token_modulo", "sequence_modulo"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")

    @property
    def window(self) -> str:
        return "0::BIGINT" if self.window_steps is None else "step // ?"

    @property
    def others(self) -> list[str]:
        """The rank, token and sequence keys' expressions."""
        return ["rank" if self.by_rank else "0::INTEGER",
                "0::INTEGER" if self.token_modulo is None else "token % ?",
                "0::INTEGER" if self.sequence_modulo is None else "coalesce(sequence, 0) % ?"]

    @property
    def params(self) -> list[int]:
        return [int(v) for v in (self.window_steps, self.token_modulo, self.sequence_modulo) if v is not None]

    @staticmethod
    def hash(keys: list[str], width: int, ids: str, kept: str) -> str:
        """A group's key apart from its window: a 63-bit hash of its rank, token and sequence keys and its
        slots (`ids` and `kept` format slot `{j}`, 0-based, and `{j1}`, 1-based)."""
        slots = [part.format(j=j, j1=j + 1) for j in range(width) for part in (ids, kept)]
        return f"(hash({', '.join([*keys, *slots])}) >> 1)::BIGINT"

    def query(self, width: int, clause: str, params: list, slot_copies: SlotCopies | None,
              logits: tuple[str, list] | None, weight_order: int | None = None,
              keyed: bool = False) -> tuple[str, list]:
        """The grouping query over one page's rows under `clause` (with `params`), and all its parameters;
        `logits`: the clause (and parameters) of the `router_logits` rows that mark a row's logits stored;
        `weight_order` E: the gate weights' order as keys, their shares as sums (`RouteGroups`)."""
        rank_key, token_key, sequence_key = self.others
        mark, mark_params = "", []
        if logits is not None:
            mark = f"""LEFT JOIN (SELECT DISTINCT step, rank, token, true AS lg FROM router_logits
                                  WHERE {logits[0]} AND logits IS NOT NULL) l USING (step, rank, token)"""
            mark_params = logits[1]
        rows = f"""r AS (SELECT step, rank, token, {self.window} AS w, {rank_key} AS rk, {token_key} AS tk,
                               {sequence_key} AS sk, expert_ids, kept, gate_weights,
                               {"coalesce(lg, false)" if logits is not None else "false"} AS lg
                        FROM routes {mark} WHERE {clause})"""
        head = [[int(c) for c in (slot_copies.copies if slot_copies is not None else ())],
                *self.params, *mark_params, *params]
        experts = 0 if slot_copies is None else len(slot_copies.copies)
        if slot_copies is None or slot_copies.counter == "position":
            ids, kept = "expert_ids[{j1}]", "kept[{j1}]"
            slots = "".join(f", {ids.format(j1=j + 1)} AS e{j}, {kept.format(j1=j + 1)} AS k{j}" for j in range(width))
            if slot_copies is not None:
                slots += "".join(f""", CASE WHEN coalesce(kept[{j + 1}], true) AND expert_ids[{j + 1}] BETWEEN 0
                                        AND {experts - 1} AND cp.copies[expert_ids[{j + 1}] + 1] > 1
                                   THEN (token * {width} + {j}) % cp.copies[expert_ids[{j + 1}] + 1] ELSE 0 END
                                   AS c{j}""" for j in range(width))
            key = "" if not keyed else f", {self.hash(['rk', 'tk', 'sk'], width, ids, kept)} AS key"
            sums, source = "", "r"
            if weight_order is not None:
                # a slot's weight where it counts (a kept slot of a routed expert; NaN or missing: 0), else NULL,
                # once per row (v{j}), and their sum (vt)
                weight = ", ".join(f"""(CASE WHEN coalesce(kept[{j + 1}], true) AND expert_ids[{j + 1}] BETWEEN 0
                                    AND {int(weight_order) - 1} THEN CASE WHEN isnan(coalesce(gate_weights[{j + 1}], 0))
                                    THEN 0 ELSE coalesce(gate_weights[{j + 1}], 0) END::DOUBLE END) AS v{j}"""
                                   for j in range(width))
                total = " + ".join(f"coalesce(v{j}, 0)" for j in range(width)) or "0"
                source = (f"(SELECT *, {total} AS vt FROM (SELECT *{', ' if width else ''}{weight} FROM r))")
                # its place: 1 + the slots heavier than it (equal weights, equal places; the order is all
                # that counts, so places need not be consecutive)
                slots += "".join(
                    f", CASE WHEN v{j} IS NULL THEN 0 ELSE 1"
                    + "".join(f" + coalesce((v{i} > v{j})::INTEGER, 0)" for i in range(width) if i != j)
                    + f" END AS o{j}" for j in range(width))
                sums = "".join(f", sum(CASE WHEN vt > 0 THEN coalesce(v{j}, 0) / vt ELSE 0 END) AS s{j}"
                               for j in range(width))
            return (f"""WITH cp AS (SELECT ?::INTEGER[] AS copies), {rows}
                        SELECT w, rk AS rank, tk AS token, sk AS sequence{slots}, lg AS logits{key}{sums},
                               count(*)::BIGINT AS n
                        FROM {source}, cp GROUP BY ALL ORDER BY ALL""", head)
        if weight_order is not None:
            raise ValueError("weight_order goes with the position counter or none")
        # the block counter: a slot's place among the earlier kept slots of its expert in its (step, rank,
        # block), a window over the slots of the experts with copies alone; a row without one is grouped
        # as it is, a row with one is a row again after the window (a row per (step, rank, token))
        offset = "0" if slot_copies.rank_modulo is None else f"rank % {int(slot_copies.rank_modulo)}"
        copies_of = [f"""CASE WHEN coalesce(kept[{j + 1}], true) AND expert_ids[{j + 1}] BETWEEN 0 AND {experts - 1}
                          THEN cp.copies[expert_ids[{j + 1}] + 1] ELSE 0 END""" for j in range(width)]
        scalars = "".join(f", expert_ids[{j + 1}] AS e{j}, kept[{j + 1}] AS k{j}, {copies_of[j]} AS n{j}"
                          for j in range(width))
        keys = "w, rk, tk, sk, lg" + "".join(f", e{j}, k{j}" for j in range(width))

        def slot(name: str) -> str:  # the slot's own of the row's per-slot columns
            return "CASE j " + " ".join(f"WHEN {j} THEN {name}{j}" for j in range(width)) + " END"
        pivot = "".join(f", any_value(e{j}) AS e{j}, any_value(k{j}) AS k{j}, max(c) FILTER (WHERE j = {j}) AS c{j}"
                        for j in range(width))
        slots = "".join(f", e{j}, k{j}, coalesce(c{j}, 0) AS c{j}" for j in range(width))
        key = "" if not keyed else f", {self.hash(['rk', 'tk', 'sk'], width, 'e{j}', 'k{j}')} AS key"
        return (f"""
            WITH cp AS (SELECT ?::INTEGER[] AS copies), {rows},
                 x AS (SELECT step, rank, token, w, rk, tk, sk, lg{scalars} FROM r, cp),
                 s AS (SELECT *, unnest(range({width})) AS j FROM x
                       WHERE greatest({", ".join(f"n{j}" for j in range(width)) or "0"}, 0) > 1),
                 v AS (SELECT *, {slot("n")} AS ne, (token * {width} + j) // {int(slot_copies.block_slots)} AS block,
                              {slot("e")} AS e FROM s),
                 c AS (SELECT *, (block + {offset} + row_number() OVER (
                                  PARTITION BY step, rank, block, e ORDER BY token, j) - 1) % ne AS c
                       FROM v WHERE ne > 1),
                 t AS (SELECT any_value(w) AS w, any_value(rk) AS rk, any_value(tk) AS tk, any_value(sk) AS sk,
                              any_value(lg) AS lg{pivot} FROM c GROUP BY step, rank, token),
                 u AS (SELECT {keys}{"".join(f", NULL::BIGINT AS c{j}" for j in range(width))} FROM x
                       WHERE greatest({", ".join(f"n{j}" for j in range(width)) or "0"}, 0) <= 1
                       UNION ALL BY NAME SELECT * FROM t)
            SELECT w, rk AS rank, tk AS token, sk AS sequence{slots}, lg AS logits{key}, count(*)::BIGINT AS n
            FROM u GROUP BY ALL ORDER BY ALL""", head)


def _route_page(table: pa.Table) -> RoutePage:
    ids = _padded(table.column("expert_ids"), -1, np.int64)
    extra = {}
    if "gate_weights" in table.column_names:
        weights = _padded(table.column("gate_weights"), 0.0, np.float32)
        padded = np.zeros(ids.shape, dtype=np.float32)
        width = min(weights.shape[1], ids.shape[1])
        padded[:, :width] = weights[:, :width]
        extra = dict(sequence=table.column("sequence").to_numpy(zero_copy_only=False).astype(np.int32),
                     gate_weights=padded)
    if "logits" in table.column_names:
        extra["logits"] = _padded(table.column("logits"), np.nan, np.float32)
    kept = _padded(table.column("kept"), True, bool)
    if kept.shape[1] < ids.shape[1]:  # a source that recorded no drops: every slot it names ran
        kept = np.hstack([kept, np.ones((len(kept), ids.shape[1] - kept.shape[1]), dtype=bool)])
    return RoutePage(step=table.column("step").to_numpy().astype(np.int64),
                     rank=table.column("rank").to_numpy().astype(np.int32),
                     token=table.column("token").to_numpy().astype(np.int32),
                     expert_ids=ids, kept=kept[:, :ids.shape[1]] & (ids >= 0), **extra)


def _unnest_load(clause: str, extra: str = "") -> str:
    """Layer steps exploded to one row per (step, layer, expert): the base of the load queries."""
    return (f"SELECT layer, step, {extra} unnest(expert_load) AS load, "
            f"unnest(range(len(expert_load)))::INTEGER AS expert FROM layer_steps WHERE {clause}")


def _vectors(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    frame[column] = [np.asarray(v, dtype=np.int64) for v in frame[column]]
    return frame


class StoreQueries:
    """Mixed into `moescope.store.Store`; every method runs through `self.sql` (parameters, error mapping)."""

    root: str  # the store's folder (named in errors)

    def sql(self, query: str, params: Sequence | None = None) -> pd.DataFrame:  # pragma: no cover
        raise NotImplementedError

    def arrow(self, query: str, params: Sequence | None = None) -> pa.Table:  # pragma: no cover
        raise NotImplementedError

    # -- runs ----------------------------------------------------------------------------------

    def runs(self) -> pd.DataFrame:
        """One row per run, oldest first.

        Columns: run_id, started_at (UTC), model_class, total_params, routed_expert_params,
        tags (dict), world_size, ranks (ranks that wrote), steps (distinct steps), tokens (all
        ranks), last_ts (time of the newest step).
        """
        frame = self.sql(f"""
            WITH s AS (SELECT run_id, {STEPS} AS steps, coalesce(sum(tokens), 0) AS tokens,
                              max(ts) AS last_ts FROM steps GROUP BY run_id)
            SELECT r.run_id, min(r.started_at) AS started_at, any_value(r.model_class) AS model_class,
                   any_value(r.total_params) AS total_params,
                   any_value(r.routed_expert_params) AS routed_expert_params,
                   any_value(r.tags) AS tags, max(r.world_size) AS world_size,
                   count(DISTINCT r.rank) AS ranks, coalesce(any_value(s.steps), 0) AS steps,
                   coalesce(any_value(s.tokens), 0)::BIGINT AS tokens, any_value(s.last_ts) AS last_ts
            FROM runs r LEFT JOIN s USING (run_id) GROUP BY r.run_id ORDER BY started_at, run_id""")
        frame["tags"] = [dict(t) if t is not None else {} for t in frame["tags"]]
        return frame

    def check_run(self, run_id: str | None) -> str:
        """`run_id` if the store holds it, else (None) its latest run. Raises UnknownRunError naming
        the latest run, or EmptyStoreError when the store holds none."""
        if run_id is None:
            return self.latest_run()
        if self.sql("SELECT 1 FROM runs WHERE run_id = ? LIMIT 1", [str(run_id)]).empty:
            raise UnknownRunError(f"run {run_id!r} is not in the store {self.root!r} (its latest run is "
                                  f"{self.latest_run()!r}): give a run id it holds, or leave out the run "
                                  f"for the latest")
        return str(run_id)

    def latest_run(self) -> str:
        """The id of the most recently started run; raises EmptyStoreError when there is none."""
        runs = self.sql("SELECT run_id FROM runs ORDER BY started_at DESC, run_id DESC LIMIT 1")
        if runs.empty:
            raise EmptyStoreError(f"no data yet: the store {self.root!r} holds no run. Record one first")
        return str(runs.run_id[0])

    def tag_values(self, run_id: str) -> pd.DataFrame:
        """Step tags seen in a run: columns key, value, steps (distinct steps carrying it)."""
        return self.sql(f"""
            SELECT t.key AS key, t.value AS value, {STEPS} AS steps
            FROM (SELECT step, forwards, rank, unnest(map_entries(tags)) AS t FROM steps WHERE run_id = ?)
            GROUP BY ALL ORDER BY ALL""", [run_id])

    def ended_runs(self) -> pd.DataFrame:
        """Runs whose every rank closed its session: run_id, ended_at (UTC, the last rank's),
        last_step (the last forward any rank recorded; NaN when none recorded a forward)."""
        return self.sql("""
            WITH e AS (SELECT run_id, count(DISTINCT rank) AS ranks, max(ended_at) AS ended_at,
                              max(last_step) AS last_step FROM run_ends GROUP BY run_id),
                 r AS (SELECT run_id, max(world_size) AS world_size FROM runs GROUP BY run_id)
            SELECT e.run_id, e.ended_at, e.last_step FROM e JOIN r USING (run_id)
            WHERE e.ranks >= coalesce(r.world_size, 1) ORDER BY e.run_id""")

    def layers(self, run_id: str) -> pd.DataFrame:
        """The run's MoE layers: layer, module, family, num_experts, zero_experts, top_k, ..."""
        return self.sql("SELECT DISTINCT * EXCLUDE (rank) FROM layers WHERE run_id = ? ORDER BY layer",
                        [run_id])

    # -- load ----------------------------------------------------------------------------------

    def load_matrix(self, run_id: str, layer: int, bucket_steps: int = 1, step_from: int | None = None,
                    step_to: int | None = None, tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Tokens per expert per step bucket of one layer, for a heatmap.

        Returns a long frame: step_bucket (first step of the bucket; buckets are aligned to
        multiples of bucket_steps), expert, load (kept slots, all ranks). Raises ValueError for
        bucket_steps < 1.
        """
        if bucket_steps < 1:
            raise ValueError(f"bucket_steps must be at least 1, not {bucket_steps}")
        clause, params = where(run_id, layer, step_from, step_to, tags)
        return self.sql(f"""
            SELECT (step // ?) * ? AS step_bucket, expert, sum(load)::BIGINT AS load
            FROM ({_unnest_load(clause)}) GROUP BY ALL ORDER BY step_bucket, expert""",
                        [int(bucket_steps), int(bucket_steps), *params])

    def load_per_step(self, run_id: str, layer: int) -> pd.DataFrame:
        """Tokens per expert at each step of one layer: columns step, expert, load."""
        return self.load_matrix(run_id, layer).rename(columns={"step_bucket": "step"})

    def expert_share(self, run_id: str, step_from: int | None = None, step_to: int | None = None,
                     tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Layer x expert load over a window: columns layer, expert, load, share (of the layer's)."""
        clause, params = where(run_id, None, step_from, step_to, tags)
        return self.sql(f"""
            WITH t AS (SELECT layer, expert, sum(load) AS load FROM ({_unnest_load(clause)}) GROUP BY ALL)
            SELECT layer, expert, load::BIGINT AS load,
                   load / nullif(sum(load) OVER (PARTITION BY layer), 0) AS share
            FROM t ORDER BY layer, expert""", params)

    def coselection(self, run_id: str, layer: int, step_from: int | None = None, step_to: int | None = None,
                    tags: dict[str, str] | None = None) -> np.ndarray:
        """Tokens that chose both expert i and expert j, summed over a window: an (E, E) int64 array.

        The diagonal is each expert's token count. Returns a (0, 0) array when the window has no
        co-selection counts (none recorded: top-1 routers, or more experts than the probe's limit).
        """
        clause, params = where(run_id, layer, step_from, step_to, tags)
        flat = self.sql(f"""
            SELECT i, sum(v)::BIGINT AS v FROM (
                SELECT unnest(coselection) AS v, unnest(range(len(coselection))) AS i
                FROM layer_steps WHERE {clause} AND coselection IS NOT NULL)
            GROUP BY i ORDER BY i""", params)
        size = int(round(np.sqrt(len(flat))))
        if size * size != len(flat):
            raise ValueError(f"co-selection lists of layer {layer} in run {run_id!r} have mixed lengths")
        return flat["v"].to_numpy(np.int64).reshape(size, size)

    # -- drift ---------------------------------------------------------------------------------

    def load_distribution(self, run_id: str, layer: int | None = None, step_from: int | None = None,
                          step_to: int | None = None, tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Expert load vector per layer over one window (a baseline, say).

        Columns: layer, steps, tokens, expert_load (np.ndarray of int64, index = expert).
        """
        clause, params = where(run_id, layer, step_from, step_to, tags)
        return _vectors(self.sql(f"""
            WITH p AS (SELECT layer, expert, sum(load) AS load FROM ({_unnest_load(clause)}) GROUP BY ALL),
                 s AS (SELECT layer, {STEPS} AS steps, sum(tokens)::BIGINT AS tokens
                       FROM layer_steps WHERE {clause} GROUP BY layer)
            SELECT layer, any_value(s.steps) AS steps, any_value(s.tokens) AS tokens,
                   list(p.load::BIGINT ORDER BY p.expert) AS expert_load
            FROM p JOIN s USING (layer) GROUP BY layer ORDER BY layer""", params + params), "expert_load")

    def load_windows(self, run_id: str, window_steps: int, layer: int | None = None,
                     step_from: int | None = None, step_to: int | None = None,
                     tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Expert load vector per layer and per window of `window_steps` steps (aligned to multiples).

        Columns: layer, window_start, window_end (exclusive), last_step (the last step recorded in
        the window: the run's last step for its final, partial window), steps, tokens, expert_load
        (np.ndarray of int64). Raises ValueError for window_steps < 1.
        """
        if window_steps < 1:
            raise ValueError(f"window_steps must be at least 1, not {window_steps}")
        clause, params = where(run_id, layer, step_from, step_to, tags)
        w = int(window_steps)
        return _vectors(self.sql(f"""
            WITH p AS (SELECT layer, step // ? AS w, expert, sum(load) AS load
                       FROM ({_unnest_load(clause)}) GROUP BY ALL),
                 s AS (SELECT layer, step // ? AS w, {STEPS} AS steps, sum(tokens)::BIGINT AS tokens,
                              max(coalesce(step_end, step)) AS last_step
                       FROM layer_steps WHERE {clause} GROUP BY ALL)
            SELECT layer, w * ? AS window_start, (w + 1) * ? AS window_end, any_value(s.last_step) AS last_step,
                   any_value(s.steps) AS steps,
                   any_value(s.tokens) AS tokens, list(p.load::BIGINT ORDER BY p.expert) AS expert_load
            FROM p JOIN s USING (layer, w) GROUP BY layer, w ORDER BY layer, window_start""",
                                 [w, *params, w, *params, w, w]), "expert_load")

    def drift_windows(self, run_id: str, window_steps: int, baseline_run: str | None = None,
                      baseline_steps: tuple[int | None, int | None] | None = None, layer: int | None = None,
                      step_from: int | None = None, step_to: int | None = None) -> pd.DataFrame:
        """Each window's expert load next to a baseline's, per layer: the input of drift alerts.

        The baseline is `baseline_run` (its `baseline_steps` window, or all of it), or else the
        `baseline_steps` window of this run, or else this run's first window. Columns: those of
        `load_windows` plus baseline_load (np.ndarray of int64, same experts) and baseline_tokens;
        windows of layers the baseline lacks are left out.
        """
        windows = self.load_windows(run_id, window_steps, layer, step_from, step_to)
        if windows.empty:
            return windows.assign(baseline_load=[], baseline_tokens=[])
        if baseline_run is None and baseline_steps is None:
            first = int(windows.window_start.min())
            baseline_steps = (first, first + int(window_steps))
        start, end = baseline_steps or (None, None)
        base = self.load_distribution(baseline_run or run_id, layer, start, end)
        base = base.rename(columns={"expert_load": "baseline_load", "tokens": "baseline_tokens"})
        return windows.merge(base[["layer", "baseline_load", "baseline_tokens"]], on="layer", how="inner")

    # -- tokens --------------------------------------------------------------------------------

    def expert_routes(self, run_id: str, layer: int, expert: int, step_from: int | None = None,
                      step_to: int | None = None, tags: dict[str, str] | None = None,
                      limit: int = 1000) -> pd.DataFrame:
        """Tokens that layer `layer` routed to `expert`, oldest first, at most `limit` rows.

        Columns: step, rank, token (row in the flattened batch), sequence, position, token_id
        (None where the layer did not see input ids), slot (0 = the router's first choice),
        gate_weight, kept (False where a capacity limit dropped it), tags (dict). Needs
        `routes=True` at attach; empty otherwise.
        """
        e = int(expert)
        # The layer's recorded load says in which steps the expert got tokens: find the step by
        # which it had `limit` of them, and scan routes only up to there. Compacted files are
        # sorted by (layer, step), so the bound skips all but a few row groups. Kept load never
        # exceeds the routed rows (dropped slots are rows too), so the bound never cuts short.
        clause, params = where(run_id, layer, step_from, step_to, tags)
        bound = self.sql(f"""
            SELECT step FROM (
                SELECT step, sum(sum(expert_load[?])) OVER (ORDER BY step) AS reached
                FROM layer_steps WHERE {clause} GROUP BY step)
            WHERE reached >= ? ORDER BY step LIMIT 1""", [e + 1, *params, int(limit)])
        if not bound.empty:
            end = int(bound.step[0]) + 1
            clause, params = where(run_id, layer, step_from, end if step_to is None else min(end, step_to), tags)
        frame = self.sql(f"""
            SELECT step, rank, token, sequence, position, token_id,
                   list_position(expert_ids, ?::INTEGER) - 1 AS slot,
                   gate_weights[list_position(expert_ids, ?::INTEGER)] AS gate_weight,
                   kept[list_position(expert_ids, ?::INTEGER)] AS kept, tags
            FROM routes WHERE {clause} AND list_contains(expert_ids, ?::INTEGER)
            ORDER BY step, rank, token LIMIT ?""", [e, e, e, *params, e, int(limit)])
        frame["tags"] = [dict(t) if t is not None else {} for t in frame["tags"]]
        return frame

    def routes_in_order(self, run_id: str, layer: int, step_from: int | None = None, step_to: int | None = None,
                        tags: dict[str, str] | None = None, page_rows: int = 65_536,
                        weights: bool = False, logits: bool = False) -> Iterator[RoutePage]:
        """One layer's routes rows in recording order (step, rank, token), a page at a time.

        `weights=True` also reads each row's sequence and gate weights (`RoutePage.sequence`,
        `RoutePage.gate_weights`; null sequences read as 0). `logits=True` also reads the row's
        router logits from the `router_logits` table, matched on (step, rank, token)
        (`RoutePage.logits`: NaN rows where the run kept none for the token, as with
        `router_logits=n` sampling or `router_logits=False`).

        Pages hold whole steps, about `page_rows` rows each (more when one step holds more), so a
        long run streams in bounded memory; each page is one query over the steps it covers.
        Yields nothing for an unknown run or a store without routes (`routes=True` at attach).
        Raises ValueError for page_rows < 1.
        """
        if page_rows < 1:
            raise ValueError(f"page_rows must be at least 1, not {page_rows}")
        clause, params = where(run_id, layer, step_from, step_to, tags)
        extra = ", coalesce(sequence, 0) AS sequence, gate_weights" if weights else ""
        counts = self.sql(f"SELECT step, count(*)::BIGINT AS n FROM routes WHERE {clause} GROUP BY step "
                          "ORDER BY step", params)
        steps, sizes = counts.step.to_numpy(np.int64), counts.n.to_numpy(np.int64)
        first = 0
        while first < len(steps):
            last, rows = first, int(sizes[first])
            while last + 1 < len(steps) and rows + int(sizes[last + 1]) <= page_rows:
                last += 1
                rows += int(sizes[last])
            page_clause, page_params = where(run_id, layer, int(steps[first]), int(steps[last]) + 1, tags)
            query = f"SELECT step, rank, token, expert_ids, kept{extra} FROM routes WHERE {page_clause}"
            if logits:
                logits_clause, logits_params = where(run_id, layer, int(steps[first]), int(steps[last]) + 1)
                query = f"""
                    SELECT r.*, l.logits FROM ({query}) r LEFT JOIN (
                        SELECT step, rank, token, any_value(logits) AS logits FROM router_logits
                        WHERE {logits_clause} GROUP BY step, rank, token) l USING (step, rank, token)"""
                page_params = [*page_params, *logits_params]
            yield _route_page(self.arrow(f"{query} ORDER BY step, rank, token", page_params))
            first = last + 1

    def route_groups(self, run_id: str, layer: int, window_steps: int | None = None, step_from: int | None = None,
                     step_to: int | None = None, tags: dict[str, str] | None = None, by_rank: bool = False,
                     token_modulo: int | None = None, sequence_modulo: int | None = None,
                     page_rows: int | None = None, slot_copies: SlotCopies | None = None,
                     logits_key: bool = False, keyed: bool = False,
                     weight_order: int | None = None) -> Iterator[RouteGroups]:
        """One layer's routes rows counted by what a per-token figure reads of them, a page of steps at a time.

        Rows that agree on their window (`step // window_steps`; 0 for None), `expert_ids`, `kept`
        and the keys asked for (`by_rank`: the recorded rank; `token_modulo` m: token mod m;
        `sequence_modulo` m: sequence mod m, null as 0; `slot_copies`: each slot's copy number, an
        engine's choice of copy counted in the store; `logits_key`: whether the row's router logits are
        stored; `weight_order` E: the order of the gate weights of its kept slots of experts 0..E-1) are
        one group (with `RouteGroups.key` where `keyed` or `logits_key`); a figure that is a sum over
        tokens of a function of those columns is the sum over groups of the function times the group's
        count, so DuckDB counts the rows and Python sees a row per group (`RouteGroups`).
        Pages hold whole steps, about `page_rows` rows each (None: `GROUP_PAGE_ROWS`; more when one
        step holds more), and are counted in DuckDB one query each, so memory is bounded by the page
        whatever the run's length; groups come sorted (by window, keys, routing), so sums over them
        are the same at every call.
        Yields nothing for an unknown run or a store without routes. Raises ValueError for
        page_rows, window_steps or a modulo below 1.
        """
        keys = _GroupKeys(window_steps, by_rank, token_modulo, sequence_modulo)
        steps, width, pages = self._group_pages(run_id, layer, step_from, step_to, tags, page_rows)
        for first, last in pages:
            page_clause, page_params = where(run_id, layer, int(steps[first]), int(steps[last]) + 1, tags)
            logits_clause, logits_params = where(run_id, layer, int(steps[first]), int(steps[last]) + 1)
            query, query_params = keys.query(width, page_clause, page_params, slot_copies,
                                             (logits_clause, logits_params) if logits_key else None, weight_order,
                                             keyed or logits_key)
            table = self.arrow(query, query_params)
            ids = np.full((table.num_rows, width), -1, dtype=np.int64)
            kept = np.ones((table.num_rows, width), dtype=bool)
            copy = np.zeros((table.num_rows, width), dtype=np.int64) if slot_copies is not None else None
            for j in range(width):
                ids[:, j] = table.column(f"e{j}").fill_null(-1).to_numpy().astype(np.int64)
                kept[:, j] = table.column(f"k{j}").fill_null(True).to_numpy(zero_copy_only=False)
                if copy is not None:
                    copy[:, j] = table.column(f"c{j}").fill_null(0).to_numpy().astype(np.int64)
            window = table.column("w").to_numpy().astype(np.int64)
            order = None
            if weight_order is not None:
                order = (np.zeros((table.num_rows, width), dtype=np.int64), np.zeros((table.num_rows, width)))
                for j in range(width):
                    order[0][:, j] = table.column(f"o{j}").to_numpy().astype(np.int64)
                    order[1][:, j] = table.column(f"s{j}").to_numpy().astype(np.float64)
            yield RouteGroups(window, RoutePage(
                step=window, rank=table.column("rank").to_numpy().astype(np.int32),
                token=table.column("token").to_numpy().astype(np.int32), expert_ids=ids, kept=kept & (ids >= 0),
                sequence=table.column("sequence").to_numpy().astype(np.int32), copy=copy,
                has_logits=table.column("logits").to_numpy(zero_copy_only=False).astype(bool) if logits_key
                else None), table.column("n").to_numpy().astype(np.int64), steps[first:last + 1],
                table.column("key").to_numpy().astype(np.int64) if keyed or logits_key else None,
                *(order or (None, None)))

    def _group_pages(self, run_id: str, layer: int, step_from: int | None, step_to: int | None,
                     tags: dict[str, str] | None, page_rows: int | None) -> tuple[np.ndarray, int, list]:
        """(the steps, the routing's width, pages of whole steps as (first, last) indices into the steps
        of about `page_rows` rows each) of a layer's routes rows: what `route_groups` and
        `rows_of_groups` page by. Raises ValueError for page_rows below 1."""
        page_rows = GROUP_PAGE_ROWS if page_rows is None else page_rows
        if page_rows < 1:
            raise ValueError(f"page_rows must be at least 1, not {page_rows}")
        steps, sizes, width = self._step_sizes(*where(run_id, layer, step_from, step_to, tags))
        return steps, width, list(_step_pages(sizes, page_rows))

    def has_router_logits(self, run_id: str, layer: int, step_from: int | None = None,
                          step_to: int | None = None) -> bool:
        """Whether the run stored router logits of `layer` in steps `step_from` <= step < `step_to`."""
        clause, params = where(run_id, layer, step_from, step_to)
        found = self.sql(f"SELECT EXISTS (SELECT 1 FROM router_logits WHERE {clause} AND logits IS NOT NULL) AS x",
                         params)
        return bool(found.x.iloc[0])

    def rows_of_groups(self, run_id: str, layer: int, group_keys: Sequence[int], step_from: int | None = None,
                       step_to: int | None = None, tags: dict[str, str] | None = None, by_rank: bool = False,
                       token_modulo: int | None = None, sequence_modulo: int | None = None,
                       page_rows: int | None = None) -> Iterator[RoutePage]:
        """The routes rows of the groups `route_groups(logits_key=True)` gave the keys `group_keys`
        (`RouteGroups.key`, with the same keys asked for), and every row whose router logits are stored,
        one by one with their gate weights, sequence and logits (as `routes_in_order(weights=True,
        logits=True)` reads them; `RoutePage.has_logits` too), in no set order, a page of steps at a time.
        A row of another group may come too where two keys collide (the key is a 63-bit hash): a caller
        tells its rows by their routing. Raises ValueError for page_rows or a modulo below 1."""
        keys = _GroupKeys(None, by_rank, token_modulo, sequence_modulo)
        steps, width, pages = self._group_pages(run_id, layer, step_from, step_to, tags, page_rows)
        wanted = [int(k) for k in group_keys]
        for first, last in pages:
            page_clause, page_params = where(run_id, layer, int(steps[first]), int(steps[last]) + 1, tags)
            logits_clause, logits_params = where(run_id, layer, int(steps[first]), int(steps[last]) + 1)
            table = self.arrow(f"""
                WITH r AS (SELECT step, rank, token, expert_ids, kept, coalesce(sequence, 0) AS sequence, gate_weights,
                                  {keys.hash(keys.others, width, "expert_ids[{j1}]", "kept[{j1}]")} AS key
                           FROM routes WHERE {page_clause}),
                     l AS (SELECT step, rank, token, any_value(logits) AS logits FROM router_logits
                           WHERE {logits_clause} AND logits IS NOT NULL GROUP BY step, rank, token)
                SELECT r.step, r.rank, r.token, r.expert_ids, r.kept, r.sequence, r.gate_weights, l.logits
                FROM r LEFT JOIN l USING (step, rank, token)
                WHERE l.logits IS NOT NULL OR r.key IN (SELECT unnest(?::BIGINT[]))""",
                [*keys.params, *page_params, *logits_params, wanted])
            yield replace(_route_page(table), has_logits=table.column("logits").is_valid().to_numpy(
                zero_copy_only=False))

    def _step_sizes(self, clause: str, params: list) -> tuple[np.ndarray, np.ndarray, int]:
        """(steps, rows of each, the longest expert_ids list) of the routes rows under `clause`."""
        counts = self.sql(f"""SELECT step, count(*)::BIGINT AS n, coalesce(max(len(expert_ids)), 0) AS k
                              FROM routes WHERE {clause} GROUP BY step ORDER BY step""", params)
        width = int(counts.k.max()) if len(counts) else 0
        return counts.step.to_numpy(np.int64), counts.n.to_numpy(np.int64), width

    # -- breakdowns and comparisons ------------------------------------------------------------

    def tag_breakdown(self, run_id: str, key: str, step_from: int | None = None,
                      step_to: int | None = None) -> pd.DataFrame:
        """Per value of tag `key` (None: steps without it) and per layer.

        Columns: tag_value, layer, steps, tokens, active_param_fraction (token-weighted mean over
        the value's steps), router_entropy_mean (token-weighted, nats), load_entropy (entropy of
        the summed expert load, nats), dropped_tokens.
        """
        clause, params = where(run_id, None, step_from, step_to)
        return self.sql(f"""
            WITH ls AS (SELECT *, map_extract_value(tags, ?) AS tag_value FROM layer_steps WHERE {clause}),
                 st AS (SELECT map_extract_value(tags, ?) AS tag_value,
                               sum(active_param_fraction * tokens) / nullif(sum(tokens), 0) AS active_param_fraction
                        FROM steps WHERE {clause} GROUP BY ALL),
                 per AS (SELECT tag_value, layer, {STEPS} AS steps, sum(tokens)::BIGINT AS tokens,
                                sum(router_entropy_mean * tokens) / nullif(sum(tokens), 0) AS router_entropy_mean,
                                sum(dropped_tokens)::BIGINT AS dropped_tokens
                         FROM ls GROUP BY ALL),
                 load AS (SELECT tag_value, layer, expert, sum(load) AS load FROM (
                              SELECT tag_value, layer, unnest(expert_load) AS load,
                                     unnest(range(len(expert_load))) AS expert FROM ls) GROUP BY ALL),
                 ent AS (SELECT tag_value, layer,
                                -sum(CASE WHEN load > 0 THEN p * ln(p) ELSE 0 END) AS load_entropy
                         FROM (SELECT *, load / nullif(sum(load) OVER (PARTITION BY tag_value, layer), 0) AS p
                               FROM load) GROUP BY ALL)
            SELECT per.tag_value, per.layer, per.steps, per.tokens, st.active_param_fraction,
                   per.router_entropy_mean, ent.load_entropy, per.dropped_tokens
            FROM per LEFT JOIN st ON per.tag_value IS NOT DISTINCT FROM st.tag_value
                     LEFT JOIN ent ON per.tag_value IS NOT DISTINCT FROM ent.tag_value AND per.layer = ent.layer
            ORDER BY per.tag_value NULLS LAST, per.layer""", [str(key), *params, str(key), *params])

    def compare(self, a: Selection, b: Selection) -> pd.DataFrame:
        """Layer x expert load share of two selections side by side.

        Columns: layer, expert, load_a, load_b, share_a, share_b, delta (share_b - share_a).
        An expert missing on one side has load 0 and share 0 there (NaN share if that side has no
        rows for the layer at all).
        """
        clause_a, params_a = where(a.run_id, None, a.step_from, a.step_to, a.tags)
        clause_b, params_b = where(b.run_id, None, b.step_from, b.step_to, b.tags)
        return self.sql(f"""
            WITH la AS (SELECT layer, expert, sum(load) AS load FROM ({_unnest_load(clause_a)}) GROUP BY ALL),
                 lb AS (SELECT layer, expert, sum(load) AS load FROM ({_unnest_load(clause_b)}) GROUP BY ALL),
                 j AS (SELECT layer, expert, coalesce(la.load, 0) AS load_a, coalesce(lb.load, 0) AS load_b
                       FROM la FULL OUTER JOIN lb USING (layer, expert))
            SELECT layer, expert, load_a::BIGINT AS load_a, load_b::BIGINT AS load_b,
                   load_a / nullif(sum(load_a) OVER (PARTITION BY layer), 0) AS share_a,
                   load_b / nullif(sum(load_b) OVER (PARTITION BY layer), 0) AS share_b,
                   share_b - share_a AS delta
            FROM j ORDER BY layer, expert""", params_a + params_b)

    def compare_runs(self, run_a: str, run_b: str) -> pd.DataFrame:
        """`compare` of two whole runs."""
        return self.compare(Selection(run_a), Selection(run_b))

    def compare_tags(self, run_id: str, key: str, value_a: str, value_b: str) -> pd.DataFrame:
        """`compare` of the steps tagged key=value_a against those tagged key=value_b, in one run."""
        return self.compare(Selection(run_id, {key: value_a}), Selection(run_id, {key: value_b}))

    def compare_summary(self, a: Selection, b: Selection) -> pd.DataFrame:
        """Headline figures of two selections: one row per side ("a", "b").

        Columns: side, steps, tokens, active_param_fraction (token-weighted), router_entropy_mean
        (token-weighted over layers and steps), dropped_tokens.
        """
        parts, params = [], []
        for side, sel in (("a", a), ("b", b)):
            clause, p = where(sel.run_id, None, sel.step_from, sel.step_to, sel.tags)
            parts.append(f"""
                SELECT ? AS side,
                       (SELECT {STEPS} FROM steps WHERE {clause}) AS steps,
                       (SELECT coalesce(sum(tokens), 0)::BIGINT FROM steps WHERE {clause}) AS tokens,
                       (SELECT sum(active_param_fraction * tokens) / nullif(sum(tokens), 0)
                          FROM steps WHERE {clause}) AS active_param_fraction,
                       (SELECT sum(router_entropy_mean * tokens) / nullif(sum(tokens), 0)
                          FROM layer_steps WHERE {clause}) AS router_entropy_mean,
                       (SELECT coalesce(sum(dropped_tokens), 0)::BIGINT
                          FROM layer_steps WHERE {clause}) AS dropped_tokens""")
            params += [side, *p, *p, *p, *p, *p]
        return self.sql(" UNION ALL ".join(parts) + " ORDER BY side", params)

    # -- the probe's own accounting ------------------------------------------------------------

    def probe_stats(self, run_id: str) -> pd.DataFrame:
        """Rows written and dropped per table and reason, over all writers of a run.

        Each writer (host, rank, pid) writes cumulative snapshots; this sums the latest of each.
        Rows of files a reader quarantined are counted under reason 'quarantined', one counter per
        file (rank -1, no host, pid a hash of the file: see `moescope.store.catalog.count_lost`). Columns:
        table_name, reason (None on the written row), written_rows, dropped_rows, dropped_records.
        """
        return self.sql("""
            WITH latest AS (SELECT *, max(ts) OVER (PARTITION BY host, rank, pid) AS last_ts
                            FROM probe_stats WHERE run_id = ?)
            SELECT table_name, reason, sum(written_rows)::BIGINT AS written_rows,
                   sum(dropped_rows)::BIGINT AS dropped_rows, sum(dropped_records)::BIGINT AS dropped_records
            FROM latest WHERE ts = last_ts GROUP BY ALL ORDER BY table_name, reason NULLS FIRST""", [run_id])

    # -- training (moescope.training) ----------------------------------------------------------

    def training_span(self, run_id: str) -> dict[str, int]:
        """What a run recorded with `moescope.training`: optimizer_steps (distinct optimizer steps in
        `train_steps`), first_optimizer_step and last_optimizer_step (1-based update counts; 0 when
        none), layers (MoE layers with a row). All 0 for a run recorded without the training monitor."""
        frame = self.sql("""
            SELECT count(DISTINCT optimizer_step)::BIGINT AS optimizer_steps,
                   coalesce(min(optimizer_step), 0)::BIGINT AS first_optimizer_step,
                   coalesce(max(optimizer_step), 0)::BIGINT AS last_optimizer_step,
                   count(DISTINCT layer)::BIGINT AS layers
            FROM train_steps WHERE run_id = ?""", [run_id])
        return {k: int(v) for k, v in frame.iloc[0].items()}

    def training_steps(self, run_id: str, layer: int | None = None, first_optimizer_step: int | None = None,
                       last_optimizer_step: int | None = None) -> pd.DataFrame:
        """Per optimizer step and MoE layer: the `train_steps` row next to the `layer_steps` row of
        the same forwards (joined on run_id, rank, step, layer), ranks summed; optimizer steps in
        [first_optimizer_step, last_optimizer_step] (inclusive; None leaves that side open), which is
        how a caller bounds the result. Steps recorded without the training monitor (eval forwards,
        plain `moescope.attach`) have no `train_steps` row and are left out.

        Columns: optimizer_step (1-based update count), step, step_end (the forwards the update's
        record covers), ts (UTC, the record's), layer, ranks (ranks that recorded it), tokens (tokens
        the layer routed, all ranks), lr (first parameter group's), router_lr (the lr the router's
        parameters were updated with, a routing cooldown's factor included), expert_grad_norm
        (np.ndarray of float64 per routed expert: L2 norm of its weight gradients, the lowest rank's;
        None where the experts had no gradient), router_entropy_mean (token-weighted mean per-token
        router entropy, nats), router_z_sum (sum over tokens of logsumexp(router logits)^2),
        router_topk_load (np.ndarray of int64 per router choice: tokens whose top-k held it, before
        drops), router_prob_sum (np.ndarray of float64: summed router probabilities), expert_load
        (np.ndarray of int64: kept slots per expert, routed experts first, then zero experts),
        num_experts (routed experts, from `layers`), zero_experts. The three aux-loss inputs are
        None (NaN for router_z_sum) in stores written before they were recorded.
        """
        clause, params = where(run_id, layer)
        bounds, bound_params = "", []
        if first_optimizer_step is not None:
            bounds += " AND optimizer_step >= ?"
            bound_params.append(int(first_optimizer_step))
        if last_optimizer_step is not None:
            bounds += " AND optimizer_step <= ?"
            bound_params.append(int(last_optimizer_step))
        frame = self.sql(f"""
            WITH t AS (SELECT * FROM train_steps WHERE {clause}{bounds}),
                 j AS (SELECT t.optimizer_step, t.step, t.step_end, t.ts, t.layer, t.rank, t.lr, t.router_lr,
                              t.expert_grad_norm, l.tokens, l.router_entropy_mean, l.router_z_sum,
                              l.router_topk_load, l.router_prob_sum, l.expert_load
                       FROM t JOIN (SELECT * FROM layer_steps WHERE {clause}) l
                         ON l.run_id = t.run_id AND l.rank = t.rank AND l.step = t.step AND l.layer = t.layer),
                 v AS (SELECT optimizer_step, layer, i, sum(load) AS load, sum(topk) AS topk, sum(prob) AS prob
                       FROM (SELECT optimizer_step, layer, unnest(range(len(expert_load))) AS i,
                                    unnest(expert_load) AS load, unnest(router_topk_load) AS topk,
                                    unnest(router_prob_sum) AS prob FROM j)
                       GROUP BY ALL),
                 vec AS (SELECT optimizer_step, layer, list(load::BIGINT ORDER BY i) AS expert_load,
                                CASE WHEN count(topk) = count(*) THEN list(topk::BIGINT ORDER BY i) END
                                    AS router_topk_load,
                                CASE WHEN count(prob) = count(*) THEN list(prob ORDER BY i) END AS router_prob_sum
                         FROM v GROUP BY ALL),
                 s AS (SELECT optimizer_step, min(step) AS step, max(coalesce(step_end, step)) AS step_end,
                              max(ts) AS ts, layer, count(DISTINCT rank)::BIGINT AS ranks,
                              sum(tokens)::BIGINT AS tokens, max(lr) AS lr, max(router_lr) AS router_lr,
                              arg_min(expert_grad_norm, rank) AS expert_grad_norm,
                              sum(router_entropy_mean * tokens)
                                  / nullif(sum(CASE WHEN router_entropy_mean IS NOT NULL THEN tokens END), 0)
                                  AS router_entropy_mean,
                              sum(router_z_sum) AS router_z_sum
                       FROM j GROUP BY optimizer_step, layer),
                 info AS (SELECT layer, any_value(num_experts) AS num_experts,
                                 coalesce(any_value(zero_experts), 0) AS zero_experts
                          FROM layers WHERE run_id = ? GROUP BY layer)
            SELECT s.optimizer_step, s.step, s.step_end, s.ts, s.layer, s.ranks, s.tokens, s.lr, s.router_lr,
                   s.expert_grad_norm, s.router_entropy_mean, s.router_z_sum, vec.router_topk_load,
                   vec.router_prob_sum, vec.expert_load, info.num_experts, info.zero_experts
            FROM s LEFT JOIN vec USING (optimizer_step, layer) LEFT JOIN info USING (layer)
            ORDER BY s.optimizer_step, s.layer""", [*params, *bound_params, *params, run_id])
        for column, dtype in (("expert_grad_norm", np.float64), ("router_topk_load", np.int64),
                              ("router_prob_sum", np.float64), ("expert_load", np.int64)):
            frame[column] = [None if v is None or (np.isscalar(v) and pd.isna(v)) else np.asarray(v, dtype=dtype)
                             for v in frame[column]]
        return frame

    def routing_cooldown_events(self, run_id: str, layer: int | None = None) -> pd.DataFrame:
        """The run's routing cooldown starts, ends and blocked starts (`routing_cooldown_events`,
        alerts/cooldown_policy.py), oldest first: step (optimizer steps done when the change was
        made: a start at s and its end at e cooled the updates s+1..e), forward_step, ts (UTC), layer,
        action ("start", "end", "blocked"), lr_factor, epsilon, lr_before, lr_after (the router's lr
        in force around the change), reason, router_entropy (normalised), capacity_use, source
        ("auto" or "manual"), period_steps (a start's planned length, an end's actual length, in
        optimizer steps), rank. At most 10,000 rows (the latest)."""
        clause, params = where(run_id, layer)
        frame = self.sql(f"""
            SELECT step, forward_step, ts, layer, action, lr_factor, epsilon, lr_before, lr_after, reason,
                   router_entropy, capacity_use, source, period_steps, rank
            FROM routing_cooldown_events WHERE {clause}
            ORDER BY step DESC, ts DESC, layer DESC, rank DESC LIMIT 10000""", params)
        return frame.iloc[::-1].reset_index(drop=True)

    def gate_requests(self, run_id: str, limit: int = 10_000) -> pd.DataFrame:
        """Manual trust-gate requests for a run (`trust_gate_requests`, written by the dashboard's
        dashboard/gate_requests.py), oldest first: request_id, run_id, requested_at (UTC), layer,
        expert, action ("override" or "release"), weight (in [0, 1]; 1.0 for a release), reason,
        requested_by. At most `limit` rows (the latest)."""
        frame = self.sql("""
            SELECT request_id, run_id, requested_at, layer, expert, action, weight, reason, requested_by
            FROM trust_gate_requests WHERE run_id = ?
            ORDER BY requested_at DESC, request_id DESC LIMIT ?""", [str(run_id), int(limit)])
        return frame.iloc[::-1].reset_index(drop=True)

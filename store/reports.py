"""The queries behind every view: `moescope summary`, the dashboard's pages and the demo.

Mixed into `moescope.store.Store` next to `moescope.store.queries.StoreQueries` (same conventions: half-open step
windows, `tags` filters, ranks summed, `?` parameters only, an unknown run is an empty answer).
Each method returns a small frame or dict whose columns and units its docstring names; views
only cache and draw them, and `moescope.metrics.signals` turns them into the derived figures (spread,
normalised entropy, rates, specialisation). Means of per-row means are weighted by tokens
(`TOKEN_WEIGHTED`), the rule `moescope.metrics.signals.token_weighted_mean` states.

Every result is bounded: by a LIMIT, by a bounded number of step buckets, or, for the per-window
placement figures (`ReportQueries.rank_loads`, `ReportQueries.window_loads`), by the figure's own
shape: one row per layer, window and rank (or expert), every one of which the figure needs, so none is
cut (a row limit there dropped the last layers and part of a window's ranks, read as zero load).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from moescope.store.queries import STEPS, _unnest_load, _vectors, where
from moescope.store.schema import SCHEMAS

MAX_BUCKETS = 240  # points on a step axis; more steps than this are summed into buckets
MAX_TOKENS_LISTED = 500
MAX_ENGINE_ROUTES = 50_000_000  # routes rows one mismatch check reads (a (token, layer) pair each)
MAX_SAMPLE = 5000
MAX_TABLE_ROWS = 5000
MAX_TAG_ROWS = 262144
MAX_HOSTS = 1024
UNKNOWN_HOST = "?"  # a rank without a `runs` row naming its host (not written yet, or an older store)
# A CTE `h`: each rank of run `?` and the host its `runs` rows name (hosts joined by '+' where one
# rank was recorded on several, e.g. a job resumed elsewhere: its rows are counted once, under both).
HOST_OF_RANK = """h AS (SELECT rank, string_agg(DISTINCT host, '+' ORDER BY host) AS host
                       FROM runs WHERE run_id = ? AND host IS NOT NULL GROUP BY rank)"""


def token_weighted(column: str) -> str:
    """SQL for the token-weighted mean of `column` over a group's rows (a fixed fragment: `column`
    is one of ours, never a user's). Rows where the column is NULL (not recorded) count in neither
    sum, as in `moescope.metrics.signals.token_weighted_mean`."""
    return f"(sum({column} * tokens) / nullif(sum(CASE WHEN {column} IS NOT NULL THEN tokens END), 0))"


def _buckets(table: str, clause: str) -> str:
    """A CTE `b` with the first step (s0) and bucket width (w) that fit a run in `?` buckets."""
    return f"""b AS (SELECT coalesce(min(step), 0) AS s0,
                        greatest(1, ceil((max(coalesce(step_end, step)) - min(step) + 1) / ?::DOUBLE))::BIGINT AS w
                 FROM {table} WHERE {clause})"""


class ReportQueries:
    """Mixed into `moescope.store.Store`; every method runs through `self.sql`."""

    def sql(self, query: str, params: Sequence | None = None) -> pd.DataFrame:  # pragma: no cover
        raise NotImplementedError

    def arrow(self, query: str, params: Sequence | None = None) -> pa.Table:  # pragma: no cover
        raise NotImplementedError

    # -- the run -------------------------------------------------------------------------------

    def run_info(self, run_id: str) -> dict[str, Any] | None:
        """What the run is: model_class, total_params, routed_expert_params (parameter counts),
        source ("probe", or the engine an importer read; "probe" where not recorded), started_at
        (UTC), as the query's row holds them (numpy and pandas scalars, NaN or None where not
        recorded). None for an unknown run."""
        frame = self.sql("""
            SELECT any_value(model_class) AS model_class, max(total_params) AS total_params,
                   max(routed_expert_params) AS routed_expert_params,
                   coalesce(any_value(source), 'probe') AS source, min(started_at) AS started_at
            FROM runs WHERE run_id = ? GROUP BY run_id""", [run_id])
        return None if frame.empty else frame.iloc[0].to_dict()

    def step_totals(self, run_id: str, tags: dict[str, str] | None = None) -> dict[str, Any]:
        """Totals over a run's recorded rows (a row is a forward or a window of forwards).

        Keys: steps (forwards per rank: `STEPS`), forwards (forward passes summed over the ranks, a
        windowed row counting its forwards), ranks (distinct ranks), tokens (summed over the ranks),
        first_step, last_step (step numbers), active_fraction
        (token-weighted share of all parameters used per token), active_min, active_p5,
        active_p50, active_p95, active_max (over rows), active_params (token-weighted parameters
        per token), seconds_per_token (forward wall time / tokens), seconds_per_token_p50 (over
        rows), total_params, first_ts, last_ts (UTC). steps, forwards, ranks and tokens are 0 for no row.
        `moescope.metrics.signals.run_counts` makes the headline of forwards and tokens from them.
        """
        clause, params = where(run_id, tags=tags)
        frame = self.sql(f"""
            SELECT coalesce({STEPS}, 0) AS steps, coalesce(sum(coalesce(forwards, 1)), 0)::BIGINT AS forwards,
                   count(DISTINCT rank)::BIGINT AS ranks, coalesce(sum(tokens), 0)::BIGINT AS tokens,
                   min(step) AS first_step, max(coalesce(step_end, step)) AS last_step,
                   {token_weighted("active_param_fraction")} AS active_fraction,
                   min(active_param_fraction) AS active_min,
                   quantile_cont(active_param_fraction, 0.05) AS active_p5,
                   quantile_cont(active_param_fraction, 0.5) AS active_p50,
                   quantile_cont(active_param_fraction, 0.95) AS active_p95,
                   max(active_param_fraction) AS active_max,
                   {token_weighted("active_params")} AS active_params,
                   sum(duration_s) / nullif(sum(tokens), 0) AS seconds_per_token,
                   quantile_cont(duration_s / nullif(tokens, 0), 0.5) AS seconds_per_token_p50,
                   max(total_params) AS total_params, min(ts) AS first_ts, max(ts) AS last_ts
            FROM steps WHERE {clause}""", params)
        return frame.iloc[0].to_dict()

    # -- hosts (a rank's rows belong to the host its `runs` row names) ------------------------------

    def host_totals(self, run_id: str, tags: dict[str, str] | None = None, limit: int = MAX_HOSTS) -> pd.DataFrame:
        """Per host that recorded the run (or its rows carrying `tags`), by host: host, ranks (distinct
        ranks), forwards (per rank, as `step_totals` counts them), tokens, first_ts, last_ts (UTC). A
        rank's `steps` rows belong to the host of its `runs` row (`HOST_OF_RANK`; `UNKNOWN_HOST`
        where none names one). Empty for an unknown run."""
        clause, params = where(run_id, tags=tags)
        return self.sql(f"""
            WITH {HOST_OF_RANK}
            SELECT coalesce(h.host, '{UNKNOWN_HOST}') AS host, count(DISTINCT s.rank)::BIGINT AS ranks,
                   (sum(coalesce(s.forwards, 1)) / count(DISTINCT s.rank))::BIGINT AS forwards,
                   sum(s.tokens)::BIGINT AS tokens, min(s.ts) AS first_ts, max(s.ts) AS last_ts
            FROM (SELECT * FROM steps WHERE {clause}) s LEFT JOIN h ON h.rank = s.rank
            GROUP BY 1 ORDER BY 1 LIMIT ?""", [run_id, *params, int(limit)])

    def host_layer_totals(self, run_id: str, tags: dict[str, str] | None = None,
                          limit: int = MAX_HOSTS) -> pd.DataFrame:
        """Per (host, MoE layer), the columns of `layer_totals` over that host's ranks' rows (see
        `host_totals`; `tags` as there), plus host: `moescope.metrics.signals.layer_figures_of` reads a host's
        rows. Ordered by host and layer; at most `limit` hosts."""
        clause, params = where(run_id, tags=tags)
        frame = self.sql(f"""
            WITH {HOST_OF_RANK},
                 r AS (SELECT coalesce(h.host, '{UNKNOWN_HOST}') AS host, l.*
                       FROM (SELECT * FROM layer_steps WHERE {clause}) l LEFT JOIN h ON h.rank = l.rank),
                 hosts AS (SELECT DISTINCT host FROM r ORDER BY host LIMIT ?),
                 p AS (SELECT host, layer, expert, sum(load) AS load
                       FROM (SELECT host, layer, unnest(expert_load) AS load,
                                    unnest(range(len(expert_load)))::INTEGER AS expert FROM r)
                       GROUP BY ALL),
                 loads AS (SELECT host, layer, list(load::BIGINT ORDER BY expert) AS expert_load,
                                  sum(load)::BIGINT AS slots FROM p GROUP BY host, layer),
                 s AS (SELECT host, layer, sum(tokens)::BIGINT AS tokens,
                              {token_weighted("router_entropy_mean")} AS router_entropy,
                              sum(dropped_tokens)::BIGINT AS dropped_tokens,
                              sum(dropped_assignments)::BIGINT AS dropped_assignments,
                              max(capacity_use) AS capacity_use,
                              {token_weighted("active_params_per_token")} AS active_params_per_token
                       FROM r GROUP BY host, layer),
                 info AS (SELECT layer, any_value(num_experts) AS num_experts,
                                 coalesce(any_value(zero_experts), 0) AS zero_experts, any_value(top_k) AS top_k
                          FROM layers WHERE run_id = ? GROUP BY layer)
            SELECT s.host, s.layer, info.num_experts, info.zero_experts,
                   coalesce(info.num_experts + info.zero_experts, len(loads.expert_load)) AS router_width,
                   info.top_k, s.tokens, loads.slots, loads.expert_load, s.router_entropy, s.dropped_tokens,
                   s.dropped_assignments, s.capacity_use, s.active_params_per_token
            FROM s JOIN hosts USING (host) JOIN loads USING (host, layer) LEFT JOIN info USING (layer)
            ORDER BY s.host, s.layer LIMIT ?""", [run_id, *params, int(limit), run_id, int(limit) * 4096])
        return _vectors(frame, "expert_load")

    def tag_totals(self, run_id: str, limit: int = 50) -> pd.DataFrame:
        """Per step tag (key, value): steps (forwards), tokens, active_fraction (token-weighted)."""
        return self.sql(f"""
            SELECT t.key AS key, t.value AS value, {STEPS} AS steps, sum(tokens)::BIGINT AS tokens,
                   {token_weighted("active_param_fraction")} AS active_fraction
            FROM (SELECT unnest(map_entries(tags)) AS t, active_param_fraction, tokens, forwards, rank
                  FROM steps WHERE run_id = ?)
            GROUP BY ALL ORDER BY key, value LIMIT ?""", [run_id, int(limit)])

    def active_fraction_by_tag(self, run_id: str, key: str, limit: int = 100,
                               tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Per value of tag `key` (steps without it left out; with `tags`, only the steps carrying all of
        them): value, steps, tokens, active_fraction (token-weighted), active_min and active_max (over rows)."""
        clause, params = where(run_id, tags=tags)
        return self.sql(f"""
            SELECT map_extract_value(tags, ?) AS value, {STEPS} AS steps, sum(tokens)::BIGINT AS tokens,
                   {token_weighted("active_param_fraction")} AS active_fraction,
                   min(active_param_fraction) AS active_min, max(active_param_fraction) AS active_max
            FROM steps WHERE run_id = ? AND map_extract_value(tags, ?) IS NOT NULL AND {clause}
            GROUP BY value ORDER BY value LIMIT ?""", [str(key), run_id, str(key), *params, int(limit)])

    def active_fraction_buckets(self, run_id: str, tags: dict[str, str] | None = None,
                                max_buckets: int = MAX_BUCKETS) -> pd.DataFrame:
        """Per step bucket (at most `max_buckets`): step_start, step_end (last step recorded in it),
        ts (UTC), tokens, active_fraction (token-weighted), active_min, active_max (over rows)."""
        clause, params = where(run_id, tags=tags)
        return self.sql(f"""
            WITH {_buckets("steps", clause)}
            SELECT b.s0 + ((step - b.s0) // b.w) * b.w AS step_start, max(coalesce(step_end, step)) AS step_end,
                   min(ts) AS ts, sum(tokens)::BIGINT AS tokens,
                   {token_weighted("active_param_fraction")} AS active_fraction,
                   min(active_param_fraction) AS active_min, max(active_param_fraction) AS active_max
            FROM steps, b WHERE {clause}
            GROUP BY step_start ORDER BY step_start LIMIT ?""",
            [int(max_buckets), *params, *params, int(max_buckets) + 1])

    def active_fraction_by_position(self, run_id: str, buckets: int = 4,
                                    tags: dict[str, str] | None = None) -> pd.DataFrame:
        """The active-parameter fraction by position in the sequence, from the recorded routes.

        Positions 0..P-1 (P: the longest row recorded under `tags`) fall into `buckets` equal
        buckets (at most 64). Per bucket: bucket (0-based), position_start, position_end (half-open),
        tokens (token positions with routes), active_fraction (mean over those tokens of the share
        of all parameters the token used: the parameters outside the routed experts, plus
        params_per_expert for every kept slot on a routed expert in each layer; the probe's
        convention, `steps.active_param_fraction`, but per token), kept_slots and dropped_slots
        (per token, summed over layers). Needs routes (attach with routes=True) of every MoE layer:
        a layer the probe did not watch counts as no expert used. Positions are rows of one
        forward's input, so a decode step (one new token) is position 0: filter by tags to compare
        like with like. Empty for a run without routes.
        """
        buckets = max(1, min(int(buckets), 64))
        clause, params = where(run_id, tags=tags)
        return self.sql(f"""
            WITH r AS (SELECT step, rank, token, position, layer, expert_ids, kept FROM routes WHERE {clause}),
            l AS (SELECT layer, any_value(num_experts) AS num_experts, any_value(params_per_expert) AS ppe
                  FROM layers WHERE run_id = ? GROUP BY layer),
            p AS (SELECT max(total_params) AS total, max(routed_expert_params) AS routed FROM runs WHERE run_id = ?),
            t AS (SELECT r.step, r.rank, r.token, any_value(r.position) AS position,
                         sum(len(list_filter(list_zip(r.expert_ids, r.kept), lambda s: s[2] AND s[1] < l.num_experts))
                             * l.ppe) AS used,
                         sum(len(list_filter(r.kept, lambda k: k))) AS kept_slots,
                         sum(len(list_filter(r.kept, lambda k: NOT k))) AS dropped_slots
                  FROM r JOIN l ON l.layer = r.layer GROUP BY r.step, r.rank, r.token),
            w AS (SELECT greatest(1, ceil((max(position) + 1) / ?::DOUBLE))::BIGINT AS width FROM t)
            SELECT (position // w.width)::INTEGER AS bucket, min(position // w.width) * w.width AS position_start,
                   (min(position // w.width) + 1) * w.width AS position_end, count(*)::BIGINT AS tokens,
                   avg((p.total - p.routed + used) / p.total) AS active_fraction,
                   avg(kept_slots) AS kept_slots, avg(dropped_slots) AS dropped_slots
            FROM t, w, p GROUP BY bucket, w.width ORDER BY bucket LIMIT ?""",
            [*params, run_id, run_id, buckets, buckets])

    # -- layers --------------------------------------------------------------------------------

    def layer_totals(self, run_id: str, tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Per MoE layer over a run (or the rows carrying `tags`), one row per layer that routed.

        Columns: layer; num_experts (routed, with parameters), zero_experts, router_width
        (num_experts + zero_experts: the router's choices), top_k (from the `layers` table; NULL
        where the run recorded none); tokens (tokens the layer routed); slots (kept top-k
        assignments = sum of expert_load); expert_load (np.ndarray of int64 per expert, routed
        experts first, then zero experts: tokens that chose it); router_entropy (token-weighted
        mean per-token entropy, nats; NaN where not recorded); dropped_tokens (tokens no expert
        processed), dropped_assignments (slots dropped at capacity); capacity_use (fullest
        expert's load / capacity, the largest over the rows); active_params_per_token
        (token-weighted).
        """
        clause, params = where(run_id, tags=tags)
        frame = self.sql(f"""
            WITH p AS (SELECT layer, expert, sum(load) AS load FROM ({_unnest_load(clause)}) GROUP BY ALL),
                 loads AS (SELECT layer, list(load::BIGINT ORDER BY expert) AS expert_load,
                                  sum(load)::BIGINT AS slots FROM p GROUP BY layer),
                 s AS (SELECT layer, sum(tokens)::BIGINT AS tokens,
                              {token_weighted("router_entropy_mean")} AS router_entropy,
                              sum(dropped_tokens)::BIGINT AS dropped_tokens,
                              sum(dropped_assignments)::BIGINT AS dropped_assignments,
                              max(capacity_use) AS capacity_use,
                              {token_weighted("active_params_per_token")} AS active_params_per_token
                       FROM layer_steps WHERE {clause} GROUP BY layer),
                 info AS (SELECT layer, any_value(num_experts) AS num_experts,
                                 coalesce(any_value(zero_experts), 0) AS zero_experts, any_value(top_k) AS top_k
                          FROM layers WHERE run_id = ? GROUP BY layer)
            SELECT s.layer, info.num_experts, info.zero_experts,
                   coalesce(info.num_experts + info.zero_experts, len(loads.expert_load)) AS router_width,
                   info.top_k, s.tokens, loads.slots, loads.expert_load, s.router_entropy, s.dropped_tokens,
                   s.dropped_assignments, s.capacity_use, s.active_params_per_token
            FROM s JOIN loads USING (layer) LEFT JOIN info USING (layer)
            ORDER BY s.layer LIMIT 4096""", [*params, *params, run_id])
        return _vectors(frame, "expert_load")

    def rank_loads(self, run_id: str, layer: Sequence[int], expert: Sequence[int], rank: Sequence[int],
                   share: Sequence[float], window_steps: int | None = None, tags: dict[str, str] | None = None,
                   top_experts: int = 8) -> pd.DataFrame:
        """Per (MoE layer, step window, rank) the slots a placement puts on that rank.

        The placement comes as parallel lists, one entry per (layer, logical expert, rank) that
        serves it: `share` is the part of the expert's load the rank serves
        (`moescope.metrics.signals.replica_shares`: its slots of the expert over all of the expert's slots).
        Windows are `window_steps` steps wide, aligned to multiples (None: the run is one window).

        Columns: layer, window_start, window_end (exclusive; both NULL for the whole run), steps,
        tokens (tokens the layer routed in the window, all ranks), layer_slots (kept top-k
        assignments to the routed experts the placement maps), rank, slots (the rank's share of
        them: fractional where a redundant expert's load is split), experts and expert_slots (the
        rank's `top_experts` largest contributors, largest first, and their slots). A rank that
        serves nothing in a window has no row; experts the placement does not map (zero experts)
        count in no rank. Ordered by layer, window_start, rank; every row, no row limit (the result
        is layers x windows x ranks: a wider `window_steps` makes it smaller). Raises ValueError for
        window_steps < 1.
        """
        if window_steps is not None and window_steps < 1:
            raise ValueError(f"window_steps must be at least 1, not {window_steps}")
        clause, params = where(run_id, tags=tags)
        w = 0 if window_steps is None else int(window_steps)
        bucket = "NULL::BIGINT" if w == 0 else "step // ?"
        bucket_params = [] if w == 0 else [w]
        return self.sql(f"""
            WITH m AS (SELECT unnest(?::INTEGER[]) AS layer, unnest(?::INTEGER[]) AS expert,
                              unnest(?::INTEGER[]) AS rank, unnest(?::DOUBLE[]) AS share),
                 p AS (SELECT layer, {bucket} AS w, expert, sum(load) AS load
                       FROM ({_unnest_load(clause, "step,")}) GROUP BY ALL),
                 s AS (SELECT layer, {bucket} AS w, {STEPS} AS steps, sum(tokens)::BIGINT AS tokens
                       FROM layer_steps WHERE {clause} GROUP BY ALL),
                 mapped AS (SELECT layer, w, sum(load)::BIGINT AS layer_slots
                            FROM p SEMI JOIN (SELECT DISTINCT layer, expert FROM m) USING (layer, expert)
                            GROUP BY ALL),
                 e AS (SELECT p.layer, p.w, m.rank, p.expert, p.load * m.share AS slots
                       FROM p JOIN m USING (layer, expert)),
                 r AS (SELECT layer, w, rank, sum(slots) AS slots,
                              list(expert ORDER BY slots DESC, expert)[1:?] AS experts,
                              list(slots ORDER BY slots DESC, expert)[1:?] AS expert_slots
                       FROM e GROUP BY ALL)
            SELECT r.layer, s.w * ? AS window_start, (s.w + 1) * ? AS window_end, s.steps, s.tokens,
                   coalesce(mapped.layer_slots, 0)::BIGINT AS layer_slots, r.rank, r.slots, r.experts, r.expert_slots
            FROM r JOIN s ON s.layer = r.layer AND s.w IS NOT DISTINCT FROM r.w
                 LEFT JOIN mapped ON mapped.layer = r.layer AND mapped.w IS NOT DISTINCT FROM r.w
            ORDER BY r.layer, window_start NULLS FIRST, r.rank""",
            [[int(v) for v in layer], [int(v) for v in expert], [int(v) for v in rank], [float(v) for v in share],
             *bucket_params, *params, *bucket_params, *params, int(top_experts), int(top_experts), w or None,
             w or None])

    def window_loads(self, run_id: str, window_steps: int, tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Per (MoE layer, window of `window_steps` steps aligned to multiples, expert) the kept slots the
        expert took: columns layer, window_start, window_end (exclusive), expert, load; ordered by
        layer, window_start, expert; every row, no row limit (layers x windows x experts). Raises
        ValueError for window_steps < 1."""
        if window_steps < 1:
            raise ValueError(f"window_steps must be at least 1, not {window_steps}")
        clause, params = where(run_id, tags=tags)
        w = int(window_steps)
        return self.sql(f"""
            SELECT layer, (step // ?) * ? AS window_start, (step // ? + 1) * ? AS window_end, expert,
                   sum(load)::BIGINT AS load
            FROM ({_unnest_load(clause)}) GROUP BY ALL ORDER BY layer, window_start, expert""",
            [w, w, w, w, *params])

    def placement_whatif(self, run_id: str) -> pd.DataFrame:
        """The latest placement what-if written for the run (`moescope placement --whatif --save`):
        the `placement_whatif` columns but run_id and rank, ordered by candidate, window_start, layer;
        every row (no row limit: a cut would drop the last candidates whole). Empty for a run without one."""
        return self.sql("""
            SELECT * EXCLUDE (run_id, rank) FROM placement_whatif
            WHERE run_id = ? AND ts = (SELECT max(ts) FROM placement_whatif WHERE run_id = ?)
            ORDER BY candidate, window_start, layer""", [run_id, run_id])

    def trace_findings(self, run_id: str, origins: Sequence[str] | None = None) -> pd.DataFrame:
        """The trace checks' findings for the run (`moescope.ingest.trace_checks`), a row per check:
        check_name, count and checked (summed over the rows written: the proxy writes one per flush),
        expected (summed likewise), sequences and rows (the first five named), detail (the latest row's),
        origins (what checked it, comma-separated). Of origin "check" (`moescope check --save`) only the
        latest writing counts. `origins` keeps those origins' rows (None: all). Ordered by count,
        largest first; empty for a run without findings."""
        clause, params = "run_id = ?", [run_id]
        if origins is not None:
            clause += f" AND origin IN ({', '.join('?' for _ in origins) or 'NULL'})"
            params += [str(o) for o in origins]
        return self.sql(f"""
            SELECT check_name, sum(count)::BIGINT AS count, sum(checked)::BIGINT AS checked,
                   sum(expected) AS expected, flatten(list(sequences ORDER BY ts))[1:5] AS sequences,
                   flatten(list(rows ORDER BY ts))[1:5] AS rows, arg_max(detail, ts) AS detail,
                   string_agg(DISTINCT origin, ',' ORDER BY origin) AS origins
            FROM trace_findings
            WHERE {clause} AND (origin <> 'check' OR ts = (
                SELECT max(ts) FROM trace_findings WHERE run_id = ? AND origin = 'check'))
            GROUP BY check_name ORDER BY count DESC, check_name""", [*params, run_id])

    def sequence_routes(self, run_id: str, page_rows: int = 262_144) -> Iterator[pa.Table]:
        """Every layer's routes rows of the run, grouped as the engines return them: ordered by step,
        rank, sequence, position, layer (null sequences read as 0), with columns step, rank, sequence,
        position, layer, expert_ids. Pages hold whole steps, about `page_rows` rows each (more when
        one step holds more), so a long run streams in bounded memory. Yields nothing for a run
        without routes. Raises ValueError for page_rows < 1."""
        if page_rows < 1:
            raise ValueError(f"page_rows must be at least 1, not {page_rows}")
        counts = self.sql("SELECT step, count(*)::BIGINT AS n FROM routes WHERE run_id = ? GROUP BY step ORDER BY step",
                          [run_id])
        steps, sizes = counts.step.to_numpy(np.int64), counts.n.to_numpy(np.int64)
        first = 0
        while first < len(steps):
            last, rows = first, int(sizes[first])
            while last + 1 < len(steps) and rows + int(sizes[last + 1]) <= page_rows:
                last += 1
                rows += int(sizes[last])
            yield self.arrow("""
                SELECT step, rank, coalesce(sequence, 0) AS sequence, position, layer, expert_ids FROM routes
                WHERE run_id = ? AND step BETWEEN ? AND ?
                ORDER BY step, rank, sequence, position, layer""", [run_id, int(steps[first]), int(steps[last])])
            first = last + 1

    def layer_buckets(self, run_id: str, tags: dict[str, str] | None = None,
                      max_buckets: int = MAX_BUCKETS) -> pd.DataFrame:
        """Per layer and step bucket (at most `max_buckets` per layer): layer, step_start, step_end
        (last step recorded in it), tokens, router_entropy (token-weighted, nats), dropped_tokens."""
        clause, params = where(run_id, tags=tags)
        return self.sql(f"""
            WITH {_buckets("layer_steps", clause)}
            SELECT layer, b.s0 + ((step - b.s0) // b.w) * b.w AS step_start,
                   max(coalesce(step_end, step)) AS step_end, sum(tokens)::BIGINT AS tokens,
                   {token_weighted("router_entropy_mean")} AS router_entropy,
                   sum(dropped_tokens)::BIGINT AS dropped_tokens
            FROM layer_steps, b WHERE {clause}
            GROUP BY layer, step_start ORDER BY layer, step_start LIMIT ?""",
            [int(max_buckets), *params, *params, 4096 * (int(max_buckets) + 1)])

    def load_heatmap(self, run_id: str, layer: int, tags: dict[str, str] | None = None,
                     max_buckets: int = MAX_BUCKETS) -> pd.DataFrame:
        """Tokens per (step bucket, expert) of one layer: step_start, step_end (last step of the
        bucket within the run), expert, load (tokens that chose the expert). Buckets are as wide as
        needed for the run to fit in `max_buckets` of them."""
        span = self.sql("SELECT max(coalesce(step_end, step)) AS hi FROM layer_steps WHERE run_id = ? AND layer = ?",
                        [run_id, int(layer)])
        if span.empty or pd.isna(span.hi.iloc[0]):
            return pd.DataFrame(columns=["step_start", "step_end", "expert", "load"])
        hi = int(span.hi.iloc[0])
        width = max(1, math.ceil((hi + 1) / max(1, int(max_buckets))))
        frame = self.load_matrix(run_id, layer, bucket_steps=width, tags=tags)  # type: ignore[attr-defined]
        frame = frame.rename(columns={"step_bucket": "step_start"})
        frame.insert(1, "step_end", np.minimum(frame.step_start + width - 1, hi))
        return frame

    def expert_tag_load(self, run_id: str, key: str, tags: dict[str, str] | None = None) -> pd.DataFrame:
        """Tokens per (layer, expert, value of tag `key`) over the rows carrying `tags`: layer, expert,
        value, load (every kept top-k slot counts). Rows without the `key` tag are left out."""
        clause, params = where(run_id, tags=tags)
        return self.sql(f"""
            SELECT layer, expert, value, sum(load)::BIGINT AS load
            FROM (SELECT layer, map_extract_value(tags, ?) AS value, unnest(expert_load) AS load,
                         generate_subscripts(expert_load, 1) - 1 AS expert
                  FROM layer_steps WHERE {clause} AND map_extract_value(tags, ?) IS NOT NULL)
            GROUP BY layer, expert, value ORDER BY layer, expert, value LIMIT ?""",
            [str(key), *params, str(key), MAX_TAG_ROWS])

    # -- drift ---------------------------------------------------------------------------------

    def drift_from_first_steps(self, run_id: str, window_steps: int, baseline_run: str | None,
                               first_steps: int, max_windows: int = MAX_BUCKETS) -> pd.DataFrame:
        """`drift_windows` against the first `first_steps` steps of `baseline_run` (this run when
        None), the latest `max_windows` windows per layer. Columns: those of `drift_windows`."""
        source = baseline_run or run_id
        first = self.sql("SELECT min(step) AS s FROM layer_steps WHERE run_id = ?", [source])
        if first.empty or pd.isna(first.s.iloc[0]):
            return pd.DataFrame(columns=["layer", "window_start", "window_end", "last_step", "steps", "tokens",
                                         "expert_load", "baseline_load", "baseline_tokens"])
        start = int(first.s.iloc[0])
        frame = self.drift_windows(run_id, max(1, int(window_steps)),  # type: ignore[attr-defined]
                                   baseline_run=None if source == run_id else source,
                                   baseline_steps=(start, start + max(1, int(first_steps))))
        return frame.groupby("layer", group_keys=False).tail(int(max_windows)).reset_index(drop=True)

    # -- tokens --------------------------------------------------------------------------------

    def expert_tokens(self, run_id: str, layer: int, expert: int, step_range: tuple[int, int] | None = None,
                      tags: dict[str, str] | None = None, limit: int = 200, context: int = 4) -> pd.DataFrame:
        """Tokens that `layer` routed to `expert` (within `step_range`, inclusive), at most `limit`
        (capped at MAX_TOKENS_LISTED), oldest first: the columns of `expert_routes` plus the ids and
        positions of up to `context` neighbours either side in the same sequence (context_ids,
        context_positions)."""
        limit = max(1, min(int(limit), MAX_TOKENS_LISTED))
        lo, hi = (int(step_range[0]), int(step_range[1]) + 1) if step_range is not None else (None, None)
        hits = self.expert_routes(run_id, layer, expert, step_from=lo, step_to=hi,  # type: ignore[attr-defined]
                                  tags=tags, limit=limit)
        if hits.empty:
            return hits.assign(context_ids=[], context_positions=[])
        ctx = self.sql("""
            WITH h AS (SELECT unnest(?::BIGINT[]) AS step, unnest(?::INTEGER[]) AS rank,
                              unnest(?::INTEGER[]) AS sequence, unnest(?::INTEGER[]) AS position)
            SELECT h.step, h.rank, h.sequence, h.position,
                   list(r.token_id ORDER BY r.position) AS context_ids,
                   list(r.position ORDER BY r.position) AS context_positions
            FROM h JOIN routes r
              ON r.step = h.step AND r.rank = h.rank AND r.sequence = h.sequence
             AND r.position BETWEEN h.position - ? AND h.position + ?
            WHERE r.run_id = ? AND r.layer = ? AND r.step BETWEEN ? AND ?
            GROUP BY ALL""",
            [hits.step.tolist(), hits["rank"].tolist(), hits.sequence.tolist(), hits.position.tolist(),
             int(context), int(context), run_id, int(layer), int(hits.step.min()), int(hits.step.max())])
        return hits.merge(ctx, on=["step", "rank", "sequence", "position"], how="left")

    def router_input_sample(self, run_id: str, layer: int, size: int = 2000, context: int = 4,
                            seed: int = 0) -> pd.DataFrame:
        """A fixed sample of at most `size` (capped at MAX_SAMPLE) recorded router inputs of one layer:
        step, token, token_id, top1_expert, hidden (list of floats), tags, and, where routes were
        recorded, the token's sequence, position and neighbouring token ids (context_ids,
        context_positions). The same arguments give the same sample while the data stay the same."""
        size = max(1, min(int(size), MAX_SAMPLE))
        return self.sql("""
            WITH s AS (
                SELECT DISTINCT ON (step, token, rank) step, token, rank, token_id, top1_expert, hidden, tags
                FROM (SELECT * FROM router_inputs WHERE run_id = ? AND layer = ?
                      ORDER BY hash(step, token, rank, ?::BIGINT) LIMIT ?)),
            pos AS (
                SELECT s.step, s.token, s.rank, r.sequence, r.position
                FROM s JOIN routes r ON r.run_id = ? AND r.layer = ? AND r.step = s.step AND r.token = s.token
                                     AND r.rank = s.rank),
            ctx AS (
                SELECT p.step, p.token, p.rank, list(r.token_id ORDER BY r.position) AS context_ids,
                       list(r.position ORDER BY r.position) AS context_positions
                FROM pos p JOIN routes r ON r.run_id = ? AND r.layer = ? AND r.step = p.step AND r.rank = p.rank
                     AND r.sequence = p.sequence AND r.position BETWEEN p.position - ? AND p.position + ?
                GROUP BY p.step, p.token, p.rank)
            SELECT s.step, s.token, s.token_id, s.top1_expert, s.hidden, s.tags, pos.sequence, pos.position,
                   ctx.context_ids, ctx.context_positions
            FROM s LEFT JOIN pos USING (step, token, rank) LEFT JOIN ctx USING (step, token, rank)
            ORDER BY s.step, s.token""",
            [run_id, int(layer), int(seed), size, run_id, int(layer), run_id, int(layer), int(context),
             int(context)])

    # -- routing jitter (moescope.analyses.jitter) ---------------------------------------------------

    def jitter_layers(self, run_id: str) -> pd.DataFrame:
        """A jitter run's figures, one row per (condition, layer) in the order the conditions ran:
        condition, baseline (the condition it is compared with), description, layer, tokens ((token,
        layer) pairs compared), set_changed, top1_changed, kept_changed (token counts) and each as a
        fraction of tokens (*_fraction), max_weight_change (largest absolute gate-weight change),
        margin_kind, margin_edges (lower bin edges), changed_by_margin, unchanged_by_margin (tokens
        per bin: expert set changed, or not), listed (tokens in `jitter_tokens`), batch_size,
        padding_side, dtype, attn_implementation. Empty for a run without jitter rows."""
        return self.sql("""
            SELECT condition, baseline, description, layer, tokens, set_changed, top1_changed, kept_changed,
                   set_changed / nullif(tokens, 0) AS set_changed_fraction,
                   top1_changed / nullif(tokens, 0) AS top1_changed_fraction,
                   kept_changed / nullif(tokens, 0) AS kept_changed_fraction,
                   max_weight_change, margin_kind, margin_edges, changed_by_margin, unchanged_by_margin, listed,
                   batch_size, padding_side, dtype, attn_implementation
            FROM jitter WHERE run_id = ? ORDER BY condition_order, condition, layer, rank""", [run_id])

    def jitter_tokens(self, run_id: str, condition: str | None = None, layer: int | None = None,
                      limit: int = MAX_TOKENS_LISTED) -> pd.DataFrame:
        """A jitter run's listed tokens (expert set or top-1 changed), of one condition and layer where
        given, at most `limit` (capped at MAX_TOKENS_LISTED), narrowest top-k margin first: the
        `jitter_tokens` columns but run_id and rank (margins in the baseline's router logits)."""
        clause, params = where(run_id, layer)
        if condition is not None:
            clause, params = f"{clause} AND condition = ?", [*params, str(condition)]
        limit = max(1, min(int(limit), MAX_TOKENS_LISTED))
        return self.sql(f"""
            SELECT * EXCLUDE (run_id, rank) FROM jitter_tokens WHERE {clause}
            ORDER BY topk_margin, condition, layer, sequence, position LIMIT ?""", [*params, limit])

    # -- engine vs reference routing (moescope.analyses.mismatch) ----------------------------------

    def engine_routes(self, run_id: str, max_rows: int = MAX_ENGINE_ROUTES) -> pa.Table:
        """A run's routes as an engine recorded them, for re-running its tokens: step, rank,
        sequence, position, layer, token_id (null where not recorded), expert_ids (list, the
        engine's slot order), tags; ordered by step, rank, sequence, position, layer; at most
        `max_rows` rows (the first ones in that order). Empty for a run without routes."""
        return self.arrow("""
            SELECT step, rank, sequence, position, layer, token_id, expert_ids, tags FROM routes
            WHERE run_id = ? ORDER BY step, rank, sequence, position, layer LIMIT ?""", [run_id, int(max_rows)])

    def engine_logprobs(self, run_id: str, max_rows: int = MAX_ENGINE_ROUTES) -> pd.DataFrame:
        """A run's engine log-probs of its generated tokens: step, rank, sequence, position,
        token_id (null where not recorded), logprob (null: not measured); ordered by step, rank,
        sequence, position; at most `max_rows` rows (the first ones in that order). Empty for a run
        whose engine returned none."""
        return self.sql("""
            SELECT step, rank, sequence, position, token_id, logprob FROM engine_logprobs
            WHERE run_id = ? ORDER BY step, rank, sequence, position LIMIT ?""", [run_id, int(max_rows)])

    def mismatch_logprob_gap(self, run_id: str) -> pd.DataFrame:
        """A mismatch run's log-prob gap, one row per (routing, left-out layer, group): the
        `mismatch_logprob_gap` columns but run_id, ts and rank ("reference" first, then "replay",
        then "replay-but-layer" by layer; groups in order). Empty for a run that measured none."""
        return self.sql("""
            SELECT * EXCLUDE (run_id, ts, rank) FROM mismatch_logprob_gap WHERE run_id = ?
            ORDER BY CASE routing WHEN 'reference' THEN 0 WHEN 'replay' THEN 1 ELSE 2 END, left_out_layer NULLS FIRST,
                     CASE grouping WHEN 'all' THEN 0 WHEN 'flips' THEN 1 WHEN 'position' THEN 2 ELSE 3 END,
                     group_order, group_name""", [run_id])

    def mismatch_layers(self, run_id: str, grouping: str | None = None) -> pd.DataFrame:
        """A mismatch run's figures, one row per (group, layer) (layer null: every layer together),
        in group order then layer order, every layer last: the `mismatch` columns but run_id, ts
        and rank, and set_changed_fraction, top1_changed_fraction (of pairs), slots_changed_fraction
        (of the pairs' k slots) and tokens_set_changed_fraction, tokens_top1_changed_fraction (of
        tokens: R3's share of tokens differing in at least one layer). `grouping` ("all",
        "position", "tag") keeps one kind of group. Empty for a run without mismatch rows."""
        clause, params = "run_id = ?", [run_id]
        if grouping is not None:
            clause, params = f"{clause} AND grouping = ?", [*params, str(grouping)]
        return self.sql(f"""
            SELECT * EXCLUDE (run_id, ts, rank),
                   set_changed / nullif(pairs, 0) AS set_changed_fraction,
                   top1_changed / nullif(pairs, 0) AS top1_changed_fraction,
                   slots_changed / nullif(pairs * top_k, 0) AS slots_changed_fraction,
                   tokens_set_changed / nullif(tokens, 0) AS tokens_set_changed_fraction,
                   tokens_top1_changed / nullif(tokens, 0) AS tokens_top1_changed_fraction
            FROM mismatch WHERE {clause}
            ORDER BY CASE grouping WHEN 'all' THEN 0 WHEN 'position' THEN 1 ELSE 2 END, group_order, group_name,
                     layer NULLS LAST""", params)

    def mismatch_tokens(self, run_id: str, layer: int | None = None, limit: int = MAX_TOKENS_LISTED,
                        set_changed: bool | None = None) -> pd.DataFrame:
        """A mismatch run's listed (token, layer) pairs (engine and reference differ), of one layer
        where given, only those whose set changed (True) or did not (False, top-1 alone) where
        given, at most `limit` (capped at MAX_TOKENS_LISTED), narrowest reference margin first: the
        `mismatch_tokens` columns but run_id and rank."""
        clause, params = where(run_id, layer)
        if set_changed is not None:
            clause, params = f"{clause} AND set_changed = ?", [*params, bool(set_changed)]
        limit = max(1, min(int(limit), MAX_TOKENS_LISTED))
        return self.sql(f"""
            SELECT * EXCLUDE (run_id, rank) FROM mismatch_tokens WHERE {clause}
            ORDER BY topk_margin, layer, step, engine_rank, sequence, position LIMIT ?""", [*params, limit])

    # -- tables written by the alerts side and the dashboard -------------------------------------

    def table_rows(self, table: str, run_id: str, order: str | None = None,
                   limit: int = MAX_TABLE_ROWS) -> pd.DataFrame:
        """The latest `limit` rows of a schema table for one run, oldest first by `order` (a column
        of the table's schema; unordered without). Raises ValueError for a table or column the
        schema does not have (they are names, not values: they never come from a user)."""
        schema = SCHEMAS.get(table)
        if schema is None:
            raise ValueError(f"no table {table!r} in the store's schema; tables: {', '.join(SCHEMAS)}")
        if order is not None and order not in schema.names:
            raise ValueError(f"table {table!r} has no column {order!r}; columns: {', '.join(schema.names)}")
        by = f'ORDER BY "{order}" DESC' if order else ""
        frame = self.sql(f'SELECT * FROM "{table}" WHERE run_id = ? {by} LIMIT ?', [run_id, int(limit)])
        return frame.iloc[::-1].reset_index(drop=True) if order else frame

    # -- the alerts engine's inputs (alerts/storage.py) --------------------------------------------

    def alert_transitions(self, run_id: str | None = None) -> pd.DataFrame:
        """Rows of the `alerts` table (every run, or one), ordered by ts, step, alertname, layer."""
        clause, params = ("WHERE run_id = ?", [run_id]) if run_id is not None else ("", [])
        return self.sql(f"SELECT * FROM alerts {clause} ORDER BY ts, step, alertname, layer", params)

    def runs_with_layer_steps(self) -> list[str]:
        """Ids of the runs that have recorded at least one layer step, sorted."""
        return self.sql("SELECT DISTINCT run_id FROM layer_steps ORDER BY run_id").run_id.tolist()

    def layer_steps_after(self, run_id: str, after_step: int) -> pd.DataFrame:
        """A run's layer steps past `after_step`, in (step, layer, rank) order: step, step_end,
        forwards (1 where not recorded), ts, layer, rank, tokens, expert_load (list), router_entropy_mean
        (nats), dropped_tokens, capacity_use, active_params_per_token."""
        return self.sql("""
            SELECT step, coalesce(step_end, step) AS step_end, coalesce(forwards, 1) AS forwards, ts, layer, rank,
                   tokens, expert_load, router_entropy_mean, dropped_tokens, capacity_use, active_params_per_token
            FROM layer_steps WHERE run_id = ? AND step > ? ORDER BY step, layer, rank""", [run_id, int(after_step)])

    def routes_between(self, run_id: str, first_step: int, last_step: int) -> pd.DataFrame:
        """A run's routes rows with first_step <= step <= last_step, in recording order: step, layer,
        rank, token (row in its forward's batch), sequence, position, expert_ids (list)."""
        return self.sql("""
            SELECT step, layer, rank, token, sequence, position, expert_ids FROM routes
            WHERE run_id = ? AND step >= ? AND step <= ? ORDER BY step, layer, rank, token""",
                        [run_id, int(first_step), int(last_step)])

    def first_layer_rows(self, run_id: str, layer: int, rows: int) -> pd.DataFrame:
        """A layer's first `rows` rows by step: expert_load (list), forwards (1 where not recorded)."""
        return self.sql("""
            SELECT expert_load, coalesce(forwards, 1) AS forwards FROM layer_steps
            WHERE run_id = ? AND layer = ? ORDER BY step LIMIT ?""", [run_id, int(layer), int(rows)])

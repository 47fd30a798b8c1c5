"""The dashboard's queries over a `store.Store`: aggregated in DuckDB, bounded, parameterised.

Every function here takes an open `Store` and plain values and returns a small DataFrame; none
of them touches Streamlit, so they are tested directly and `dashboard.data` only adds caching.
Rules kept by every query:

- values that come from a user (run ids, layers, experts, tag keys and values, step ranges,
  limits) go in as `?` parameters; the SQL text is built only from constant fragments;
- aggregation happens inside DuckDB (raw routes never come into pandas to be summed);
- every result is bounded: by a LIMIT, or by a bounded number of step buckets.

Tables that other parts of moescope add later (`alerts`, `expert_health`, `trust_gate_events`)
are read through `optional_table`, which answers None when the store has none of them yet.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

from store.queries import STEPS
from store.store import Store

TagFilter = tuple[str, str] | None  # (tag key, value) or no filter; the store's `tags={key: value}`

MAX_BUCKETS = 240  # points on a time axis; more steps than this are summed into buckets
MAX_TOKENS_LISTED = 500
MAX_SAMPLE = 5000
MAX_OPTIONAL_ROWS = 5000


def _tag_sql(tag: TagFilter) -> tuple[str, list]:
    """A constant SQL fragment and its parameters that keep only rows whose tag matches."""
    if not tag:
        return "", []
    return " AND map_extract_value(tags, ?) = ?", [str(tag[0]), str(tag[1])]


def _tags(tag: TagFilter) -> dict[str, str] | None:
    return {str(tag[0]): str(tag[1])} if tag else None


# -- runs, tags, layers ----------------------------------------------------------------------

def runs(store: Store) -> pd.DataFrame:
    """One row per run (see `Store.runs`), newest first."""
    return store.runs().sort_values("started_at", ascending=False, ignore_index=True)


def tag_values(store: Store, run_id: str, limit: int = 500) -> pd.DataFrame:
    """The distinct (key, value) tags of a run's steps: columns key, value, steps."""
    return store.tag_values(run_id).head(limit).reset_index(drop=True)


def layers(store: Store, run_id: str) -> pd.DataFrame:
    """The run's MoE layers: layer, module, family, num_experts, zero_experts, top_k, ..."""
    return store.layers(run_id)


# -- overview --------------------------------------------------------------------------------

def step_totals(store: Store, run_id: str, tag: TagFilter = None) -> dict[str, float]:
    """Totals over the run's steps: steps, tokens, token-weighted active-parameter fraction,
    its spread over steps (min, p5, median, p95, max), forward time per token, first/last ts."""
    clause, params = _tag_sql(tag)
    df = store.sql(f"""
        SELECT {STEPS} AS steps, coalesce(sum(tokens), 0) AS tokens,
               sum(active_param_fraction * tokens) / nullif(sum(tokens), 0) AS active_fraction,
               min(active_param_fraction) AS active_min,
               quantile_cont(active_param_fraction, 0.05) AS active_p5,
               quantile_cont(active_param_fraction, 0.5) AS active_p50,
               quantile_cont(active_param_fraction, 0.95) AS active_p95,
               max(active_param_fraction) AS active_max,
               sum(duration_s) / nullif(sum(tokens), 0) AS seconds_per_token,
               quantile_cont(duration_s / nullif(tokens, 0), 0.5) AS seconds_per_token_p50,
               any_value(total_params) AS total_params,
               min(ts) AS first_ts, max(ts) AS last_ts
        FROM steps WHERE run_id = ?{clause}""", [run_id, *params])
    return df.iloc[0].to_dict()


def _bucket_cte(table: str, extra_where: str = "") -> str:
    # Width of a step bucket so the run fits in at most `?` buckets; one row, columns s0 and w.
    return f"""b AS (SELECT coalesce(min(step), 0) AS s0,
                        greatest(1, ceil((max(step) - min(step) + 1) / ?::DOUBLE))::BIGINT AS w
                 FROM {table} WHERE run_id = ?{extra_where})"""


def active_fraction_over_time(store: Store, run_id: str, tag: TagFilter = None,
                              max_buckets: int = MAX_BUCKETS) -> pd.DataFrame:
    """Per step bucket: step_start, step_end, ts, tokens, active_fraction (token-weighted),
    active_min and active_max over the bucket's steps."""
    clause, params = _tag_sql(tag)
    return store.sql(f"""
        WITH {_bucket_cte("steps")}
        SELECT b.s0 + ((step - b.s0) // b.w) * b.w AS step_start, max(step) AS step_end,
               min(ts) AS ts, sum(tokens) AS tokens,
               sum(active_param_fraction * tokens) / nullif(sum(tokens), 0) AS active_fraction,
               min(active_param_fraction) AS active_min, max(active_param_fraction) AS active_max
        FROM steps, b WHERE run_id = ?{clause}
        GROUP BY step_start ORDER BY step_start LIMIT ?""",
        [max_buckets, run_id, run_id, *params, max_buckets + 1])


def active_fraction_by_tag(store: Store, run_id: str, key: str, limit: int = 100) -> pd.DataFrame:
    """Per value of tag `key`: steps, tokens, token-weighted active fraction, min and max."""
    return store.sql(f"""
        SELECT map_extract_value(tags, ?) AS value, {STEPS} AS steps, sum(tokens) AS tokens,
               sum(active_param_fraction * tokens) / nullif(sum(tokens), 0) AS active_fraction,
               min(active_param_fraction) AS active_min, max(active_param_fraction) AS active_max
        FROM steps WHERE run_id = ? AND map_extract_value(tags, ?) IS NOT NULL
        GROUP BY value ORDER BY value LIMIT ?""", [key, run_id, key, limit])


def layer_totals(store: Store, run_id: str, tag: TagFilter = None) -> pd.DataFrame:
    """Per layer over the run: tokens, expert_load (list, summed), router entropy (mean of step
    means), dropped_tokens, dropped_assignments, capacity_use (mean)."""
    clause, params = _tag_sql(tag)
    return store.sql(f"""
        WITH per_expert AS (
            SELECT layer, expert, sum(load)::BIGINT AS load FROM (
                SELECT layer, unnest(expert_load) AS load, generate_subscripts(expert_load, 1) - 1 AS expert
                FROM layer_steps WHERE run_id = ?{clause})
            GROUP BY layer, expert),
        loads AS (SELECT layer, list(load ORDER BY expert) AS expert_load FROM per_expert GROUP BY layer),
        scalars AS (
            SELECT layer, sum(tokens) AS tokens, avg(router_entropy_mean) AS router_entropy,
                   sum(dropped_tokens) AS dropped_tokens, sum(dropped_assignments) AS dropped_assignments,
                   avg(capacity_use) AS capacity_use, avg(active_params_per_token) AS active_params_per_token
            FROM layer_steps WHERE run_id = ?{clause} GROUP BY layer)
        SELECT s.*, l.expert_load FROM scalars s JOIN loads l USING (layer) ORDER BY layer LIMIT 4096""",
        [run_id, *params, run_id, *params])


def entropy_over_time(store: Store, run_id: str, tag: TagFilter = None,
                      max_buckets: int = MAX_BUCKETS) -> pd.DataFrame:
    """Per layer and step bucket: step_start, router_entropy (token-weighted mean of step means),
    dropped_tokens, tokens."""
    clause, params = _tag_sql(tag)
    return store.sql(f"""
        WITH {_bucket_cte("layer_steps")}
        SELECT layer, b.s0 + ((step - b.s0) // b.w) * b.w AS step_start,
               sum(router_entropy_mean * tokens) / nullif(sum(tokens), 0) AS router_entropy,
               sum(dropped_tokens) AS dropped_tokens, sum(tokens) AS tokens
        FROM layer_steps, b WHERE run_id = ?{clause}
        GROUP BY layer, step_start ORDER BY layer, step_start LIMIT ?""",
        [max_buckets, run_id, run_id, *params, 64 * (max_buckets + 1)])


# -- heatmaps --------------------------------------------------------------------------------

def load_matrix(store: Store, run_id: str, layer: int, tag: TagFilter = None,
                max_buckets: int = MAX_BUCKETS) -> pd.DataFrame:
    """Tokens per (step bucket, expert) of one layer: step_start, step_end, expert, load.

    Buckets are as wide as needed for the run to fit in `max_buckets` of them."""
    span = store.sql("SELECT min(step) AS lo, max(step) AS hi FROM layer_steps WHERE run_id = ? AND layer = ?",
                     [run_id, layer])
    if span.empty or pd.isna(span.lo.iloc[0]):
        return pd.DataFrame(columns=["step_start", "step_end", "expert", "load"])
    hi = int(span.hi.iloc[0])
    width = max(1, math.ceil((hi + 1) / max(1, int(max_buckets))))
    frame = store.load_matrix(run_id, layer, bucket_steps=width, tags=_tags(tag))
    frame = frame.rename(columns={"step_bucket": "step_start"})
    frame.insert(1, "step_end", np.minimum(frame.step_start + width - 1, hi))
    return frame


def layer_expert_load(store: Store, run_id: str, tag: TagFilter = None) -> pd.DataFrame:
    """Tokens per (layer, expert) over the run: layer, expert, load, share (of the layer's)."""
    return store.expert_share(run_id, tags=_tags(tag))


def coselection(store: Store, run_id: str, layer: int, tag: TagFilter = None) -> np.ndarray | None:
    """The (E, E) count of tokens that chose both experts i and j, summed over the run; None
    where the probe recorded no co-selection for this layer."""
    matrix = store.coselection(run_id, layer, tags=_tags(tag))
    return matrix if matrix.size else None


def expert_tokens(store: Store, run_id: str, layer: int, expert: int, step_range: tuple[int, int] | None = None,
                  tag: TagFilter = None, limit: int = 200, context: int = 4) -> pd.DataFrame:
    """Tokens that `layer` routed to `expert` (within `step_range`, inclusive), at most `limit`,
    oldest first: the columns of `Store.expert_routes` plus the ids and positions of up to
    `context` neighbours either side in the same sequence (context_ids, context_positions)."""
    limit = max(1, min(int(limit), MAX_TOKENS_LISTED))
    lo, hi = (int(step_range[0]), int(step_range[1]) + 1) if step_range is not None else (None, None)
    hits = store.expert_routes(run_id, layer, expert, step_from=lo, step_to=hi, tags=_tags(tag), limit=limit)
    if hits.empty:
        return hits.assign(context_ids=[], context_positions=[])
    ctx = store.sql("""
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


# -- semantic clusters ----------------------------------------------------------------------

def router_input_sample(store: Store, run_id: str, layer: int, size: int = 2000, context: int = 4,
                        seed: int = 0) -> pd.DataFrame:
    """A fixed sample of at most `size` recorded router inputs of one layer: step, token,
    token_id, top1_expert, hidden (list of floats), tags, and, where routes were recorded, the
    token's sequence, position and neighbouring token ids (context_ids, context_positions).
    The same arguments give the same sample while the run's data stays the same."""
    size = max(1, min(int(size), MAX_SAMPLE))
    return store.sql("""
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
        [run_id, layer, seed, size, run_id, layer, run_id, layer, context, context])


def expert_tag_load(store: Store, run_id: str, key: str) -> pd.DataFrame:
    """Tokens per (layer, expert, value of tag `key`) over the run: layer, expert, value, load.
    Steps without that tag are left out."""
    return store.sql("""
        SELECT layer, expert, value, sum(load)::BIGINT AS load
        FROM (SELECT layer, map_extract_value(tags, ?) AS value, unnest(expert_load) AS load,
                     generate_subscripts(expert_load, 1) - 1 AS expert
              FROM layer_steps WHERE run_id = ? AND map_extract_value(tags, ?) IS NOT NULL)
        GROUP BY layer, expert, value ORDER BY layer, expert, value LIMIT 262144""", [key, run_id, key])


# -- drift -----------------------------------------------------------------------------------

def drift_windows(store: Store, run_id: str, window_steps: int, baseline_run: str | None,
                  first_steps: int) -> pd.DataFrame:
    """`Store.drift_windows` with the baseline being the first `first_steps` steps of
    `baseline_run` (this run when None), at most `MAX_BUCKETS` (the latest) windows per layer."""
    source = baseline_run or run_id
    first = store.sql("SELECT min(step) AS s FROM layer_steps WHERE run_id = ?", [source])
    if first.empty or pd.isna(first.s.iloc[0]):
        return pd.DataFrame(columns=["layer", "window_start", "window_end", "expert_load", "baseline_load"])
    start = int(first.s.iloc[0])
    frame = store.drift_windows(run_id, max(1, int(window_steps)),
                                baseline_run=None if source == run_id else source,
                                baseline_steps=(start, start + max(1, int(first_steps))))
    return frame.groupby("layer", group_keys=False).tail(MAX_BUCKETS).reset_index(drop=True)


# -- tables written by other parts of moescope -----------------------------------------------

def optional_table(store: Store, table: str) -> bool:
    """Whether `table` can be queried: a view of the store, or Parquet files the store's schema
    does not list yet (a view is then made over them). False when the store has neither."""
    exists = store.sql("SELECT count(*) AS n FROM duckdb_views() WHERE view_name = ?", [table])
    if int(exists.n.iloc[0]):
        return True
    if not table.replace("_", "").isalnum():
        raise ValueError(f"not a table name: {table!r}")
    files = sorted(glob.glob(os.path.join(store.root, table, "run_id=*", "part-*.parquet")))
    if not files:
        return False
    listing = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    store.con.execute(f'CREATE OR REPLACE VIEW "{table}" AS SELECT * FROM read_parquet([{listing}], '
                      "hive_partitioning = false, union_by_name = true)")
    return True


def table_columns(store: Store, table: str) -> list[str]:
    return list(store.sql(f'SELECT * FROM "{table}" LIMIT 0').columns) if optional_table(store, table) else []


def run_rows(store: Store, table: str, run_id: str, order: Sequence[str] = (),
             limit: int = MAX_OPTIONAL_ROWS) -> pd.DataFrame | None:
    """The latest rows (at most `limit`) of an optional table for a run, oldest first; None when
    the table does not exist. `order` names candidate time columns, the first present is used."""
    columns = table_columns(store, table)
    if not columns:
        return None
    where, params = ("WHERE run_id = ?", [run_id]) if "run_id" in columns else ("", [])
    by = next((c for c in order if c in columns), None)
    order_sql = f'ORDER BY "{by}" DESC' if by else ""
    df = store.sql(f'SELECT * FROM "{table}" {where} {order_sql} LIMIT ?', [*params, int(limit)])
    return df.iloc[::-1].reset_index(drop=True) if by else df


# -- comparison ------------------------------------------------------------------------------

def side_summary(store: Store, run_id: str, tag: TagFilter = None) -> dict[str, object]:
    """What the Compare page shows for one side (a run, optionally one tag value): the step
    totals of `step_totals` and the per-layer totals of `layer_totals`."""
    return {"steps": step_totals(store, run_id, tag), "layers": layer_totals(store, run_id, tag)}


def outbox_deliveries(root: str, fingerprints: Sequence[str], limit: int = 1000) -> pd.DataFrame | None:
    """Notifications of these alerts in the alerts outbox (`<root>/.moescope/alerts-outbox.sqlite`,
    opened read-only): fingerprint, receiver (its name, never a secret URL), state, attempts,
    created_at, delivered_at, last_error. None when there is no outbox."""
    import sqlite3

    from alerts.notify import redact_receiver_name

    path = os.path.join(root, ".moescope", "alerts-outbox.sqlite")
    if not os.path.isfile(path):
        return None
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    try:
        df = pd.read_sql_query(
            "SELECT receiver, idempotency_key, state, attempts, created_at, delivered_at, last_error "
            "FROM deliveries ORDER BY id DESC LIMIT ?", con, params=[int(limit)])
    except Exception:  # noqa: BLE001 - an outbox of another version: show nothing rather than fail
        return None
    finally:
        con.close()
    df.insert(0, "fingerprint", df.idempotency_key.str.split(":").str[0])
    df["receiver"] = df.receiver.map(redact_receiver_name)  # an older outbox named receivers by their full URL
    for col in ("created_at", "delivered_at"):
        df[col] = pd.to_datetime(df[col], unit="s", utc=True)
    return df[df.fingerprint.isin(set(fingerprints))].reset_index(drop=True)

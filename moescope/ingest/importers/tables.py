"""What every importer shares: an engine's routing, checked, as the tables the probe writes.

Readers (`vllm`, `sglang`, `trtllm`, `megatron`) yield `source.SourceStep`s as a stream. An import
makes two passes over it: `survey` checks every step of every file and keeps only the layers'
shapes, then `rows.TableBuilder` turns the steps into rows, part by part, and `write_run` hands
each part to the run's writer (`moescope.store.writer`) as it comes, the `runs` row last, so a run appears
once all its rows are in place. Nothing is written unless the whole first pass passed, and memory
holds one chunk of routing, not a file. Drift and switch statistics follow from the loads and
routes exactly as for a probed run. What an engine cannot give (router logits, entropy, gate
weights, dropped tokens, parameter counts, forward time) is null, never zero, so a view can say
"not recorded by this source". The rows are built by the store's one builder of each table
(`moescope.store.schema`).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moescope.core.runs import new_run_id
from moescope.ingest.importers.fields import DEFAULT_LIMIT, MAX_EXPERTS, ExpertLimit, check_expert_ids
from moescope.ingest.importers.rows import (  # noqa: F401 - the proxy builds its rows here too
    COSELECTION_MAX_EXPERTS,
    TableBuilder,
    build_step_tables,
    coselection,
    tag_column,
)
from moescope.ingest.importers.source import (  # noqa: F401 - the importers' and the proxy's types
    LayerRoutes,
    LayerShape,
    RunSpec,
    SourceData,
    SourceFormatError,
    SourceStep,
    StepStream,
)
from moescope.ingest.importers.survey import DENSE, piece_rows, survey
from moescope.ingest.trace_checks import TraceFinding, summary_line
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name
from moescope.store.schema import SCHEMAS, LayerRow, layers_table, runs_table, trace_findings_table
from moescope.store.text import control_characters
from moescope.store.writer import run_writer

_TAG_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
MAX_TAG_VALUE = 256
# Progress shows on stderr once a pass has run this long, so quick imports stay quiet.
PROGRESS_DELAY_S = 3.0


def check_tags(tags: dict[str, str]) -> dict[str, str]:
    """Return the tags if every key is a plain name and every value short printable text; raise
    ValueError otherwise (the importers' --tag options and the proxy's tag headers both come here)."""
    for key, value in tags.items():
        if not isinstance(key, str) or not _TAG_KEY.fullmatch(key):
            raise ValueError(f"tag key {key!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(value, str) or len(value) > MAX_TAG_VALUE:
            raise ValueError(f"tag {key}: the value must be a string of at most {MAX_TAG_VALUE} characters")
        if found := control_characters(value):
            raise ValueError(f"tag {key}: the value holds control characters ({', '.join(found)}): "
                             f"use printable text")
    return dict(tags)


def parse_tags(pairs: list[str] | None) -> dict[str, str]:
    """`["k=v", ...]` (the --tag options) as a dict; raises ValueError for a pair without '='."""
    tags = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--tag {pair!r}: write it as key=value")
        tags[key.strip()] = value.strip()
    return check_tags(tags)


def file_time(path: str) -> dt.datetime:
    return dt.datetime.fromtimestamp(os.stat(path).st_mtime, dt.timezone.utc)


def split_routed_rows(ids: np.ndarray, where: str, limit: ExpertLimit = DEFAULT_LIMIT, first_row: int = 0,
                      ) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], int]:
    """Per-layer computed rows of a `(rows, layers, slots)` routing array with -1 for "none".

    A slot that is -1 in every row of a layer is padding (a recorder padded to 8 slots) and goes;
    a layer with no slot set is a dense layer (or never ran) and goes; a row with every slot -1 was
    not computed (a prefix-cache hit) and goes. A row with only some slots set is not a documented
    layout. `first_row` is the number of the array's first row in its sequence (a chunk of a longer
    one), for messages. Returns ({layer: (row numbers, (n, k) int32 ids)}, rows not computed in any
    layer). Raises SourceFormatError for an id outside -1..limit-1 (naming its row, layer, slot
    and value; unsigned ids have no -1) or a partly set row.
    """
    if ids.ndim != 3:
        raise SourceFormatError(f"{where}: routing must be (tokens, layers, top_k), got shape {ids.shape}")
    ids = check_expert_ids(ids, where, limit, ("token row", "layer", "slot"), not_computed=True, first_row=first_row)
    valid = ids >= 0
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    computed_any = np.zeros(ids.shape[0], dtype=bool)
    every_row = np.arange(ids.shape[0])
    for layer in range(ids.shape[1]):
        used = valid[:, layer, :]
        slots = used.any(axis=0)
        if not slots.any():
            continue
        layer_ids = ids[:, layer, :] if slots.all() else ids[:, layer, slots]
        used = used if slots.all() else used[:, slots]
        rows = used.any(axis=1)
        everything = rows.all()
        if not everything or not used.all():
            partial = rows & ~used.all(axis=1)
            if partial.any():
                row = int(np.flatnonzero(partial)[0])
                raise SourceFormatError(
                    f"{where}: token row {first_row + row} of layer {layer} has {int(used[row].sum())} of "
                    f"{used.shape[1]} expert slots set and -1 in the others; a token is either routed in every "
                    "slot or not computed (all -1)")
        computed_any |= rows
        index = every_row if everything else np.flatnonzero(rows)
        out[layer] = (index, (layer_ids if everything else layer_ids[index]).astype(np.int32))
    return out, int(np.count_nonzero(~computed_any))


# -- tables --------------------------------------------------------------------------------------

def run_tables(spec: RunSpec, shapes: dict[int, LayerShape], ranks: list[int]) -> dict[str, pa.Table]:
    """The runs row (one per rank, as each probed rank writes one) and the layers rows of the run, from
    the store's one builder of each (`moescope.store.schema.runs_table`, `layers_table`). What an engine
    does not say (parameter counts, a capacity) is null; a layer's module and family name the source."""
    ranks = sorted(set(ranks)) or [0]
    out = {"runs": runs_table(spec.run_id, spec.started_at, spec.model, spec.source, tags=spec.tags, ranks=ranks,
                              host=spec.host)}
    if shapes:
        out["layers"] = layers_table(spec.run_id, [
            LayerRow(layer, f"{spec.source} layer {layer}", spec.source, shape.num_experts, shape.top_k)
            for layer, shape in sorted(shapes.items())], ranks)
    return out


# -- writing -------------------------------------------------------------------------------------

def check_new_run(root: str | os.PathLike | StoreLocation, run_id: str) -> None:
    """Raise ValueError if `run_id` already has rows in the store (an import never appends): a data
    file of its partition in the current snapshot of any table."""
    from moescope.store.delta import snapshot

    location = open_location(root)
    for table in SCHEMAS:
        current = snapshot(location, table)
        if current is not None and any(f.run_id == run_id for f in current.files):
            raise ValueError(f"the store {location.redacted!r} already holds a run {run_id!r}: choose another "
                             "--run-id (an import never adds steps to an existing run)")


def write_run(root: str | os.PathLike | StoreLocation, run_id: str, parts: Iterable[tuple[str, pa.Table]],
              last: dict[str, pa.Table]) -> tuple[list[str], Counter]:
    """Write each (table, rows) part as it comes, then the `last` tables (`runs` after the others),
    so the run appears complete or not at all; returns the files written and the rows per table.

    Raises OSError when the store refused rows (they are counted in `probe_stats` as write_failed;
    what was written before stays, without its `runs` row).
    """
    location = open_location(root)
    written: Counter = Counter()
    with run_writer(location, run_id) as writer:
        first = len(writer.files)
        for table, rows in _then(parts, sorted(last.items(), key=lambda item: item[0] == "runs")):
            if rows.num_rows and not writer.write(table, rows):
                raise OSError(f"the store {location.redacted!r} did not take the rows of {table} "
                              f"({writer.last_error or 'see the log'}); run {run_id!r} has no runs row: import "
                              "again under another --run-id (`moescope prune` removes the partial run once it is "
                              "old enough)")
            written[table] += rows.num_rows
            if table == "layer_steps":
                written["layer_tokens"] += int(pc.sum(rows["tokens"]).as_py() or 0)
        return writer.files[first:], written


def _then(first: Iterable, second: Iterable) -> Iterator:
    yield from first
    yield from second


@dataclass
class ImportSummary:
    """What an import wrote: for the command's report and for tests."""

    run_id: str
    source: str
    steps: int
    layers: int
    ranks: int
    tokens: int  # layer-tokens summed over layers and steps
    routes: int  # per-token route rows written (0 for count-only sources)
    files: list[str]
    notes: Counter
    # the trace checks' findings, written to the run's trace_findings rows (None: the source has no
    # per-request routing to check, such as count-only dumps)
    findings: list[TraceFinding] | None = None
    checked_rows: int = 0  # token rows the trace checks read

    def report(self) -> str:
        lines = [f"imported {self.steps} steps of {self.layers} MoE layers ({self.ranks} rank"
                 f"{'s' if self.ranks != 1 else ''}, {self.tokens:,} layer-tokens, {self.routes:,} route rows) "
                 f"from {self.source} into run {self.run_id}"]
        if self.findings is not None:
            lines.append(summary_line(self.findings, self.checked_rows))
        lines += [f"  note: {note} ({count}x)" if count > 1 else f"  note: {note}"
                  for note, count in sorted(self.notes.items())]
        return "\n".join(lines)


def _progress(desc: str, total: int | None):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="rows", unit_scale=True, delay=PROGRESS_DELAY_S, file=sys.stderr,
                leave=False)


def import_source(root: str | os.PathLike | StoreLocation, data: SourceData, source: str, run_id: str | None = None,
                  tags: dict[str, str] | None = None, num_experts: int | None = None, top_k: int | None = None,
                  model: str | None = None, where: str = "the source", max_experts: int = MAX_EXPERTS,
                  ) -> ImportSummary:
    """Check every step a reader yields, then write them as one new run; returns what was written.

    Two passes over `data.steps`: the first checks everything (nothing is written if it fails),
    the second writes part by part. `root` is a folder or a URL (a `StoreLocation` carries its
    storage options). Progress shows on stderr when a pass takes more than PROGRESS_DELAY_S.
    Raises SourceFormatError / ValueError (nothing written) when the data or options do not fit.
    """
    root = open_location(root)
    run_id = check_name("run_id", run_id) if run_id else new_run_id(source)
    tags = check_tags({**(tags or {})})
    with _progress(f"checking {where}", None) as bar:
        found = survey(data.steps, num_experts, top_k, lambda: (data.num_experts, data.top_k), where,
                       max_experts=max_experts, progress=bar.update)
    notes = Counter(data.notes)  # the writing pass reads the files again: its notes are the same
    checked_rows = data.checks.rows  # and its trace checks too: the first pass's findings are kept
    widest = max((s.num_experts for s in found.shapes.values()), default=None)
    findings = data.checks.findings(num_experts=widest) if checked_rows or data.checks.sequences else None
    if found.dense:
        notes[DENSE.format(len(found.dense))] += 1
    if not found.shapes:
        raise SourceFormatError(f"{where}: every layer is dense or uncomputed (-1 or zero throughout): no MoE "
                                "routing to import")
    check_new_run(root, run_id)
    spec = RunSpec(run_id=run_id, source=source, model=model or data.model or f"{source} model",
                   tags=tags, started_at=found.started_at)
    builder = TableBuilder(spec, found.shapes)

    def parts() -> Iterator[tuple[str, pa.Table]]:
        with _progress(f"writing {where}", found.rows) as bar:
            for step in data.steps:
                yield from builder.add(step)
                bar.update(piece_rows(step))
            yield from builder.finish()

    last = run_tables(spec, found.shapes, sorted(found.ranks))
    if findings:
        last["trace_findings"] = trace_findings_table(run_id, dt.datetime.now(dt.timezone.utc), "import", findings)
    files, written = write_run(root, run_id, parts(), last)
    return ImportSummary(run_id=run_id, source=source, steps=len(found.step_numbers), layers=len(found.shapes),
                         ranks=len(found.ranks), tokens=written["layer_tokens"], routes=written["routes"],
                         files=files, notes=notes, findings=findings, checked_rows=checked_rows)

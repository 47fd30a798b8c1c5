"""mkdocs hooks: the site's generated reference, built from the code at every `mkdocs build`.

- `reference/cli.md`: every command of `moescope.cli.build_parser()`, walked through its
  subparsers, each with its one-line help and its full `--help` text. No hand-kept copy: a command
  or option added to the parser is on the page at the next build.
- `reference/tables.md`: every table of `moescope.store.schema.SCHEMAS`, each column with its Arrow
  type, and the comments `store/schema.py` writes beside its tables and columns. What a row is (and
  short notes on some columns) comes from `TABLE_NOTES` below, which the build checks against
  `SCHEMAS`: a table without notes, or a note on a column the schema does not have, fails the build.
- `reference/json.md`: every analysis command's `--format json` document, its keys and their units,
  from `moescope.cli.output.DOCUMENTS` (the list the tests hold each command's output to).
- The API pages (`::: moescope.probe` and the rest) are rendered by mkdocstrings. probe/, store/,
  alerts/ and dashboard/ install as moescope.probe ... through setuptools' package-dir mapping,
  which griffe (mkdocstrings' loader) cannot follow in an editable install, so `on_config` builds the
  namespace's shadow tree, `build/docs-shadow/moescope/`, with `.ci/shadow_tree.py` (the script
  `.ci/lint-imports` and `.ci/typecheck` use); mkdocs.yml's mkdocstrings `paths` points there.

A generated page is a markdown file under docs/ with a marker comment (`<!-- generated: cli -->`,
`<!-- generated: tables -->`) that `on_page_markdown` replaces, so the prose around the generated
part stays an ordinary page (`<!-- generated: json -->` likewise).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import os
import tokenize
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHADOW = REPO / "build" / "docs-shadow"
HELP_WIDTH = "100"  # argparse wraps --help to $COLUMNS: a fixed width gives the same page on every machine

# What one row of each table is, and short notes on some columns (what `store/schema.py`'s comments do
# not already say). Checked against SCHEMAS at every build.
TABLE_NOTES: dict[str, tuple[str, dict[str, str]]] = {
    "runs": ("attach (or import)", {
        "source": "`probe`, or the engine a run was imported from",
        "host": "`MOESCOPE_HOST`, else the machine's hostname",
    }),
    "layers": ("MoE layer", {"layer": "0-based index of the MoE layer in module order"}),
    "steps": ("forward (or a window of forwards: `step`..`step_end`)", {
        "step": "counts forwards from 0",
    }),
    "layer_steps": ("forward × layer (or a window of forwards)", {
        "expert_load": "tokens per expert",
        "gate_weight_sum": "per expert",
        "router_prob_sum": "Σ softmax, per expert",
        "coselection": "flattened E×E co-selection counts",
        "expert_compute_time_s": "per expert",
        "router_topk_load": "list, tokens whose top-k router probabilities hold each expert, before bias "
                            "correction or drops: an input of the auxiliary losses",
        "router_z_sum": "Σ logsumexp(logits)²: an input of the router z-loss",
    }),
    "routes": ("forward × layer × token", {
        "token": "row in the forward's flattened batch (batch-major)",
        "expert_ids": "in the model's order",
        "gate_weights": "per slot",
        "kept": "per slot: false where the slot was dropped at capacity",
    }),
    "router_logits": ("sampled token", {"logits": "one per expert"}),
    "router_inputs": ("sampled token", {"hidden": "the router's input hidden state"}),
    "kv_cache": ("forward × attention layer", {"bytes": "KV-cache bytes of the layer after the forward"}),
    "probe_stats": ("table × reason, per flush (cumulative)", {
        "reason": "`queue_full`, `queue_bytes_full`, `write_failed`, `ring_full`, `quarantined` (rank -1, "
                  "counted once per damaged file), ...",
    }),
    "run_ends": ("writer whose session closed", {}),
    "expert_health": ("window × layer × expert", {
        "score": "0 to 100",
        "load": "component score (100 is normal); likewise `confidence`, `output`, `weight`, `grad`",
        "load_share_ratio": "a component's raw input; likewise the columns up to `grad_norm`",
    }),
    "trust_gate_events": ("gate change", {"source": "who changed the gate: the policy, an operator, a request"}),
    "trust_gate_requests": ("dashboard request", {}),
    "routing_cooldown_events": ("cooldown start, end or blocked start", {}),
    "train_steps": ("optimizer step × layer (`moescope.training`)", {
        "step": "first forward the optimizer step covers (`step_end` its last)",
        "expert_grad_norm": "per expert",
    }),
    "jitter": ("condition × layer of a jitter run", {}),
    "jitter_tokens": ("flipped token (bounded per condition and layer)", {}),
    "mismatch": ("group × layer of an engine-vs-reference check (layer null: every layer)", {
        "grouping": "`all`, `position` (a position bucket) or `tag` (`key=value` of the engine's steps)",
    }),
    "mismatch_tokens": ("(token, layer) pair where engine and reference differ (bounded per layer)", {}),
    "engine_logprobs": ("generated token whose log-prob an engine returned (vLLM `logprobs`, SGLang "
                        "`output_token_logprobs`)", {
        "position": "the sampled token's position in its sequence (the prompt's tokens first)",
        "logprob": "the engine's log-prob of the sampled token; null: not measured (or clamped)",
    }),
    "mismatch_logprob_gap": ("(routing, group) of a mismatch check's log-prob gap", {
        "routing": "`reference`, `replay`, `replay-but-layer` (every layer but `left_out_layer` replayed)",
        "k3_mean": "mean AReaL k3 KL, exp(−Δ) − 1 + Δ, Δ = reference − engine log-prob",
    }),
    "placement_whatif": ("candidate placement × window × layer of a placement what-if", {
        "candidate": "`current`, `default`, `eplb`, `load-aware`, `eplb-every-N`",
        "rank_load": "slots per rank, a redundant expert's split by `dispatch`",
    }),
    "trace_findings": ("check that found something in an engine's trace, per writing "
                       "([Trace checks](../trace-checks.md))", {
        "origin": "`import`, `proxy`, `check` (`moescope check --save`)",
        "count": "what the check counts (token rows, (token, layer) rows, rows missing or extra, sequences, slots); "
                 "the proxy writes a row per flush: sum them",
        "expected": "what an honest router gives",
    }),
    "alerts": ("alert transition, from every source", {
        "source": "`rules`, `health`, `trust_gate`, `mismatch`, `trace_check`",
        "reason": "e.g. `run ended`",
    }),
}


def on_config(config: Any) -> Any:
    """Build the shadow tree griffe reads the moescope namespace from (see the module's docstring).

    It is also built when mkdocs loads this module (the end of the file): mkdocstrings takes its
    search paths at its own on_config, which may run before this one, and a path that does not exist
    yet is dropped, so a first build from a clean clone found `moescope` in the editable install
    without the four packages the namespace maps in."""
    build_shadow_tree()
    return config


def build_shadow_tree(shadow: Path = SHADOW) -> Path:
    """Builds the namespace's shadow tree under `shadow` afresh, with `.ci/shadow_tree.py`.

    Returns:
        The shadow package folder, `shadow/moescope`.
    """
    spec = importlib.util.spec_from_file_location("shadow_tree", REPO / ".ci" / "shadow_tree.py")
    assert spec is not None and spec.loader is not None
    shadow_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shadow_tree)
    return shadow_tree.build(shadow, REPO)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated: cli -->" in markdown:
        markdown = markdown.replace("<!-- generated: cli -->", cli_reference())
    if "<!-- generated: tables -->" in markdown:
        markdown = markdown.replace("<!-- generated: tables -->", tables_reference())
    if "<!-- generated: json -->" in markdown:
        markdown = markdown.replace("<!-- generated: json -->", json_reference())
    return markdown


# -- the JSON documents -----------------------------------------------------------------------------


def json_reference() -> str:
    """Every document of `moescope.cli.output.DOCUMENTS`, as markdown.

    Returns:
        A section per command: where its keys' meanings are written, then a table of its key paths
        with their units.
    """
    from moescope.cli.output import DOCUMENTS

    sections = []
    for command, document in DOCUMENTS.items():
        units = document.units()
        described = " and ".join(f"`{name}`" for name in document.described_by.split(" and "))
        sections += [f"## moescope {command} {{ #{anchor('json ' + command)} }}", "",
                     f"`moescope {command} ... --format json`. What each figure is: {described}.", "",
                     "| key | unit |", "|---|---|"]
        sections += [f"| `{path}` | {escape_cell(units.get(path, ''))} |" for path in document.keys]
        sections.append("")
    return "\n".join(sections)


# -- the command line -------------------------------------------------------------------------------


def cli_reference() -> str:
    """Every command of `moescope.cli.build_parser()`, depth first, as markdown.

    Returns:
        A summary table of every command, then a section per command with its full help.
    """
    from moescope.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        commands = list(walk_commands(build_parser()))
        table = ["| command | what it does |", "|---|---|"]
        sections = []
        for prog, summary, parser in commands:
            table.append(f"| [`{prog}`](#{anchor(prog)}) | {escape_cell(summary)} |")
            sections += [f"## {prog} {{ #{anchor(prog)} }}", "", summary, "", "```text",
                         parser.format_help().rstrip(), "```", ""]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(table + [""] + sections)


def walk_commands(parser: argparse.ArgumentParser):
    """Yields (prog, one-line help, parser) for the parser and every subcommand under it."""
    yield parser.prog, (parser.description or "").strip().splitlines()[0] if parser.description else "", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                for prog, summary, sub in walk_commands(subparser):
                    yield prog, (helps.get(name, summary) if sub is subparser else summary), sub


def anchor(prog: str) -> str:
    return prog.replace(" ", "-")


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the tables -------------------------------------------------------------------------------------


def tables_reference() -> str:
    """Every table of SCHEMAS with its columns, types and documentation, as markdown.

    Returns:
        An index of the tables, then a section per table.

    Raises:
        ValueError: when TABLE_NOTES and SCHEMAS disagree (a table without notes, a note on a column
            or table the schema does not have).
    """
    from moescope.store import schema

    source_path = Path(schema.__file__)
    table_comments, column_comments = schema_comments(source_path.read_text())
    check_notes(schema.SCHEMAS)
    index = ["| table | one row per |", "|---|---|"]
    sections = []
    for name, arrow_schema in schema.SCHEMAS.items():
        row, notes = TABLE_NOTES[name]
        index.append(f"| [`{name}`](#{name}) | {row} |")
        sections += [f"## `{name}` {{ #{name} }}", "", f"One row per {row}.", ""]
        if table_comments.get(name):
            sections += [table_comments[name], ""]
        sections += ["| column | type | notes |", "|---|---|---|"]
        for field in arrow_schema:
            sections.append(f"| `{field.name}` | `{field.type}` | {escape_cell(notes.get(field.name, ''))} |")
        sections.append("")
        grouped = column_comments.get(name, [])
        if grouped:
            sections += ["From `store/schema.py`:", ""]
            sections += [f"- {', '.join(f'`{c}`' for c in columns)}: {text}" for columns, text in grouped]
            sections.append("")
    return "\n".join(index + [""] + sections)


def check_notes(schemas: dict[str, Any]) -> None:
    missing = [name for name in schemas if name not in TABLE_NOTES]
    unknown = [name for name in TABLE_NOTES if name not in schemas]
    stale = [f"{table}.{column}" for table, (_, notes) in TABLE_NOTES.items() if table in schemas
             for column in notes if column not in schemas[table].names]
    if missing or unknown or stale:
        raise ValueError(f"docs/hooks.py TABLE_NOTES disagrees with store/schema.py SCHEMAS: tables without notes "
                         f"{missing}, notes on tables that do not exist {unknown}, on columns that do not exist "
                         f"{stale}; update TABLE_NOTES")


def schema_comments(source: str) -> tuple[dict[str, str], dict[str, list[tuple[list[str], str]]]]:
    """The comments of `store/schema.py`'s SCHEMAS literal, attached to what they describe.

    A comment block just above a table's key describes the table (a `# -- section --` line is left
    out); a comment block inside a table's column list describes the columns after it, up to the next
    comment or the end of the list.

    Returns:
        (table -> its comment, table -> [(columns, their comment)]).
    """
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    schemas = next(node.value for node in ast.parse(source).body
                   if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
                   and "SCHEMAS" in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target))
    assert isinstance(schemas, ast.Dict)
    table_comments: dict[str, str] = {}
    column_comments: dict[str, list[tuple[list[str], str]]] = {}
    previous_end = schemas.lineno
    for key, value in zip(schemas.keys, schemas.values):
        assert isinstance(key, ast.Constant) and isinstance(key.value, str)
        name = key.value
        above = [comments[line] for line in range(previous_end + 1, key.lineno) if line in comments]
        table_comments[name] = " ".join(text for text in above if not text.startswith("--"))
        previous_end = value.end_lineno or key.lineno
        columns_list = next((arg for arg in getattr(value, "args", []) if isinstance(arg, ast.List)), None)
        if columns_list is None:
            continue
        groups: list[tuple[list[str], str]] = []
        current: tuple[list[str], str] | None = None
        block: list[str] = []
        line = columns_list.lineno
        for element in columns_list.elts:
            for between in range(line, element.lineno):
                if between in comments:
                    block.append(comments[between])
            if block:
                current = ([], " ".join(block))
                groups.append(current)
                block = []
            if current is not None and isinstance(element, ast.Tuple) and isinstance(element.elts[0], ast.Constant):
                current[0].append(str(element.elts[0].value))
            line = (element.end_lineno or element.lineno) + 1
        column_comments[name] = [group for group in groups if group[0]]
    return table_comments, column_comments


build_shadow_tree()  # before any plugin's on_config: see on_config

"""What `moescope jitter` and `moescope mismatch` share. Both run token ids through a model, compare
its routing with another routing of the same tokens, keep what they found as a run of their own in a
store, and print it:

- the model: MODEL is `demo` or a local folder, nothing is downloaded (`load_model`), cast to a
  torch dtype given by name (`torch_dtype`);
- the options of the run they write and print (`add_run_arguments`: --max-listed, --run-id, --tag,
  --show, --quiet) and the checks of their counts (`check_counts`);
- the printed report's common parts: the margin table (`margin_table`), a listed token in its
  context (`context`), and where the results went with the dashboard command that shows them
  (`written_line`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from moescope.analyses.tokens import context_parts

DEMO = "demo"
SHOW_TOKENS = 8


def add_run_arguments(p: argparse.ArgumentParser, listed: str, per: str) -> None:
    """--max-listed, --run-id, --tag, --show and --quiet, with `listed` naming what the check lists
    ("flipped tokens") and `per` what it keeps a bounded number of them per ("condition and layer")."""
    p.add_argument("--max-listed", type=int, default=1000, help=f"{listed} kept per {per} (default 1000)")
    p.add_argument("--run-id", help="the results' run id in the store (default: a new one)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V", help="a tag on the results' run (repeatable)")
    p.add_argument("--show", type=int, default=SHOW_TOKENS, help=f"{listed} printed (default {SHOW_TOKENS})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def check_counts(args: argparse.Namespace, error: type[ValueError], at_least_one: Iterable[str],
                 at_least_zero: Iterable[str] = ("max_listed", "show")) -> None:
    """Raise `error` naming the first option (by its `args` name) below its floor; None stands for an
    option left out."""
    for floor, names in ((1, at_least_one), (0, at_least_zero)):
        for name in names:
            value = getattr(args, name)
            if value is not None and value < floor:
                flag = "--" + name.replace("_", "-")
                raise error(f"{flag} must be at least 1, got {value}" if floor else f"{flag} must be 0 or more, "
                            f"got {value}")


def torch_dtype(name: str, error: type[ValueError]) -> Any:
    """The torch dtype named `name` (`bfloat16`, `float16`, ...). Raises `error` for another name."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise error(f"unknown dtype {name!r}; use a torch dtype name such as bfloat16, float16 or float32")
    return dtype


def load_model(name: str) -> tuple[Any, Any, bool]:
    """(model in eval mode on the CPU in float32, tokenizer or None, whether it is the demo model)
    for MODEL: `demo` or a local folder. Raises JitterError when there is nothing to load there."""
    from moescope.analyses.jitter import JitterError  # imports torch: a command's --help must not
    from moescope.demo.data import demo_model_path, load_demo_model

    model: Any
    tokenizer: Any
    if name == DEMO:
        model, tokenizer = load_demo_model()
        return model, tokenizer, True
    folder = os.path.abspath(os.path.expanduser(name))
    if not os.path.isdir(folder):
        raise JitterError(f"no model folder at {name!r}: give `demo` or a local folder saved with transformers' "
                          "save_pretrained (moescope never downloads; fetch the model first, e.g. with "
                          "`huggingface-cli download ORG/NAME --local-dir DIR`)")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise JitterError(f"{name!r} holds no config.json: give the folder transformers' save_pretrained wrote")
    if os.path.realpath(folder) == os.path.realpath(demo_model_path()):
        model, tokenizer = load_demo_model(folder)
        return model, tokenizer, True
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    if config.get("capacity_factor") is not None and config.get("model_type") == "mixtral":
        model, tokenizer = load_demo_model(folder)  # a `moescope train-demo` checkpoint: run it with its capacity
        return model, tokenizer, True
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise JitterError(f"transformers cannot load a causal LM from {name!r}: {str(e).splitlines()[0]}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    return model.eval(), tokenizer, False


def margin_table(rows: Sequence[tuple[str, Sequence[int]]], width: int) -> list[str]:
    """The margin histograms as text: a header of the bins' lower edges (MARGIN_EDGES), then a line per
    (label, counts per bin), the labels padded to `width` characters."""
    from moescope.analyses.routing_compare import MARGIN_EDGES  # imports torch: only once a table is printed

    bins = [f">={edge:g}" for edge in MARGIN_EDGES]
    column = max(map(len, bins)) + 1
    return [f"{'':<{width}}" + "".join(f"{b:>{column}}" for b in bins),
            *(f"{label:<{width}}" + "".join(f"{int(c):>{column}}" for c in counts) for label, counts in rows)]


def context(row: Any, tokenizer: Any) -> str:
    """The tokens around a listed token, the token itself in [brackets]: decoded with `tokenizer`
    (a character cut across tokens whole, never a replacement character:
    `moescope.analyses.tokens.context_parts`),
    as ids without one."""
    ids = list(row.context_ids)
    at = int(row.position) - int(row.context_start)
    if tokenizer is None:
        return " ".join(f"[{t}]" if i == at else str(t) for i, t in enumerate(ids))
    before, token, after = context_parts(tokenizer, ids, at)
    return repr(f"{before}[{token}]{after}")[1:-1]


def written_line(location: Any, run_id: str, page: str) -> str:
    """Where the results went, and the command that opens them in the dashboard on `page`: the store
    as a command line names it (`moescope.cli.summary.store_arguments`: its --storage-option pairs
    too), after the program as this installation is called (`moescope.cli.program_name`)."""
    from moescope.cli import program_name
    from moescope.cli.summary import store_arguments

    return (f"written to {location.redacted} as run {run_id}; see it with "
            f"`{program_name()} dashboard {store_arguments(location)}` (page \"{page}\")")

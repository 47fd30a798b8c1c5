"""A small mutation check, no `make` and no plugin: break the code in known ways, one at a time, in
a copy of the repository, run the tests that guard each place, and report whether they noticed.

    python tests/support/mutations.py                    # every mutation (30-60 minutes on 2 busy cores; the
                                                 # demo's take longest: each runs `moescope demo --quick`)
    python tests/support/mutations.py gate-sqrt-w demo   # the mutations whose names contain these words
    python tests/support/mutations.py --list             # what each one breaks, and the tests it runs

Each mutation replaces one exact piece of one file (the script refuses a piece that is not there
exactly once: the code moved, so update the mutation) and runs its tests with pytest in the copy,
the copy first on `sys.path`. Before any mutation, each set of tests runs once on the unbroken
copy and must pass, else a "killed" would prove nothing. A mutation is *killed* when its tests
fail, *survived* when they pass, and an *error* when pytest could not run them (an import error or
a collection error is the mutation breaking Python, not a test noticing). The copy is the working
tree as it is (uncommitted changes included), never the repository itself.

A run whose tests passed but skipped some (a real Prometheus, Alertmanager or browser missing, no
CUDA) is reported *untested*, apart from the survivors: a guard that did not run noticed nothing.
The copy installs as the repository does: `moescope/probe`, `moescope/store`, `moescope/alerts` and
`moescope/dashboard` are links in the copy to its own top-level folders, so `moescope.probe` there is
the copy's, mutated, and never the editable install's. `tests/integration/store/test_mutations.py` checks, in the
suite, that every mutation's piece is still found exactly once, so a move shows at once.

Exit status: 0 when every mutation chosen was killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# The repository root, as tests/support/paths.py has it; not imported from there: this file runs as a script
# (`python tests/support/mutations.py`), where the `tests` package is not on sys.path.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUBPACKAGES = ("probe", "store", "alerts", "dashboard")  # folders that install as moescope.<name>


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # an exact piece of the file, found once
    new: str  # what replaces it
    tests: tuple[str, ...]  # pytest arguments: test files, node ids, -k expressions
    breaks: str  # what the mutation does, in words (and the issue item it comes from)


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "health-page-raises", "dashboard/views/health.py",
        '    st.subheader("Health scores")\n',
        '    if not health.empty:\n        raise RuntimeError("mutant: the page breaks on scores")\n'
        '    st.subheader("Health scores")\n',
        ("tests/unit/dashboard/test_health_page.py",),
        "the Expert health page raises whenever a score exists (issue 16, mutation 1)"),
    Mutation(
        "health-page-first-window", "dashboard/views/health.py",
        'latest = health.groupby(["layer", "expert"], sort=True).tail(1)',
        'latest = health.groupby(["layer", "expert"], sort=True).head(1)',
        ("tests/unit/dashboard/test_health_page.py",),
        "the Expert health page shows each expert's first window, not its latest"),
    Mutation(
        "gate-sqrt-w", "probe/trust_gate.py",
        "scores = _gated_logits(logits, state).softmax(dim=-1, dtype=torch.float32)",
        "scores = (logits if state is None else logits + state.offset.to(logits.dtype) / 2).softmax(dim=-1, "
        "dtype=torch.float32)",
        ("tests/unit/probe/test_trust_gate.py", "-k", "rerouting"),
        "DeepSeek-V2's gate scales by sqrt(w) instead of w (issue 16, mutation 2)"),
    Mutation(
        "gate-fallback-renormalises", "probe/trust_gate.py",
        "weights * scale)",
        "weights * scale / (weights * scale).sum(dim=-1, keepdim=True) * weights.sum(dim=-1, keepdim=True))",
        ("tests/unit/probe/test_trust_gate.py", "-k", "without_a_rule"),
        "the gate's fallback (families without a rule) renormalises the scaled weights"),
    Mutation(
        "demo-hard-coded-figures", "moescope/demo/story.py",
        "masked_finite=bool(masked.isfinite().all()), masked_error=_relative_error(masked, clean))",
        "masked_finite=True, masked_error=0.01)",
        ("tests/e2e/test_demo.py", "-k", "check_figures"),
        "`moescope demo` reports masked_finite and masked_error without measuring (issue 16, mutation 3)"),
    Mutation(
        "demo-alerts-received-short", "moescope/demo/story.py",
        "for d in alerting.receiver.received]\n    figures[\"alerts_delivered\"]",
        "for d in alerting.receiver.received][1:]\n    figures[\"alerts_delivered\"]",
        ("tests/e2e/test_demo.py", "-k", "outbox"),
        "`moescope demo` leaves an alert it received out of alerts_received"),
    Mutation(
        "active-fraction-by-tag-halved", "store/reports.py",
        '{token_weighted("active_param_fraction")} AS active_fraction,\n'
        '                   min(active_param_fraction) AS active_min, max(active_param_fraction) AS active_max\n'
        '            FROM steps WHERE run_id = ? AND map_extract_value(tags, ?) IS NOT NULL',
        '{token_weighted("active_param_fraction")} / 2 AS active_fraction,\n'
        '                   min(active_param_fraction) AS active_min, max(active_param_fraction) AS active_max\n'
        '            FROM steps WHERE run_id = ? AND map_extract_value(tags, ?) IS NOT NULL',
        ("tests/unit/store/test_reports.py", "tests/unit/dashboard/test_figures.py"),
        "active_fraction_by_tag halved (issue 16, mutation 4; its tests are issue 11's)"),
    Mutation(
        "active-fraction-by-position-width", "store/reports.py",
        "ceil((max(position) + 1) / ?::DOUBLE)",
        "ceil(max(position) / ?::DOUBLE)",
        ("tests/unit/store/test_reports.py", "-k", "by_position"),
        "the position buckets' width leaves out the longest position (issue 25: 1 080 tokens of 1 152 at 16 "
        "positions and 3 buckets)"),
    Mutation(
        "step-bucket-width", "store/reports.py",
        "ceil((max(coalesce(step_end, step)) - min(step) + 1) / ?::DOUBLE)",
        "ceil((max(coalesce(step_end, step)) - min(step)) / ?::DOUBLE)",
        ("tests/unit/store/test_reports.py", "-k", "do_not_divide"),
        "the step buckets' width leaves out the last step: one bucket too many over 16 steps in 3 "
        "(active_fraction_buckets, layer_buckets, the heatmaps; issue 25)"),
    Mutation(
        "layers-predicate-ignored", "probe/session.py",
        "    if callable(layers):\n        return layers\n",
        "    if callable(layers):\n        return lambda name: True\n",
        ("tests/unit/probe/test_layers.py",),
        "a predicate passed to layers= is ignored (issue 16, mutation 5)"),
    Mutation(
        "layers-renumbered", "probe/session.py",
        "moe_layers = every if select is None else [layer for layer in every if select(layer.name)]",
        "moe_layers = [dataclasses.replace(layer, index=i) for i, layer in enumerate(\n"
        "        every if select is None else [layer for layer in every if select(layer.name)])]",
        ("tests/unit/probe/test_layers.py",),
        "the watched blocks are numbered from 0 again, not by their place among the model's MoE layers (the bug)"),
    Mutation(
        "layers-unwatched-shared", "probe/session.py",
        "self.unwatched_params = float(sum(layer.top_k * layer.params_per_expert",
        "self.unwatched_params = float(sum(layer.num_experts * layer.params_per_expert",
        ("tests/unit/probe/test_layers.py",),
        "the experts of unwatched layers count as used by every token (the bug: 0.377 became 0.688)"),
    Mutation(
        "sampled-token-index-off-by-one", "probe/reduction.py",
        "token = torch.stack([refs.sample_base[:rows] for refs in forwards]) % tokens",
        "token = (torch.stack([refs.sample_base[:rows] for refs in forwards]) + 1) % tokens",
        ("tests/unit/probe/test_exactness.py", "-k", "sampled"),
        "sampled router logits/inputs name a token other than the one whose values they hold"),
    Mutation(
        "deferred-forward-numbers", "probe/reduction.py",
        "number = flat[TOTAL_FORWARDS] - count if counted else flat[TOTAL_FORWARDS]",
        "number = flat[TOTAL_FORWARDS] - count + 1 if counted else flat[TOTAL_FORWARDS]",
        ("tests/unit/probe/test_exactness.py", "-k", "deferred or window_of_two"),
        "route rows of forwards reduced together at a window's close carry the next forward's number (issue 26)"),
    Mutation(
        "snapshot-ring-rows-unsaved", "probe/reduction.py",
        "        keep = where < rows_held\n",
        "        keep = where < rows_held - 1\n",
        ("tests/unit/probe/test_exactness.py", "-k", "deferred or either_thread"),
        "the writer's reduction into a window's snapshot leaves its last route row unwritten (issue 26)"),
    Mutation(
        "ring-overflow-uncounted", "probe/session.py",
        "                    if over > 0:\n",
        "                    if over > ring.capacity:\n",
        ("tests/unit/probe/test_exactness.py", "-k", "either_thread"),
        "a forward with more tokens than its routes ring loses rows without counting them"),
    Mutation(
        "health-every-layer-visits", "probe/health_sampling.py",
        "while spent < self.budget and len(self.visiting) < count:",
        "while len(self.visiting) < count:",
        ("tests/unit/probe/test_health_sampling.py",),
        "every layer runs its experts at each sampled forward: the budget is not kept (issue 26)"),
    Mutation(
        "router-inputs-scaled", "probe/session.py",
        "hidden = args[0].reshape(-1, args[0].shape[-1])",
        "hidden = args[0].reshape(-1, args[0].shape[-1]) * 1.001",
        ("tests/unit/probe/test_exactness.py", "-k", "router_inputs or sampled"),
        "router_inputs are not the tensor the router was called with"),
    Mutation(
        "drop-policy-uncounted", "moescope/core/pipeline.py",
        '            self._count_drop(record, "queue_full")\n',
        "            pass\n",
        ("tests/unit/probe/test_drop_policy.py",),
        'policy="drop" loses records without counting them'),
    Mutation(
        "drop-policy-waits", "moescope/core/pipeline.py",
        "                self._queue.put_nowait((record, size))",
        "                self._queue.put((record, size))",
        ("tests/unit/probe/test_drop_policy.py",),
        'policy="drop" makes the model wait for a stuck exporter'),
    Mutation(
        "compaction-count-unchecked", "store/compact.py",
        "if part.rows != expected:",
        "if False:",
        ("tests/integration/store/test_compact.py",),
        "compaction publishes a merged file whose rows do not add up"),
    Mutation(
        "snapshot-trusts-log-names", "store/delta/snapshots.py",
        "problem = stored_name_problem(run, p)",
        "problem = None",
        ("tests/integration/store/test_hostile_log.py", "-k", "test_compact_with_a_hostile_run and local"),
        "a snapshot keeps files whose run id from the log cannot be part of a path: `compact` merges the run "
        "`crafted/../../../..` and fails (or writes outside the store) instead of leaving it out (issue 41)"),
    Mutation(
        "drift-windows-empty", "store/queries.py",
        "windows = self.load_windows(run_id, window_steps, layer, step_from, step_to)\n        if windows.empty:",
        "windows = self.load_windows(run_id, window_steps, layer, step_from, step_to).head(0)\n"
        "        if windows.empty:",
        ("tests/unit/store/test_queries.py",),
        "drift_windows returns no window (a loop over its rows checked nothing)"),
    Mutation(
        "drift-rate-off", "moescope/metrics/signals.py",
        "return float(np.count_nonzero(prev != nxt) * 1000.0 / prev.size)",
        "return float(np.count_nonzero(prev != nxt) * 1000.0 / (prev.size + 1))",
        ("tests/unit/alerts/test_storage.py", "tests/unit/alerts/test_engine.py"),
        "the routing drift rate is wrong but inside (0, 1000]"),
    Mutation(
        "health-load-share-halved", "alerts/health_score.py",
        "shares = w.load * ungated.sum() / total if total > 0",
        "shares = w.load * ungated.sum() / total / 2 if total > 0",
        ("tests/integration/alerts/test_health_fault.py", "-k", "corrupted and mixtral and nan"),
        "the health score's load share is half what the loads say (was guarded by `load >= 0`)"),
    Mutation(
        "promql-and-becomes-or", "moescope/prometheus/rules.py",
        'return " and ".join(parts)',
        'return " or ".join(parts)',
        ("tests/integration/prometheus/test_prometheus_rules.py",),
        "a two-condition rule's PromQL fires when either condition holds"),
    Mutation(
        # the PromQL side alone: renaming the gauge in SIGNAL_METRICS renames the rule's metric with it
        "promql-wrong-metric", "moescope/prometheus/rules.py",
        "            metric = SIGNAL_METRICS.get(cond.signal)\n",
        '            metric = SIGNAL_METRICS.get("dropped_token_rate" if cond.signal == "lost_expert_alone_fraction"'
        ' else cond.signal)\n',
        ("tests/integration/prometheus/test_prometheus_rules.py",),
        "DeadExpert's PromQL reads another gauge"),
    Mutation(
        "promql-unless-dropped", "moescope/prometheus/rules.py",
        '    held_back = "".join(f" unless ({conjunction(conds)})" for conds in rule.unless_conditions)\n',
        '    held_back = ""\n',
        ("tests/integration/prometheus/test_prometheus_rules.py",),
        "the load rules' PromQL forgets `unless`: a skew that drifted from the baseline fires beside the drift"),
    Mutation(
        "unless-ignored", "alerts/rules.py",
        "        return all(verdicts) and not held_back\n",
        "        return all(verdicts)\n",
        ("tests/unit/alerts/test_engine.py",),
        "a rule's `unless` holds nothing back (issue 50: a domain shift said by every load rule)"),
    Mutation(
        "dead-expert-of-a-shift", "moescope/metrics/signals.py",
        "    if not lost.any() or not kept.any() or kl_divergence(arr[kept], base[kept]) > max_rest_kl:\n",
        "    if not lost.any() or not kept.any():\n",
        ("tests/unit/metrics/test_signals.py", "tests/unit/alerts/test_engine.py"),
        "DeadExpert counts an expert the traffic left as dead (issue 50: an idle expert is not a dead one)"),
    Mutation(
        "ci-skips-missing-servers", "tests/support/realparts.py",
        "    if in_ci():\n",
        "    if False:\n",
        ("tests/unit/support/test_realparts.py",),
        "CI=true skips a test whose Prometheus, Alertmanager or Chromium is missing"),
    Mutation(
        "aux-loss-kept-load", "moescope/training/records.py",
        "aux = signals.load_balancing_loss(ls.router_topk_load, ls.router_prob_sum, ls.tokens)",
        "aux = signals.load_balancing_loss(ls.expert_load[: ls.router_prob_sum.size], ls.router_prob_sum, "
        "ls.tokens)",
        ("tests/unit/training/test_training.py",),
        "the training aux loss counts the kept slots, not the top-k selection the formula counts (issue 15)"),
    Mutation(
        "training-window-per-forward", "moescope/training/monitor.py",
        "recording = dataclasses.replace(options.pop(\"recording\", None) or Recording(), window=FOREVER, "
        "window_s=None)",
        "recording = dataclasses.replace(options.pop(\"recording\", None) or Recording(), window=1, window_s=None)",
        ("tests/unit/training/test_training.py",),
        "a training record covers one forward, so accumulated micro-batches are scored apart (issue 15)"),
    Mutation(
        "grad-norm-squared", "probe/health_sampling.py",
        "return None if total is None else total.sqrt()",
        "return total",
        ("tests/unit/training/test_training.py",),
        "per-expert gradient norms are reported squared (issue 15)"),
    Mutation(
        "z-loss-not-squared", "probe/accumulate.py",
        'block[:, cols["router_z_sum"]] = token_sum(log_z.square())',
        'block[:, cols["router_z_sum"]] = token_sum(log_z)',
        ("tests/unit/probe/test_exactness.py", "-k", "z_loss"),
        "the router z-loss sums logsumexp instead of its square (issue 15)"),
    Mutation(
        "commit-retry-skips-app-lookup", "store/delta/commits.py",
        "if (app is not None and (attempt or not app_unseen)",
        "if (app is not None and (not app_unseen)",
        ("tests/integration/store/test_commit_retry.py", "-k", "when_landed_could_not_look"),
        "a retry of a writer's own commit (app_unseen) does not look for its app transaction before committing "
        "again: a commit that landed while `_landed` could not see it is appended twice (issue 42, check a)"),
    Mutation(
        "commit-landed-unchecked", "store/delta/commits.py",
        "            if app is not None and _landed(loc, table, app):\n",
        "            if False:\n",
        ("tests/integration/store/test_commit_retry.py", "-k", "landed_before_a_failure"),
        "a failed try does not ask whether its commit landed: a landed commit followed by a local store's error "
        "(not retried) raises CommitError (issue 42, check b)"),
    # issue 46 part 6: the mutants a hand audit of the newest modules found surviving, each a figure a user sees
    Mutation(
        "whatif-fit-from-window-0", "moescope/analyses/placement_whatif.py",
        'fit = group.iloc[fit_start].balancedness if len(group) > fit_start else float("nan")',
        'fit = group.iloc[0].balancedness if len(group) > fit_start else float("nan")',
        ("tests/unit/analyses/test_whatif_fit_window.py",),
        "with --fit-window 1 the what-if's fit column is window 0's balancedness, and decay with it "
        "(0.70 shown for 0.95; issue 46 part 6)"),
    Mutation(
        "whatif-gain-against-default-fit", "moescope/analyses/placement_whatif.py",
        'default = frame.loc[frame.candidate == "default", "later"]',
        'default = frame.loc[frame.candidate == "default", "fit"]',
        ("tests/unit/analyses/test_whatif_fit_window.py",),
        "a what-if candidate's gain is taken against the default layout's fit window, not its later windows "
        "(the default's own gain -0.10 for 0; issue 46 part 6)"),
    Mutation(
        "traffic-moved-weight-changed-over-all-tokens", "moescope/metrics/traffic.py",
        "limited_moved_weight_changed=(self.limited_moved / self.limited_changed",
        "limited_moved_weight_changed=(self.limited_moved / tokens",
        ("tests/unit/analyses/test_traffic.py", "-k", "moved_weight"),
        "node-limited routing's moved weight per changed token is divided by all tokens (7.5% for 30%; "
        "issue 46 part 6)"),
    Mutation(
        "mismatch-reference-top1-slot-0", "moescope/analyses/mismatch.py",
        "top1_changed = engine_top1(e_ids, logits, rule) != top1_expert(logits, r_ids)",
        "top1_changed = engine_top1(e_ids, logits, rule) != r_ids[:, 0]",
        ("tests/unit/analyses/test_mismatch_top1.py", "-k", "flip_no_top1"),
        "the reference's top-1 is its slot 0, not its chosen expert of highest router logit (equal on Mixtral, "
        "wrong on DeepSeek-V3 with a correction bias; issue 46 part 6)"),
    Mutation(
        "mismatch-engine-top1-slot-0", "moescope/analyses/routing_compare.py",
        "return engine_ids[:, 0] if rule.ranked else top1_expert(logits, engine_ids)",
        "return engine_ids[:, 0]",
        ("tests/unit/analyses/test_mismatch_top1.py", "-k", "flip_no_top1"),
        "the engine's top-1 is its slot 0 although a grouped or biased router's engine returns its top-k "
        "unsorted (issue 49 part 2)"),
    Mutation(
        "decision-margin-on-logits", "moescope/analyses/routing_compare.py",
        "scores = 1.0 / (1.0 + np.exp(-scores)) + rule.bias",
        "scores = scores",
        ("tests/unit/analyses/test_mismatch_top1.py", "-k", "margin"),
        "a DeepSeek-V3-style router's margin is taken on its logits, not on sigmoid scores plus the correction "
        "bias it decides by (issue 49 part 2)"),
    Mutation(
        "mismatch-slots-fraction-over-pairs", "moescope/analyses/mismatch.py",
        'frame["slots_changed_fraction"] = frame.slots_changed / (frame.pairs * k).where(frame.pairs > 0)',
        'frame["slots_changed_fraction"] = frame.slots_changed / frame.pairs.where(frame.pairs > 0)',
        ("tests/unit/analyses/test_mismatch.py", "-k", "slots_that_differ"),
        "the share of expert slots that differ is divided by pairs, not pairs x k (30% for 15%; issue 46 part 6)"),
    Mutation(
        "mismatch-stored-slots-fraction-over-pairs", "store/reports.py",
        "slots_changed / nullif(pairs * top_k, 0) AS slots_changed_fraction",
        "slots_changed / nullif(pairs, 0) AS slots_changed_fraction",
        ("tests/unit/analyses/test_mismatch.py", "-k", "slots_that_differ"),
        "the Mismatch page's share of expert slots that differ (`Store.mismatch_layers`) is divided by pairs, "
        "not pairs x k (the same slip in the store's SQL; issue 46 part 6)"),
    Mutation(
        "mismatch-max-listed-per-call", "moescope/analyses/mismatch.py",
        "chosen = differ[:max(max_listed - listed_per_layer.get(layer.index, 0), 0)]",
        "chosen = differ[:max_listed]",
        ("tests/unit/analyses/test_mismatch.py", "-k", "max_listed"),
        "max_listed bounds the listed pairs of each sequence and layer, not of each layer (8 rows for 5; "
        "issue 46 part 6)"),
    Mutation(
        "mismatch-max-sequences-one-more", "moescope/analyses/mismatch_engine.py",
        "if max_sequences is not None and len(sequences) >= max_sequences:",
        "if max_sequences is not None and len(sequences) > max_sequences:",
        ("tests/unit/analyses/test_mismatch.py", "-k", "max_sequences"),
        "max_sequences=1 compares 2 sequences (issue 46 part 6)"),
    Mutation(
        "exporter-fairness-over-zero-experts", "moescope/prometheus/exporter.py",
        "fairness.add_metric([label], sig.jain_fairness(routed))",
        "fairness.add_metric([label], sig.jain_fairness(load))",
        ("tests/unit/prometheus/test_zero_expert_series.py",),
        "Jain's fairness index is taken over every slot, zero experts included (0.926 for 1.0; issue 46 part 6)"),
    Mutation(
        "exporter-dead-over-zero-experts", "moescope/prometheus/exporter.py",
        "dead.add_metric([label], sig.dead_expert_count(routed))",
        "dead.add_metric([label], sig.dead_expert_count(load))",
        ("tests/unit/prometheus/test_zero_expert_series.py",),
        "an idle zero expert counts as a dead expert (1 dead for 0; issue 46 part 6)"),
    Mutation(
        "snapshot-no-numrecords-zero-rows", "store/delta/snapshots.py",
        "files.append(PartFile(p, int(s), int(r) if r is not None else -1, run, st,",
        "files.append(PartFile(p, int(s), int(r) if r is not None else 0, run, st,",
        ("tests/unit/store/test_foreign_commits.py",),
        "a file another Delta writer committed without numRecords is read as holding 0 rows: its footer "
        "disagrees, so it is quarantined and its rows are not read (issue 46 part 6)"),
)


def copy_tree(destination: str) -> None:
    """The working tree's files (tracked, and untracked but not ignored) copied to `destination`;
    outside a git checkout (an unpacked archive), every file but caches and virtual environments."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=False)
    if listed.returncode == 0:
        files = listed.stdout.decode().split("\0")
    else:
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
        files = [os.path.relpath(os.path.join(folder, name), REPO) for folder, subfolders, names in os.walk(REPO)
                 if not subfolders.__setitem__(slice(None), [s for s in subfolders if s not in skip])
                 for name in names]
    for relative in filter(None, files):
        source = os.path.join(REPO, relative)
        if not os.path.isfile(source):  # deleted in the working tree
            continue
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)
    for package in SUBPACKAGES:  # the install's package-dir mapping, as links inside the copy
        os.symlink(os.path.join("..", package), os.path.join(destination, "moescope", package))



def check_pieces(root: str, mutations: tuple[Mutation, ...] | list[Mutation]) -> list[str]:
    """What is wrong with the mutations' pieces in the tree at `root`: each must be found exactly
    once in its file (else the code moved and the mutation must follow it). Empty when all are."""
    problems = []
    for m in mutations:
        path = os.path.join(root, m.path)
        if not os.path.isfile(path):
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = open(path, encoding="utf-8").read().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its piece of {m.path} is found {count} times, not once; update it")
    return problems


def run_tests(copy: str, tests: tuple[str, ...], timeout_s: float) -> tuple[int, float, str, int]:
    """(pytest's exit status, seconds, the first failure line, tests skipped) of `tests` run in `copy`."""
    env = {**os.environ, "PYTHONPATH": copy, "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rs", "-p", "no:cacheprovider", "-o",
                               "addopts=", *tests], cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - started, f"timed out after {timeout_s:.0f} s", 0
    lines = (done.stdout + done.stderr).splitlines()
    first = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), lines[-1] if lines else "")
    skipped = re.search(r"(\d+) skipped", lines[-1] if lines else "")
    if skipped and done.returncode == 0:
        first = next((line for line in lines if line.startswith("SKIPPED")), first)
    return done.returncode, time.monotonic() - started, first, int(skipped.group(1)) if skipped else 0


def check_isolation(copy: str) -> None:
    """The copy's packages, not the repository's, are the ones its tests import."""
    env = {**os.environ, "PYTHONPATH": copy}
    names = ["moescope"] + [f"moescope.{package}" for package in SUBPACKAGES]
    where = subprocess.run([sys.executable, "-c", f"import importlib; print('\\n'.join(importlib.import_module(n)"
                            f".__path__[0] for n in {names!r}))"],
                           cwd=copy, env=env, capture_output=True, text=True, check=True).stdout.split()
    outside = [path for path in where if not os.path.realpath(path).startswith(os.path.realpath(copy))]
    if outside:
        raise SystemExit(f"the copy imports packages from outside it: {outside}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="run the mutations whose names contain any of these words")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (default 900)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(word in m.name for word in args.names)]
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    breaks: {m.breaks}\n    in {m.path}; runs: pytest {' '.join(m.tests)}")
        return 0
    if not chosen:
        parser.error(f"no mutation matches {args.names}; see --list")
    with tempfile.TemporaryDirectory(prefix="moescope-mutants-") as copy:
        copy_tree(copy)
        check_isolation(copy)
        problems = check_pieces(copy, chosen)  # every piece must be found exactly once before anything runs
        if problems:
            raise SystemExit("\n".join(problems))
        for tests in dict.fromkeys(m.tests for m in chosen):
            status, seconds, first, _ = run_tests(copy, tests, args.timeout)
            print(f"baseline  {'passed' if status == 0 else 'FAILED':8} {seconds:6.0f} s  pytest {' '.join(tests)}"
                  + ("" if status == 0 else f"\n          {first}"), flush=True)
            if status != 0:
                raise SystemExit("the unbroken code fails these tests: fix that before judging mutations")
        results = []
        for m in chosen:
            path = os.path.join(copy, m.path)
            original = open(path, encoding="utf-8").read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(original.replace(m.old, m.new))
            try:
                status, seconds, first, skipped = run_tests(copy, m.tests, args.timeout)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
            verdict = {0: "SURVIVED", 1: "killed", -1: "killed"}.get(status, f"error({status})")
            if verdict == "SURVIVED" and skipped:  # a guard that was skipped noticed nothing
                verdict = "untested"
            results.append(verdict)
            detail = re.sub(r"\s+", " ", first)[:150]
            print(f"{verdict:9} {m.name:32} {seconds:6.0f} s  {detail}", flush=True)
    killed, untested = results.count("killed"), results.count("untested")
    print(f"\n{killed} of {len(results)} mutations killed"
          + (f"; {untested} not tested (their tests were skipped: install what the SKIPPED lines name)"
             if untested else ""))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

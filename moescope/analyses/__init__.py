"""Reports that combine store queries with metrics. A module per report, and the modules are the
package's names (`from moescope.analyses.jitter import jitter`: several share their module's name):

- `summary`: the per-layer summary of a run (`moescope summary`, the demo);
- `placement`: the load per expert-parallel rank under a placement, and reading a placement file;
- `placement_whatif`: the rebalance what-if (other placements fitted on one window, on every window);
- `rebalance`: the engines' rebalancing policies replayed over a run (balancedness against bytes moved),
  and how stale the live placement is;
- `traffic`: what a placement costs on the wire, per layer, window and tag;
- `expert_cache`: the expert-cache what-if;
- `jitter`: does the same token go to the same experts when a server runs it differently;
- `mismatch`, `mismatch_engine`, `mismatch_replay`: engine vs reference routing, and its replay export;
- `logprob_gap`: the rollout/training log-prob gap, with and without the engine's routing replayed;
- `training_report`: a training run read back per optimizer step and layer;
- `tokens`: token ids as text for people.

`moescope.analyses.eplb` is an old name of `moescope.metrics.eplb`, kept for importers.
"""

__all__ = ["expert_cache", "jitter", "logprob_gap", "mismatch", "mismatch_engine", "mismatch_replay", "placement",
           "placement_whatif", "rebalance", "summary", "tokens", "traffic", "training_report"]

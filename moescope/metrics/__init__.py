"""Pure figures over arrays and frames, no I/O, so alerts, the Prometheus exporter, the analyses and
the dashboard share one definition. A module per idea, and the modules are the package's names
(`from moescope.metrics import signals`):

- `signals`: the routing signals of expert loads and routes (divergences, spread, entropy, drift,
  specialisation) and the rules every derived figure follows (weighting by tokens, zero experts left
  out of loads);
- `figures`: what every view shows for a layer and a run (`layer_figures`, `run_figures`, `run_counts`);
- `ranks`: rank balance under a placement (`replica_shares`, `rank_load`, `expected_rank_tokens`);
- `capacity`: the capacity what-if (the drops a capacity factor would have caused);
- `placement`: the placement value (`Placement`, `parse_placement`, the default layout, each layer's
  shares and wire layout) and `LayerPlacements`, the view the rules engine and the exporter read;
- `dispatch`: how each engine picks the copy of a redundant expert, and where each routed slot runs;
- `eplb`: placements fitted to loads (DeepSeek's EPLB, the seeds' load-aware mapping);
- `rebalance`: the engines' rebalancing policies (vLLM, SGLang, every N steps, never) replayed over
  recorded loads, the bytes each rearrangement moves, and how stale a placement is;
- `traffic`: what a placement costs on the wire (dispatch fan-out per token);
- `expert_cache`: the expert-cache replay (LRU, LFU, Belady);
- `logprob_gap`: the rollout/training log-prob gap (AReaL's k3 KL, |Δ|, Δ², extreme shares).

Numpy only (pandas where a frame is built); the package imports none of the other rooms.
"""

__all__ = ["capacity", "dispatch", "eplb", "expert_cache", "figures", "logprob_gap", "placement", "ranks", "rebalance",
           "signals", "traffic"]

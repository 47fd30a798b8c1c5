"""A Prometheus exporter in the probe's pipeline: per-layer routing health on `/metrics`.

    exporter = PrometheusExporter()                  # its own registry unless one is given
    exporter.serve(port=9464)                        # http://127.0.0.1:9464/metrics
    with moescope.attach(model, store="runs/", exporters=[exporter]):
        ...
    # /metrics still answers here, with the last values: the server is the exporter's
    exporter.close()                                 # stops serving

Lifetime: the probe calls `shutdown()` when its session closes; that stops taking records but
leaves `/metrics` up, so Prometheus can scrape the final values (and the same exporter can be
handed to the next session of the process). `close()` stops the HTTP server and frees its port;
it is safe to call twice, and from any thread but the server's own (e.g. a GracefulStop's `on_stop`).

Stopping on SIGTERM: no moescope command serves the exporter alone; it lives in the process that
runs the model, which stops as every long-running moescope process does (`moescope.core.lifecycle`):

    with GracefulStop() as stop, moescope.attach(model, store="runs/", exporters=[exporter]):
        exporter.serve(9464)
        while not stop.requested.is_set():
            serve_one_request()
    exporter.close()      # the session drained above (final probe_stats); now the port is free
    return 0

The exporter keeps, per MoE layer, the last `window_steps` steps and a few running totals; a
custom collector computes the gauges from that window at each scrape (through the same
`moescope.alerts.observations.compute_signals` the rules engine uses) and yields fresh metric families, so no
state is carried between scrapes.

Names follow Prometheus' conventions: one prefix (`moescope_`), base units (seconds, nats),
`_total` on counters, `_ratio` only on shares in 0-1. The names before the `moescope_` prefix are
listed with their new ones in docs/alerts.md ("Metric names").

Cardinality is bounded by design: per-layer series carry only a `layer` label (one series per
MoE layer); the run is named once, in `moescope_run_info`. Per expert, only the `hot_cold_experts`
(K, default 4) hottest and K coldest experts of each layer's current window get a series,
`moescope_expert_load_ratio{layer,expert}` (the expert's share of the layer's slots over the
window; `signals.extreme_experts`, ties to the lower id). An expert that leaves both sets keeps
its series for `expert_grace_s` seconds of event time (the records' timestamps, so idle time
does not count) and then loses it; at most K such leavers are kept per layer, those out longest
going first. So a layer never has more than 3K expert series (2K while no expert is leaving),
whatever its number of experts. Per layer beside them: `moescope_layer_dead_experts` and Jain's
fairness index `moescope_layer_load_fairness_ratio` (`signals.jain_fairness`), and with a
`placement` (a `moescope.metrics.placement.Placement`) three rank
figures, whatever the number of ranks: the rank signals of the rules (`compute_signals`),
`moescope_layer_rank_balancedness_ratio` (mean / max slots over ranks, vLLM's and SGLang's
balancedness) and `moescope_layer_rank_imbalance` ((max - mean) / mean, TensorRT-LLM's), and
`moescope_layer_hottest_rank` (its id, ties to the lower) with `moescope_layer_hottest_rank_load_ratio`
(its share of the slots). Probe drop reasons are capped too (MAX_DROP_REASONS). When a new run
starts in the same process the exporter starts over (counters reset, which `rate()` handles).

Expert cache: with `cache_capacity=C` (experts of a layer resident in device memory, for
offloaded serving), `moescope_layer_expert_cache_hit_ratio{layer,policy}` is the share of the
window's expert accesses whose expert was already resident, for policy lru, lfu and belady (the
offline optimum), replayed from the window's routes by `moescope.metrics.expert_cache` (its definitions: zero
experts and dropped slots are no access, a token's experts are needed at once). The cache starts
empty at the window's first replayed token, so compulsory misses count; at most the window's
last `cache_max_tokens` tokens are replayed, which bounds the work of a scrape. Only layers whose
records carry routes (`routes=True` at attach) get the series.

Compute time: with `compute_time=True` at attach, `moescope_layer_compute_seconds{layer}` is a histogram
of the seconds one forward spends in the MoE block. The probe times windows of forwards, so each
window adds its per-forward mean once per forward it covers: `_sum` is the layer's total time and
`_count` its forwards, exact; only the spread within a window is lost to the buckets.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from wsgiref.simple_server import WSGIServer

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from moescope.alerts.observations import (
    LayerHistory,
    LayerObservation,
    compute_signals,
    observations_from_record,
    summed_load,
)
from moescope.core.exporters import AttachListener, Exporter, ProbeStats, ProbeStatsReader
from moescope.core.records import RunInfo, StepRecord
from moescope.metrics import signals as sig
from moescope.metrics import traffic as wire
from moescope.metrics.expert_cache import POLICIES, cache_hit_rate, expert_accesses
from moescope.metrics.placement import LayerPlacements, Placement
from moescope.metrics.ranks import rank_load

log = logging.getLogger(__name__)

# rule signal -> (gauge name, help); `prometheus.rules` writes PromQL against exactly these
SIGNAL_METRICS: dict[str, tuple[str, str]] = {
    "load_cv": ("moescope_layer_load_cv", "Coefficient of variation of tokens per expert over the window"),
    "load_max_mean": ("moescope_layer_load_max_over_mean",
                      "Max/mean tokens per expert over the window (MaxVio + 1)"),
    "load_balancedness": ("moescope_layer_load_balancedness_ratio", "Mean/max tokens per expert over the window"),
    "kl_uniform": ("moescope_layer_load_kl_uniform_nats",
                   "KL divergence (nats) of the window's expert load from uniform"),
    "kl_baseline": ("moescope_layer_load_kl_baseline_nats",
                    "KL divergence (nats) of the window's expert load from the baseline"),
    "kl_baseline_latest_half": ("moescope_layer_load_kl_baseline_latest_half_nats",
                                "KL divergence (nats) of the expert load over the window's latest half of "
                                "its forwards from the baseline"),
    "router_entropy": ("moescope_layer_router_entropy_ratio",
                       "Mean per-token router entropy / ln(experts) over the window"),
    "dead_expert_fraction": ("moescope_layer_dead_expert_ratio", "Fraction of experts with no token over the window"),
    "lost_expert_fraction": ("moescope_layer_lost_expert_ratio",
                             "Fraction of experts with no token over the window whose baseline share predicted "
                             "at least 16 of its slots"),
    "lost_expert_alone_fraction": ("moescope_layer_lost_expert_alone_ratio",
                                   "The same, while the other experts' load kept its baseline shape (KL under 0.03 "
                                   "nats)"),
    "dropped_token_rate": ("moescope_layer_dropped_token_ratio", "Dropped tokens / tokens over the window"),
    "window_tokens": ("moescope_layer_window_tokens", "Tokens the layer routed over the window"),
    "router_entropy_rise": ("moescope_layer_router_entropy_rise_ratio",
                            "Router entropy / ln(experts) over the window minus over the run's baseline rows"),
    "dropped_token_rate_rise": ("moescope_layer_dropped_token_rise_ratio",
                                "Dropped-token rate over the window minus over the run's baseline rows"),
    "capacity_use": ("moescope_layer_capacity_use_ratio",
                     "Fullest expert's load / capacity, at the fullest forward of the window"),
    "active_param_fraction": (
        "moescope_layer_active_param_ratio",
        "Routed-expert parameters of this layer used per token / all model parameters",
    ),
    "routing_drift_rate": (
        "moescope_layer_routing_drift_per_1000_pairs",
        "Top-1 expert changes per 1000 adjacent token pairs over the window (needs routes)",
    ),
    "rank_balancedness": (
        "moescope_layer_rank_balancedness_ratio",
        "Mean / max slots per expert-parallel rank over the window (vLLM's and SGLang's balancedness; "
        "needs PrometheusExporter(placement=...))",
    ),
    "rank_imbalance": (
        "moescope_layer_rank_imbalance",
        "(max - mean) / mean slots per expert-parallel rank over the window (TensorRT-LLM's imbalance; "
        "needs PrometheusExporter(placement=...))",
    ),
    # what the placement costs on the wire (metrics.traffic; one series per layer each, never per rank pair)
    "remote_ranks_per_token": (
        "moescope_layer_remote_ranks_per_token",
        "Mean expert-parallel ranks other than its home a token's kept experts sit on over the window "
        "(DeepEP's GPU sends per token; home: the token's row in its forward mod ranks; needs routes and a placement)",
    ),
    "remote_nodes_per_token": (
        "moescope_layer_remote_nodes_per_token",
        "Mean nodes other than its home's a token's kept experts sit on over the window (RDMA sends per token; "
        "nodes of ranks_per_node ranks; needs routes and a placement)",
    ),
    "intra_node_share": (
        "moescope_layer_intra_node_send_ratio",
        "GPU sends that stay inside a node / all GPU sends over the window (needs routes and a placement)",
    ),
}
MAX_DROP_REASONS = 16
HOT_COLD_EXPERTS = 4  # K: per layer, the K hottest and K coldest experts get a series
EXPERT_GRACE_S = 300.0  # an expert that left them keeps its series this long (event time): Prometheus' lookback
# moescope_layer_compute_seconds buckets (upper bounds, seconds): a small layer on a GPU to a big one on a CPU
COMPUTE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Layer:
    def __init__(self, window_steps: int):
        self.history = LayerHistory(window_steps)
        self.tokens_total = 0
        self.dropped_total = 0
        self.window_load: np.ndarray | None = None  # the window's summed expert_load, zero experts included
        self.shown: dict[int, float] = {}  # expert -> last event time (s) it was among the hottest / coldest
        self.extremes: frozenset[int] = frozenset()  # the hottest and coldest of the current window
        self.baseline_parts: list[LayerObservation] = []
        self.baseline_forwards = 0
        self.compute_buckets = np.zeros(len(COMPUTE_BUCKETS) + 1, dtype=np.int64)  # last: above every bound
        self.compute_sum_s = 0.0


class PrometheusExporter(Exporter, AttachListener, ProbeStatsReader):
    """Probe exporter keeping per-layer windows; its collector serves them on `/metrics`."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        window_steps: int = 32,
        baseline_steps: int = 32,
        hot_cold_experts: int = HOT_COLD_EXPERTS,
        expert_grace_s: float = EXPERT_GRACE_S,
        placement: Placement | None = None,
        cache_capacity: int | None = None,
        cache_max_tokens: int = 4096,
        ranks_per_node: int = wire.DEFAULT_RANKS_PER_NODE,
    ):
        """Args:
            registry: where the collector registers; a fresh one of its own when None.
            window_steps: rows (forwards, or the probe's windows of forwards) the gauges cover.
            baseline_steps: forwards of each layer's start that form its baseline load.
            hot_cold_experts: K, the hottest and coldest experts per layer that get a series (0: none).
            expert_grace_s: seconds of event time an expert keeps its series after leaving them.
            placement: experts on ranks (`moescope.metrics.placement.Placement`); None: no rank series.
            cache_capacity: experts per layer resident in device memory, for the cache hit rate.
            cache_max_tokens: the most tokens of a window replayed for it.
            ranks_per_node: consecutive ranks of the placement that share a node, for the traffic series.

        Raises ValueError for a value out of range, saying which.
        """
        if window_steps < 1 or baseline_steps < 1:
            raise ValueError("window_steps and baseline_steps must be >= 1")
        if hot_cold_experts < 0 or not expert_grace_s >= 0:
            raise ValueError(f"hot_cold_experts (K experts per layer and side, 0 for none) and expert_grace_s "
                             f"(seconds) must be >= 0, not {hot_cold_experts} and {expert_grace_s}")
        if placement is not None and (not isinstance(placement, Placement) or int(placement.ranks) < 1):
            raise ValueError("placement must be a moescope.metrics.placement.Placement of at least one rank; build "
                             "one with Placement.contiguous(R) or moescope.analyses.placement.read_placement(FILE)")
        if (cache_capacity is not None and cache_capacity < 1) or cache_max_tokens < 1:
            raise ValueError("cache_capacity (experts resident per layer) and cache_max_tokens must be >= 1")
        self.cache_capacity = cache_capacity
        self.cache_max_tokens = cache_max_tokens
        self._routed_experts: dict[int, int] = {}
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.window_steps = window_steps
        self.baseline_steps = baseline_steps
        self.hot_cold_experts = int(hot_cold_experts)
        self.expert_grace_s = float(expert_grace_s)
        self.placement = placement
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, not {ranks_per_node}")
        self.ranks_per_node = int(ranks_per_node)
        # the placement's shares and wire layouts per layer, None (warned once) where it does not fit
        self._layer_placements = None if placement is None else LayerPlacements(
            placement, wire.default_rank_node(int(placement.ranks), self.ranks_per_node))
        self._lock = threading.Lock()
        self._run: RunInfo | None = None
        self._run_id: str | None = None
        self._model_class = ""
        self._layers: dict[int, _Layer] = {}
        self._baselines: dict[int, np.ndarray] = {}
        self._steps_total = 0
        self._last_ts = float("nan")
        self._active_ratio = float("nan")
        self._written: dict[str, float] = {}
        self._dropped: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._stats_source: Callable[[], ProbeStats] | None = None  # bound by the probe at attach
        self._server: WSGIServer | None = None
        self._server_thread: threading.Thread | None = None
        self._serving = threading.Lock()  # serve() and close() may run on different threads
        self._closed = False
        self.registry.register(_RoutingCollector(self))

    # -- the exporter interface --------------------------------------------------------------

    def on_attach(self, run: RunInfo) -> None:
        """Called by the probe at attach: names the run and its model, and takes records again
        (the same exporter may serve one session after another)."""
        with self._lock:
            self._start_run(run.run_id)
            self._model_class = run.model_class
            # routed experts per layer: ids past them are zero experts, never a cache access
            self._routed_experts = {info.layer: info.num_experts for info in run.layers}
            self._closed = False

    def _start_run(self, run_id: str) -> None:
        if run_id != self._run_id:
            self._run_id = run_id
            self._layers.clear()
            self._steps_total = 0

    def export(self, records: Sequence[StepRecord]) -> bool:
        if self._closed:
            return False
        with self._lock:
            for record in records:
                self._start_run(record.run_id)
                self._steps_total += record.forwards  # forward passes, whether recorded one by one or in windows
                self._last_ts = record.ts.timestamp()
                self._active_ratio = record.active_param_fraction
                observations = observations_from_record(record)
                for obs in observations:
                    self._add(obs)
                if self.hot_cold_experts:
                    self._update_shown(observations, record.ts.timestamp())
                for ls in record.layers:
                    layer = self._layers.get(ls.layer)
                    if layer is not None and ls.compute_time_s is not None and ls.forwards > 0:
                        per_forward = ls.compute_time_s / ls.forwards
                        layer.compute_buckets[np.searchsorted(COMPUTE_BUCKETS, per_forward)] += ls.forwards
                        layer.compute_sum_s += ls.compute_time_s
        return True

    def _add(self, obs: LayerObservation) -> None:
        layer = self._layers.get(obs.layer)
        if layer is None:
            layer = self._layers[obs.layer] = _Layer(self.window_steps)
        items = layer.history.items
        evicted = items[0] if len(items) == items.maxlen else None
        layer.history.append(obs)
        layer.tokens_total += obs.tokens
        layer.dropped_total += obs.dropped_tokens
        if layer.window_load is None or evicted is None or layer.window_load.shape != obs.expert_load.shape:
            layer.window_load = summed_load(items)
        else:  # a running sum: the window's newest row in, its oldest out
            layer.window_load += obs.expert_load
            layer.window_load -= evicted.expert_load
        if layer.baseline_forwards < self.baseline_steps:  # the first rows covering baseline_steps forwards
            layer.baseline_parts.append(obs)
            layer.baseline_forwards += max(int(obs.forwards), 1)

    def _update_shown(self, observations: Sequence[LayerObservation], now: float) -> None:
        """Mark each layer's hottest and coldest experts of its window as seen `now`; forget the leavers
        whose grace is over, and the ones out longest beyond K leavers. Layers of the same width are
        ranked in one call (`signals.extreme_experts` on their loads stacked)."""
        by_width: dict[int, list[tuple[_Layer, np.ndarray]]] = {}
        for obs in observations:
            layer = self._layers[obs.layer]
            assert layer.window_load is not None
            load = sig.routed_load(layer.window_load, self._routed_experts.get(obs.layer))
            if load.size and load.sum() > 0:
                by_width.setdefault(load.size, []).append((layer, load))
        for group in by_width.values():
            hot, cold = sig.extreme_experts(np.stack([load for _, load in group]), self.hot_cold_experts)
            for (layer, _), hot_ids, cold_ids in zip(group, hot.tolist(), cold.tolist()):
                layer.extremes = frozenset(hot_ids) | frozenset(cold_ids)
        for obs in observations:
            layer = self._layers[obs.layer]
            for expert in layer.extremes:
                layer.shown[expert] = now
            leavers = sorted((seen, expert) for expert, seen in layer.shown.items() if expert not in layer.extremes)
            over = len(leavers) - self.hot_cold_experts
            for i, (seen, expert) in enumerate(leavers):
                if i < over or now - seen > self.expert_grace_s:
                    del layer.shown[expert]

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        """Called by the probe when its session closes: take no more records. `/metrics` keeps
        serving the last values until `close()`; safe to call twice."""
        self._closed = True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving `/metrics`, free the port and take no more records; safe to call twice and
        from several threads. A scrape being answered gets its answer; waits at most `timeout_s` for
        the server's thread. The last values stay readable from the registry."""
        self._closed = True
        with self._serving:
            server, self._server = self._server, None
            thread, self._server_thread = self._server_thread, None
        if server is not None:
            server.shutdown()  # returns once serve_forever has (within its 0.5 s poll)
            server.server_close()  # the port is free from here
        if thread is not None:
            thread.join(timeout_s)

    @property
    def port(self) -> int | None:
        """The port `/metrics` is served on, or None when not serving."""
        server = self._server
        return None if server is None else server.server_address[1]

    # -- extra inputs --------------------------------------------------------------------------

    def observe_probe_stats(self, written: Mapping[str, float], dropped: Mapping) -> None:
        """Set the probe's health totals: rows written per table, and rows dropped per table.

        `dropped` maps `(table, reason)` (or a table alone, reason "unknown") to a running total.
        At most MAX_DROP_REASONS (table, reason) pairs are kept; later ones are summed as "other".
        """
        with self._lock:
            self._written = {str(k): float(v) for k, v in written.items()}
            self._dropped = OrderedDict()
            for key, value in dropped.items():
                table, reason = key if isinstance(key, tuple) else (key, "unknown")
                pair = (str(table), str(reason))
                if pair not in self._dropped and len(self._dropped) >= MAX_DROP_REASONS:
                    pair = (str(table), "other")
                self._dropped[pair] = self._dropped.get(pair, 0.0) + float(value)

    def set_baseline(self, layer: int, load: np.ndarray) -> None:
        """Pin a layer's baseline load (e.g. from a known-good run) instead of its first steps."""
        with self._lock:
            self._baselines[layer] = np.asarray(load, dtype=np.int64)

    def serve(self, port: int = 9464, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` on addr:port (port 0 picks a free one) until `close()`; return the port.

        The server belongs to the exporter, not to a probe session: it outlives the session's
        `with` block, so a scrape after it still answers with the last values. Raises
        RuntimeError when already serving, OSError when the port is taken.
        """
        with self._serving:
            if self._server is not None:
                raise RuntimeError(f"already serving on port {self._server.server_address[1]}; close() it first")
            server, thread = start_http_server(port, addr=addr, registry=self.registry)  # a daemon thread
            self._server, self._server_thread = server, thread
        return server.server_address[1]

    # -- what the collector reads -----------------------------------------------------------

    def bind_probe_stats(self, source: Callable[[], ProbeStats]) -> None:
        """Called by the probe at attach: `source()` returns (written, dropped) as in
        `observe_probe_stats`, and is read afresh at every scrape."""
        self._stats_source = source

    def _snapshot(self) -> dict:
        source = self._stats_source
        if source is not None:
            try:
                self.observe_probe_stats(*source())
            except Exception:  # noqa: BLE001 - a scrape must not fail because the probe went away
                pass
        with self._lock:
            layers = {}
            for index, layer in self._layers.items():
                baseline = self._baselines.get(index)
                baseline_rows = None  # the `_rise` signals compare with the run's own baseline rows only
                if baseline is None and layer.baseline_forwards >= self.baseline_steps:
                    baseline_rows = list(layer.baseline_parts)
                    baseline = np.sum([o.expert_load for o in baseline_rows], axis=0)
                layers[index] = {
                    "window": list(layer.history.items),
                    "tokens_total": layer.tokens_total,
                    "dropped_total": layer.dropped_total,
                    "window_load": None if layer.window_load is None else layer.window_load.copy(),
                    "shown": sorted(layer.shown),
                    "baseline": baseline,
                    "baseline_rows": baseline_rows,
                    "routed_experts": self._routed_experts.get(index),
                    "compute_buckets": layer.compute_buckets.copy(),
                    "compute_sum_s": layer.compute_sum_s,
                }
            return {
                "run_id": self._run_id,
                "model_class": self._model_class,
                "layers": layers,
                "steps_total": self._steps_total,
                "last_ts": self._last_ts,
                "active_ratio": self._active_ratio,
                "written": dict(self._written),
                "dropped": dict(self._dropped),
            }


class _RoutingCollector(Collector):
    def __init__(self, exporter: PrometheusExporter):
        self.exporter = exporter

    def describe(self) -> Iterator:
        return iter(())  # names depend on the data; nothing to pre-register

    def collect(self) -> Iterator:
        snap = self.exporter._snapshot()
        if snap["run_id"] is not None:
            info = InfoMetricFamily("moescope_run", "The run this process is recording")
            info.add_metric([], {"run_id": snap["run_id"], "model_class": snap["model_class"]})
            yield info
        steps = CounterMetricFamily("moescope_steps", "Forward passes recorded by the probe")
        steps.add_metric([], snap["steps_total"])
        yield steps
        for name, value, doc in (
            ("moescope_last_step_timestamp_seconds", snap["last_ts"], "Unix time of the latest recorded forward pass"),
            ("moescope_active_param_ratio", snap["active_ratio"], "Parameters used per token / all model parameters"),
        ):
            if not math.isnan(value):
                gauge = GaugeMetricFamily(name, doc)
                gauge.add_metric([], value)
                yield gauge

        tokens = CounterMetricFamily("moescope_layer_tokens", "Tokens routed by the layer", labels=["layer"])
        dropped = CounterMetricFamily("moescope_layer_dropped_tokens", "Tokens no expert processed", labels=["layer"])
        gauges = {s: GaugeMetricFamily(name, doc, labels=["layer"]) for s, (name, doc) in SIGNAL_METRICS.items()}
        for index, layer in sorted(snap["layers"].items()):
            label = [str(index)]
            tokens.add_metric(label, layer["tokens_total"])
            dropped.add_metric(label, layer["dropped_total"])
            values = compute_signals(layer["window"], SIGNAL_METRICS, layer["baseline"], layer["routed_experts"],
                                     self._rank_shares(index, layer), self._wire_layout(index, layer),
                                     layer["baseline_rows"])
            for signal, family in gauges.items():
                if not math.isnan(values[signal]):  # no data: no sample, so alerts neither fire nor resolve
                    family.add_metric(label, values[signal])
        yield tokens
        yield dropped
        yield from gauges.values()
        yield self._compute_time(snap["layers"])

        if self.exporter.cache_capacity is not None:
            yield self._cache_hits(snap["layers"], self.exporter.cache_capacity)
        yield from self._expert_families(snap["layers"])
        if self.exporter.placement is not None:
            yield from self._rank_families(snap["layers"])

        written = CounterMetricFamily("moescope_probe_records_written", "Rows the probe wrote, per table",
                                      labels=["table"])
        for table, value in sorted(snap["written"].items()):
            written.add_metric([table], value)
        yield written
        lost = CounterMetricFamily(
            "moescope_probe_records_dropped", "Rows the probe dropped, per table and reason", labels=["table", "reason"]
        )
        for (table, reason), value in snap["dropped"].items():
            lost.add_metric([table, reason], value)
        yield lost

    def _compute_time(self, layers: dict) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "moescope_layer_compute_seconds",
            "Seconds per forward in the MoE block (router and experts; compute_time=True): each recorded "
            "window's per-forward mean, counted once per forward of the window", labels=["layer"])
        for index, layer in sorted(layers.items()):
            counts = layer["compute_buckets"]
            if not counts.sum():
                continue
            cumulative = np.cumsum(counts)
            bounds = [repr(b) for b in COMPUTE_BUCKETS] + ["+Inf"]
            family.add_metric([str(index)], list(zip(bounds, cumulative.tolist())), layer["compute_sum_s"])
        return family

    def _cache_hits(self, layers: dict, capacity: int) -> GaugeMetricFamily:
        last = self.exporter.cache_max_tokens
        family = GaugeMetricFamily(
            "moescope_layer_expert_cache_hit_ratio",
            f"Share of the window's expert accesses already resident with {capacity} experts per layer in device "
            "memory (replayed from routes; policy lru, lfu or belady, the offline optimum)",
            labels=["layer", "policy"])
        for index, layer in sorted(layers.items()):
            routed = [o for o in layer["window"] if o.expert_ids is not None and len(o.expert_ids)]
            if not routed:
                continue
            ids = np.concatenate([o.expert_ids for o in routed])[-last:]
            kept = np.concatenate([o.kept if o.kept is not None else np.ones(o.expert_ids.shape, dtype=bool)
                                   for o in routed])[-last:]
            experts = layer["routed_experts"] or routed[-1].expert_load.size
            accesses = expert_accesses(ids, experts, kept)
            for policy in POLICIES:
                rate = cache_hit_rate(accesses, capacity, policy)
                if not math.isnan(rate):
                    family.add_metric([str(index), policy], rate)
        return family

    def _expert_families(self, layers: dict) -> Iterator:
        """Per layer: the dead experts, Jain's fairness index, and the shown experts' slot shares."""
        shares = GaugeMetricFamily(
            "moescope_expert_load_ratio",
            f"Share of the layer's slots over the window that went to the expert; only the "
            f"{self.exporter.hot_cold_experts} hottest and coldest experts of each layer, and for "
            f"{self.exporter.expert_grace_s:g} s those that left them", labels=["layer", "expert"])
        dead = GaugeMetricFamily("moescope_layer_dead_experts", "Routed experts with no token over the window",
                                 labels=["layer"])
        fairness = GaugeMetricFamily(
            "moescope_layer_load_fairness_ratio", "Jain's fairness index of tokens per routed expert over the "
            "window: (sum x)^2 / (n sum x^2), 1 when even, k/n when k of n experts share it evenly", labels=["layer"])
        for index, layer in sorted(layers.items()):
            load = layer["window_load"]
            if load is None or load.sum() <= 0:
                continue
            label = str(index)
            routed = sig.routed_load(load, layer["routed_experts"])
            dead.add_metric([label], sig.dead_expert_count(routed))
            fairness.add_metric([label], sig.jain_fairness(routed))
            share = sig.load_distribution(load)  # of all the layer's slots, zero experts' included
            for expert in layer["shown"]:
                shares.add_metric([label, str(expert)], float(share[expert]))
        yield dead
        yield fairness
        yield shares

    def _rank_shares(self, index: int, layer: dict) -> np.ndarray | None:
        """The placement's (routed experts, ranks) shares for a layer; None without a placement or a window."""
        placements = self.exporter._layer_placements
        if placements is None or layer["window_load"] is None:
            return None
        return placements.shares(index, sig.routed_load(layer["window_load"], layer["routed_experts"]).size)

    def _wire_layout(self, index: int, layer: dict) -> wire.WireLayout | None:
        """The placement's layout of a layer for the traffic series; None without a placement or a window."""
        placements = self.exporter._layer_placements
        if placements is None or layer["window_load"] is None:
            return None
        return placements.wire(index, sig.routed_load(layer["window_load"], layer["routed_experts"]).size)

    def _rank_families(self, layers: dict) -> Iterator:
        """Per layer, under the exporter's placement, what goes beside the rank signals of SIGNAL_METRICS:
        the hottest rank. One series per layer each whatever the ranks, the rank an id in the value."""
        hottest = GaugeMetricFamily("moescope_layer_hottest_rank", "The rank serving the most slots over the "
                                    "window (the lower id on a tie)", labels=["layer"])
        hottest_share = GaugeMetricFamily("moescope_layer_hottest_rank_load_ratio",
                                          "The hottest rank's share of the layer's slots over the window",
                                          labels=["layer"])
        for index, layer in sorted(layers.items()):
            shares = self._rank_shares(index, layer)
            if shares is None:
                continue
            ranks = rank_load(sig.routed_load(layer["window_load"], layer["routed_experts"]), shares)
            if ranks.sum() <= 0:
                continue
            label = [str(index)]
            top = int(np.argmax(ranks))
            hottest.add_metric(label, top)
            hottest_share.add_metric(label, float(ranks[top] / ranks.sum()))
        yield hottest
        yield hottest_share

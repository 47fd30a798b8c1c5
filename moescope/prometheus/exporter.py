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
`alerts.window.compute_signals` the rules engine uses) and yields fresh metric families, so no
state is carried between scrapes.

Cardinality is bounded by design: per-layer series carry only a `layer` label (one series per
MoE layer); the run is named once, in `moe_run_info`. Per-expert series
(`moe_expert_tokens_total{layer,expert}`) exist only with `per_expert=True`, and then at most
`max_expert_series` of them (the rest are counted in `moe_expert_series_omitted`). Probe drop
reasons are capped the same way. When a new run starts in the same process the exporter starts
over (counters reset, which `rate()` handles).

Expert cache: with `cache_capacity=C` (experts of a layer resident in device memory, for
offloaded serving), `moe_layer_expert_cache_hit_ratio{layer,policy}` is the share of the
window's expert accesses whose expert was already resident, for policy lru, lfu and belady (the
offline optimum), replayed from the window's routes by `alerts.cache` (its definitions: zero
experts and dropped slots are no access, a token's experts are needed at once). The cache starts
empty at the window's first replayed token, so compulsory misses count; at most the window's
last `cache_max_tokens` tokens are replayed, which bounds the work of a scrape. Only layers whose
records carry routes (`routes=True` at attach) get the series.

Compute time: with `compute_time=True` at attach, `moe_layer_compute_seconds{layer}` is a histogram
of the seconds one forward spends in the MoE block. The probe times windows of forwards, so each
window adds its per-forward mean once per forward it covers: `_sum` is the layer's total time and
`_count` its forwards, exact; only the spread within a window is lost to the buckets.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from wsgiref.simple_server import WSGIServer

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from moescope.alerts.observations import LayerHistory, LayerObservation, compute_signals, observations_from_record
from moescope.core.exporters import AttachListener, Exporter, ProbeStats, ProbeStatsReader
from moescope.core.records import RunInfo, StepRecord
from moescope.metrics.expert_cache import POLICIES, cache_hit_rate, expert_accesses

# rule signal -> (gauge name, help); `alerts.promrules` writes PromQL against exactly these
SIGNAL_METRICS: dict[str, tuple[str, str]] = {
    "load_cv": ("moe_layer_load_cv", "Coefficient of variation of tokens per expert over the window"),
    "load_max_mean": ("moe_layer_load_max_mean_ratio", "Max/mean tokens per expert over the window (MaxVio + 1)"),
    "load_balancedness": ("moe_layer_load_balancedness_ratio", "Mean/max tokens per expert over the window"),
    "kl_uniform": ("moe_layer_load_kl_uniform", "KL divergence (nats) of the window's expert load from uniform"),
    "kl_baseline": ("moe_layer_load_kl_baseline", "KL divergence (nats) of the window's expert load from the baseline"),
    "router_entropy": ("moe_layer_router_entropy_ratio", "Mean per-token router entropy / ln(experts) over the window"),
    "dead_expert_fraction": ("moe_layer_dead_expert_ratio", "Fraction of experts with no token over the window"),
    "dropped_token_rate": ("moe_layer_dropped_token_ratio", "Dropped tokens / tokens over the window"),
    "capacity_use": ("moe_layer_capacity_use_ratio", "Fullest expert's load / capacity, mean over the window"),
    "active_param_fraction": (
        "moe_layer_active_param_ratio",
        "Routed-expert parameters of this layer used per token / all model parameters",
    ),
    "routing_drift_rate": (
        "moe_layer_routing_drift_per_1000_pairs",
        "Top-1 expert changes per 1000 adjacent token pairs over the window (needs routes)",
    ),
}
MAX_DROP_REASONS = 16
# moe_layer_compute_seconds buckets (upper bounds, seconds): a small layer on a GPU to a big one on a CPU
COMPUTE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Layer:
    def __init__(self, window_steps: int):
        self.history = LayerHistory(window_steps)
        self.tokens_total = 0
        self.dropped_total = 0
        self.expert_tokens_total: np.ndarray | None = None
        self.baseline_parts: list[np.ndarray] = []
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
        per_expert: bool = False,
        max_expert_series: int = 256,
        cache_capacity: int | None = None,
        cache_max_tokens: int = 4096,
    ):
        if window_steps < 1 or baseline_steps < 1 or max_expert_series < 0:
            raise ValueError("window_steps and baseline_steps must be >= 1, max_expert_series >= 0")
        if (cache_capacity is not None and cache_capacity < 1) or cache_max_tokens < 1:
            raise ValueError("cache_capacity (experts resident per layer) and cache_max_tokens must be >= 1")
        self.cache_capacity = cache_capacity
        self.cache_max_tokens = cache_max_tokens
        self._routed_experts: dict[int, int] = {}
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.window_steps = window_steps
        self.baseline_steps = baseline_steps
        self.per_expert = per_expert
        self.max_expert_series = max_expert_series
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
                for obs in observations_from_record(record):
                    self._add(obs)
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
        layer.history.append(obs)
        layer.tokens_total += obs.tokens
        layer.dropped_total += obs.dropped_tokens
        if self.per_expert:
            if layer.expert_tokens_total is None or layer.expert_tokens_total.size != obs.expert_load.size:
                layer.expert_tokens_total = np.zeros(obs.expert_load.size, dtype=np.int64)
            layer.expert_tokens_total += obs.expert_load
        if layer.baseline_forwards < self.baseline_steps:  # the first rows covering baseline_steps forwards
            layer.baseline_parts.append(obs.expert_load)
            layer.baseline_forwards += max(int(obs.forwards), 1)

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
                if baseline is None and layer.baseline_forwards >= self.baseline_steps:
                    baseline = np.sum(layer.baseline_parts, axis=0)
                layers[index] = {
                    "window": list(layer.history.items),
                    "tokens_total": layer.tokens_total,
                    "dropped_total": layer.dropped_total,
                    "expert_tokens_total": (None if layer.expert_tokens_total is None
                                            else layer.expert_tokens_total.copy()),
                    "baseline": baseline,
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
            info = InfoMetricFamily("moe_run", "The run this process is recording")
            info.add_metric([], {"run_id": snap["run_id"], "model_class": snap["model_class"]})
            yield info
        steps = CounterMetricFamily("moe_steps", "Forward passes recorded by the probe")
        steps.add_metric([], snap["steps_total"])
        yield steps
        for name, value, doc in (
            ("moe_last_step_timestamp_seconds", snap["last_ts"], "Unix time of the latest recorded forward pass"),
            ("moe_active_param_ratio", snap["active_ratio"], "Parameters used per token / all model parameters"),
        ):
            if not math.isnan(value):
                gauge = GaugeMetricFamily(name, doc)
                gauge.add_metric([], value)
                yield gauge

        tokens = CounterMetricFamily("moe_layer_tokens", "Tokens routed by the layer", labels=["layer"])
        dropped = CounterMetricFamily("moe_layer_dropped_tokens", "Tokens no expert processed", labels=["layer"])
        gauges = {s: GaugeMetricFamily(name, doc, labels=["layer"]) for s, (name, doc) in SIGNAL_METRICS.items()}
        for index, layer in sorted(snap["layers"].items()):
            label = [str(index)]
            tokens.add_metric(label, layer["tokens_total"])
            dropped.add_metric(label, layer["dropped_total"])
            values = compute_signals(layer["window"], SIGNAL_METRICS, layer["baseline"], layer["routed_experts"])
            for signal, family in gauges.items():
                if not math.isnan(values[signal]):  # no data: no sample, so alerts neither fire nor resolve
                    family.add_metric(label, values[signal])
        yield tokens
        yield dropped
        yield from gauges.values()
        yield self._compute_time(snap["layers"])

        if self.exporter.cache_capacity is not None:
            yield self._cache_hits(snap["layers"], self.exporter.cache_capacity)
        if self.exporter.per_expert:
            yield from self._per_expert(snap["layers"])

        written = CounterMetricFamily("moe_probe_records_written", "Rows the probe wrote, per table", labels=["table"])
        for table, value in sorted(snap["written"].items()):
            written.add_metric([table], value)
        yield written
        lost = CounterMetricFamily(
            "moe_probe_records_dropped", "Rows the probe dropped, per table and reason", labels=["table", "reason"]
        )
        for (table, reason), value in snap["dropped"].items():
            lost.add_metric([table, reason], value)
        yield lost

    def _compute_time(self, layers: dict) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "moe_layer_compute_seconds",
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
            "moe_layer_expert_cache_hit_ratio",
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

    def _per_expert(self, layers: dict) -> Iterator:
        cap = self.exporter.max_expert_series
        family = CounterMetricFamily(
            "moe_expert_tokens", "Tokens routed to each expert (per_expert=True only)", labels=["layer", "expert"]
        )
        emitted = omitted = 0
        for index, layer in sorted(layers.items()):
            totals = layer["expert_tokens_total"]
            if totals is None:
                continue
            for expert, value in enumerate(totals):
                if emitted < cap:
                    family.add_metric([str(index), str(expert)], int(value))
                    emitted += 1
                else:
                    omitted += 1
        yield family
        gauge = GaugeMetricFamily(
            "moe_expert_series_omitted", "Per-expert series left out because of max_expert_series"
        )
        gauge.add_metric([], omitted)
        yield gauge

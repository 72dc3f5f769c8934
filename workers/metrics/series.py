"""Prometheus metrics of a worker (served with `pagedbatch worker --metrics-port`).

Counted as the engine runs: tokens in and out, prefix-cache queries and hits (tokens), step time,
failed steps, shard durations by outcome. Read from the engine when scraped: running and waiting
sequences, KV blocks used and free, preemptions. Every series carries the worker's `model` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from settings import PlatformSettings, current
from workers.metrics.http import serve_with_token

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
SHARD_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)


class EngineCollector:
    """The engine's state at scrape time (`StepEngine.load`)."""

    def __init__(self, host, model: str):
        self.host = host
        self.model = model

    def collect(self):
        load = self.host.engine.load()
        yield self._gauge("pagedbatch_sequences_running", "Sequences in the running batch", load.running)
        yield self._gauge("pagedbatch_sequences_waiting", "Sequences waiting to be scheduled", load.waiting)
        yield self._gauge("pagedbatch_kv_blocks_free", "Free KV-cache blocks", load.blocks_free)
        yield self._gauge("pagedbatch_kv_blocks_used", "KV-cache blocks in use", load.blocks_total - load.blocks_free)
        preemptions = CounterMetricFamily(
            "pagedbatch_preemptions", "Sequences preempted (blocks freed, recomputed later)", labels=["model"]
        )
        preemptions.add_metric([self.model], load.preemptions)
        yield preemptions

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, documentation, labels=["model"])
        gauge.add_metric([self.model], value)
        return gauge


class WorkerMetrics:
    """One worker's metrics in their own registry; EngineHost calls `step_done`/`step_failed`."""

    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, ["model"], registry=self.registry).labels(model)

        self.prompt_tokens = counter("pagedbatch_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("pagedbatch_generation_tokens", "Tokens generated for finished requests")
        self.requests_finished = counter("pagedbatch_requests_finished", "Requests the engine finished")
        self.cache_queries = counter("pagedbatch_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.cache_hits = counter("pagedbatch_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.engine_errors = counter("pagedbatch_engine_errors", "Engine steps that raised")
        self.step_seconds = Histogram(
            "pagedbatch_engine_step_seconds",
            "Time of one engine step",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.ttft_seconds = Histogram(
            "pagedbatch_time_to_first_token_seconds",
            "Arrival to first token (side: local, or prefill for a prefill worker's half of a split request)",
            ["model", "side"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot_seconds = Histogram(
            "pagedbatch_time_per_output_token_seconds",
            "Mean time per token after the first, per finished request",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.shard_seconds = Histogram(
            "pagedbatch_shard_duration_seconds",
            "Time to run one shard task, by outcome",
            ["model", "outcome"],
            buckets=SHARD_BUCKETS,
            registry=self.registry,
        )

    def watch(self, host) -> None:
        """Report `host`'s engine state at scrape time and count its steps."""
        self.registry.register(EngineCollector(host, self.model))
        host.observer = self

    def step_done(self, outputs, seconds: float | None) -> None:
        """A step's time (None: not a step, outputs that an engine process handed over)."""
        if seconds is not None:
            self.step_seconds.observe(seconds)
        for output in outputs:
            self._latencies(output)
            if not getattr(output, "finished", True):
                continue
            ids = getattr(output, "prompt_token_ids", None) or ()
            # a multi-input pooling (embeddings) output holds one id list per input
            prompt = sum(map(len, ids)) if ids and isinstance(ids[0], list) else len(ids)
            self.requests_finished.inc()
            self.prompt_tokens.inc(prompt)
            self.cache_queries.inc(prompt)
            self.cache_hits.inc(getattr(output, "num_cached_tokens", 0) or 0)
            choices = getattr(output, "outputs", ())
            if isinstance(choices, list):  # a pooling output has no generated tokens
                self.generation_tokens.inc(sum(len(c.token_ids) for c in choices))

    def _latencies(self, output) -> None:
        times = getattr(output, "metrics", None) or {}
        arrival, first, end = times.get("arrival_time"), times.get("first_token_time"), times.get("finished_time")
        if arrival is None or first is None:
            return
        if getattr(output, "kv_export", None) is not None:
            self.ttft_seconds.labels(self.model, "prefill").observe(max(0.0, first - arrival))
            return
        if not getattr(output, "finished", True):
            return
        # A decode worker's imported request got its first token on the prefill worker, before it
        # arrived here; its wait for that shows as pagedbatch_kv_transfer_seconds.
        if first >= arrival:
            self.ttft_seconds.labels(self.model, "local").observe(first - arrival)
        tokens = max((len(c.token_ids) for c in getattr(output, "outputs", ())), default=0)
        if end is not None and tokens > 1:
            self.tpot_seconds.observe(max(0.0, end - first) / (tokens - 1))

    def step_failed(self, _exc: BaseException) -> None:
        self.engine_errors.inc()

    def shard_done(self, outcome: str, seconds: float) -> None:
        self.shard_seconds.labels(self.model, outcome).observe(seconds)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        token = current(PlatformSettings).metrics_token
        if token:  # the API's /metrics token protects the worker's port too
            serve_with_token(self.registry, port, token, addr)
        else:
            start_http_server(port, addr=addr, registry=self.registry)

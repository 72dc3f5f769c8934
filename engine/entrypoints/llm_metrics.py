"""`LLM.get_metrics()`: the engine's counters under vLLM's metric names and shapes
(`vllm.v1.metrics.reader`: Counter and Gauge with name, labels, value)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


def engine_metrics(engine) -> list[Metric]:
    stats, scheduler = engine.stats, engine.scheduler
    metrics: list[Metric] = [
        Counter("vllm:prompt_tokens", value=stats["prompt_tokens"]),
        Counter("vllm:generation_tokens", value=stats["generation_tokens"]),
        Counter("vllm:num_preemptions", value=scheduler.num_preemptions),
        Gauge("vllm:num_requests_running", value=len({s.request_id for s in scheduler.running})),
        Gauge("vllm:num_requests_waiting", value=len({s.request_id for s in scheduler.waiting})),
        Gauge("vllm:kv_cache_usage_perc", value=1.0 - engine.num_free_blocks() / engine.block_manager.num_blocks),
    ]
    for reason, count in sorted(stats["finished_reasons"].items()):
        metrics.append(Counter("vllm:request_success", {"finished_reason": reason}, count))
    return metrics

"""Quotes and estimates: what a file will cost and when it will be done, before anything runs.

`quote_file` validates and plans the file exactly as validation would (same windows, same
`batchfile.prefix_plan`), writing nothing, and estimates its run time from the workers' measured step rates
(`workers.host.step_rates`, published by their heartbeats): per worker, step seconds = overhead + tokens
computed x a, fitted by least squares; decode steps follow from how many of the job's sequences the worker's
KV pool holds at once (shared prefix blocks held once). The jobs of the same model still
running or validating are the queue ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import IO

import numpy as np
from sqlalchemy import select

from batchfile.prefix_plan import PlanLine, plan_shards, window_lines
from batchfile.shard_input import BadLine, validate_stream
from store import models_registry
from store.db import session_scope
from store.lifecycle.progress import Progress, job_progress
from store.models import IN_PROGRESS, VALIDATING, Job, utcnow
from store.settings import Settings


@dataclass
class Work:
    """What a job asks of the workers: lines, prompt tokens (those the cache serves apart), completion tokens."""

    lines: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def scaled(self, fraction: float) -> Work:
        f = max(0.0, min(1.0, fraction))
        values = (self.lines, self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        return Work(*(round(v * f) for v in values))


@dataclass
class Quote:
    lines: int
    invalid_lines: int
    shards: int
    work: Work
    workers: int
    run_seconds: float | None  # None: no worker has measured its rates yet
    queue_seconds: float | None
    now: datetime

    @property
    def start_at(self) -> datetime | None:
        return None if self.queue_seconds is None else self.now + timedelta(seconds=self.queue_seconds)

    @property
    def completion_at(self) -> datetime | None:
        start = self.start_at
        return None if start is None or self.run_seconds is None else start + timedelta(seconds=self.run_seconds)


def plan_file(settings: Settings, source: IO[bytes], models, *, endpoint, defaults, bounds, workers: int):
    """(valid lines, invalid lines, shards, Work) of the file as validation would plan it."""
    window = settings.plan_window_lines if settings.plan_prefixes else 1
    pending: dict[str, list[PlanLine]] = {}
    work, invalid, shards = Work(), 0, 0

    def flush(lines: list[PlanLine]) -> None:
        nonlocal shards
        planned = plan_shards(
            lines,
            shard_size=settings.shard_size,
            workers=workers,
            block_size=settings.plan_block_size,
            planned=settings.plan_prefixes,
        )
        shards += len(planned)
        work.cached_tokens += sum(shard.expected_cached for shard in planned)
        lines.clear()

    stream = validate_stream(
        source, models, endpoint=endpoint, defaults=defaults, bounds=bounds, block_size=settings.plan_block_size
    )
    for item in stream:
        if isinstance(item, BadLine):
            invalid += 1
            continue
        work.lines += 1
        work.prompt_tokens += item.prompt_tokens
        work.completion_tokens += item.max_tokens
        lines = pending.setdefault(item.model, [])
        lines.append(item.plan_line)
        if len(lines) >= window_lines(window, settings.shard_size, shards):
            flush(lines)
    for lines in pending.values():
        if lines:
            flush(lines)
    return work.lines, invalid, shards, work


def _fit(rates: dict) -> tuple[float, float] | None:
    """(seconds per step, per token computed) from a worker's step sums; None before it ran. Prefill and decode
    tokens cost alike here: within one workload a step's decode count barely varies, so it cannot be told apart
    from the step's own overhead, which is what carries over to a job whose steps batch differently."""
    n = rates.get("n", 0)
    if n < 3:
        return None
    t = rates["p"] + rates["d"]
    tt = rates["pp"] + 2 * rates["pd"] + rates["dd"]
    ty = rates["py"] + rates["dy"]
    normal = np.array([[n, t], [t, tt]])
    coef, *_ = np.linalg.lstsq(normal, np.array([rates["y"], ty]), rcond=None)
    if (coef < 0).any():  # too few kinds of step to tell the overhead apart: one cost per token
        return 0.0, rates["y"] / max(1.0, t)
    return float(coef[0]), float(coef[1])


def _seconds_on(rates: dict, work: Work) -> float | None:
    """One worker's time for `work`: its decode steps' overhead and every token it computes."""
    fit = _fit(rates)
    if fit is None:
        return None
    step, per_token = fit
    pool = rates.get("pool") or {}
    lines = max(1, work.lines)
    block_size = pool.get("block_size") or 16
    shared_blocks = work.cached_tokens // lines // block_size  # a line's blocks the cache serves: held once
    own_blocks = max(1, -(-(work.prompt_tokens + work.completion_tokens) // lines // block_size) - shared_blocks)
    fits = (pool.get("blocks") or own_blocks) // own_blocks
    at_once = max(1, min(pool.get("max_num_seqs") or lines, fits, lines))
    decode_steps = work.completion_tokens / at_once
    computed = work.prompt_tokens - work.cached_tokens + work.completion_tokens
    return step * decode_steps + per_token * computed


def estimate_seconds(settings: Settings, model: str | None, work: Work) -> float | None:
    """The time the model's workers need for `work`, spread evenly over them; None while none has measured."""
    workers = models_registry.worker_throughput(settings, model) if model else []
    times = [t for t in (_seconds_on(rates, work.scaled(1 / len(workers))) for rates in workers) if t is not None]
    if not times:
        return None
    return max(times)  # each worker takes its share; the job ends with the slowest


def job_work(settings: Settings, job: Job) -> Work:
    """What is left of a job's planned work."""
    progress = job_progress(settings, job)
    valid = max(1, job.request_total - job.invalid_lines)
    planned = Work(valid, job.planned_prompt_tokens, job.planned_cached_tokens, job.planned_completion_tokens)
    return planned.scaled(1 - progress.requests_done / valid)


def queue_ahead(settings: Settings, model: str | None, exclude: str | None = None) -> float | None:
    """Seconds of work the model's running and validating jobs still hold (None: no measured rates)."""
    with session_scope(settings.database_url) as s:
        jobs = list(
            s.scalars(
                select(Job).where(
                    Job.status.in_((IN_PROGRESS, VALIDATING)),
                    (Job.served_model == model) | (Job.model == model),
                )
            )
        )
        s.expunge_all()
    left = Work()
    for job in jobs:
        if job.id != exclude:
            w = job_work(settings, job)
            left = Work(*(a + b for a, b in zip(vars(left).values(), vars(w).values(), strict=True)))
    return estimate_seconds(settings, model, left) if left.lines else 0.0


def estimated_completion(job: Job, progress: Progress, now: datetime | None = None) -> datetime | None:
    """A running job's finish: now plus its requests left at the rate it has finished them since it started
    running; None before its first request finished or once it is over."""
    if job.status not in (IN_PROGRESS, VALIDATING) or not progress.requests_done or job.in_progress_at is None:
        return None
    now = now or utcnow()
    elapsed = (now - job.in_progress_at).total_seconds()
    if elapsed <= 0:
        return None
    left = max(0, progress.requests_valid - progress.requests_done)
    return now + timedelta(seconds=left * elapsed / progress.requests_done)


def quote_file(settings: Settings, source: IO[bytes], models, model: str, **validation) -> Quote:
    """Validate and plan the file without writing anything; estimate its run and finish time."""
    workers = models_registry.worker_count(settings, model)
    lines, invalid, shards, work = plan_file(settings, source, models, workers=workers, **validation)
    run = estimate_seconds(settings, model, work)
    ahead = queue_ahead(settings, model)
    return Quote(lines, invalid, shards, work, workers, run, ahead, utcnow())

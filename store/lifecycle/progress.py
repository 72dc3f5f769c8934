"""A job's live counts: from its finished shards while it runs, from the job row once it is final."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from store.db import session_scope
from store.lifecycle.jobs import tenant_job
from store.models import CANCELLED, COMPLETED, EXPIRED, FAILED, Job, Shard
from store.settings import Settings


@dataclass
class Progress:
    completed: int
    failed: int  # requests that failed running (invalid lines are counted apart)
    cancelled: int
    prompt_tokens: int
    completion_tokens: int
    requests_done: int  # valid requests finished
    requests_valid: int
    cached_tokens: int = 0  # of prompt_tokens, those read from the prefix cache


def get_job_and_progress(settings: Settings, tenant: str, job_id: str) -> tuple[Job, Progress]:
    """The job and its live counts in one transaction: what a poll reads."""
    with session_scope(settings.database_url) as s:
        job = tenant_job(s, tenant, job_id)
        return job, job_progress(settings, job, session=s)


def job_progress(settings: Settings, job: Job, session: Session | None = None) -> Progress:
    """The job's counts; with `session`, read in that transaction rather than a new one."""
    valid = job.request_total - job.invalid_lines
    if job.status in (COMPLETED, CANCELLED, FAILED, EXPIRED):
        return Progress(
            job.request_completed,
            max(job.request_failed - job.invalid_lines, 0),
            job.request_cancelled,
            job.prompt_tokens,
            job.completion_tokens,
            valid,
            valid,
            job.cached_tokens,
        )
    if not job.shard_count:
        return Progress(0, 0, 0, 0, 0, 0, valid)
    params = {"job_id": job.id}
    if session is not None:
        row = session.execute(_progress_query(), params).one()
    else:
        with session_scope(settings.database_url) as s:
            row = s.execute(_progress_query(), params).one()
    *counts, done, cached = (int(v) for v in row)
    return Progress(*counts, done, valid, cached)


@functools.cache
def _progress_query():
    """Built once: pollers run it many times a second."""
    return select(
        func.coalesce(func.sum(Shard.completed), 0),
        func.coalesce(func.sum(Shard.failed), 0),
        func.coalesce(func.sum(Shard.cancelled), 0),
        func.coalesce(func.sum(Shard.prompt_tokens), 0),
        func.coalesce(func.sum(Shard.completion_tokens), 0),
        # finished requests, also of running shards (they record their counts as they go)
        func.coalesce(func.sum(Shard.completed + Shard.failed + Shard.cancelled), 0),
        func.coalesce(func.sum(Shard.cached_tokens), 0),
    ).where(Shard.job_id == bindparam("job_id"))

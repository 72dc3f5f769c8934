"""A claimant that failed (a validator, a shard writer, a finalizer) gives its claim back at once and records on
the job why it waits (`status_detail`, e.g. "storage_full: finalizing will retry") and when it is tried again
(`retry_at`, backoff with jitter, capped at `storage_retry_max_s`); the sweeper tries it then. A permanent
storage failure (permission, a missing file), or a wait past `storage_give_up_s`, fails the job with the
fault's code and sentence. The stale timeouts stay only for claimants that died without raising.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from store.db import session_scope
from store.filestore.storage_faults import StorageFault, backoff_s, storage_fault
from store.models import FAILED, SHARD_CANCELLED, SHARD_HELD, SHARD_QUEUED, TERMINAL_STATUSES, Job, Shard, utcnow
from store.settings import Settings

WAITING, FAILED_NOW = "waiting", "failed"
Release = Callable[[Session, Job], None]  # gives the claim back, in the job's locked transaction


def record_failure(settings: Settings, job_id: str, exc: BaseException, op: str, then: str, release: Release) -> str:
    """Record why the job waits (or fail it) and give the claim back (`release`, called last, in the same
    transaction); returns WAITING or FAILED_NOW.

    `op` names the work in the fault's sentence ("finalizing the results"), `then` the retry in the job's
    status_detail ("finalizing will retry")."""
    fault = storage_fault(exc, op)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None:
            return FAILED_NOW
        outcome = _wait_or_fail(settings, s, job, fault, then)
        release(s, job)
        return outcome


def _wait_or_fail(settings: Settings, s: Session, job: Job, fault: StorageFault | None, then: str) -> str:
    if job.status in TERMINAL_STATUSES:
        return FAILED_NOW
    now = utcnow()
    since = job.storage_failing_since or now
    if fault is not None and not fault.retryable:
        fail_job(s, job, fault.code, fault.message)
        return FAILED_NOW
    if (now - since).total_seconds() > settings.storage_give_up_s:
        code = fault.code if fault is not None else "internal_error"
        message = fault.message if fault is not None else f"{then.split(' will', 1)[0]} kept failing."
        fail_job(s, job, code, f"{message} Gave up after {settings.storage_give_up_s:.0f}s of retries.")
        return FAILED_NOW
    job.storage_failures = (job.storage_failures or 0) + 1
    job.storage_failing_since = since
    delay = backoff_s(job.storage_failures, 1.0, settings.storage_retry_max_s)
    job.retry_at = now + timedelta(seconds=delay)
    job.status_detail = (fault.detail(then) if fault is not None else f"internal_error: {then}")[:512]
    return WAITING


def fail_job(s: Session, job: Job, code: str, message: str) -> None:
    """The job fails with one job-level error (no line); shards not yet run are cancelled."""
    now = utcnow()
    job.status, job.failed_at = FAILED, now
    job.validated_at = job.validated_at or now
    job.errors = [*(job.errors or []), {"code": code, "message": message, "param": None, "line": None}]
    clear_wait(job)
    s.execute(
        update(Shard)
        .where(Shard.job_id == job.id, Shard.status.in_((SHARD_QUEUED, SHARD_HELD)))
        .values(status=SHARD_CANCELLED, finished_at=now, retry_at=None)
    )


def clear_wait(job: Job) -> None:
    """The job moved on: no reason to show, no backoff left."""
    if job.status_detail is not None or job.retry_at is not None or job.storage_failures:
        job.status_detail, job.retry_at, job.storage_failing_since, job.storage_failures = None, None, None, 0


def due(job: Job) -> bool:
    """Whether a job whose claim was given back may be claimed again now."""
    return job.retry_at is None or job.retry_at <= utcnow()

"""Stopping a job: cancelled by its tenant, or expired past its completion window.

Queued shards are dropped at once; running ones are aborted by their workers' cancel watchers, which ask
`cancelling_jobs`; the finalizer then writes a row for every request that did not run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sqlalchemy import select, update

from store.db import session_scope
from store.errors import Conflict
from store.lifecycle.finalize import maybe_finalize
from store.lifecycle.jobs import get_job, tenant_job
from store.models import (
    CANCELLED,
    CANCELLING,
    EXPIRED,
    IN_PROGRESS,
    SHARD_CANCELLED,
    SHARD_QUEUED,
    VALIDATING,
    Job,
    Shard,
    utcnow,
)
from store.settings import Settings

log = logging.getLogger(__name__)


def cancel_job(settings: Settings, tenant: str, job_id: str) -> Job:
    """Mark the job cancelling and drop its queued shards (Conflict once it is finalizing or final)."""
    with session_scope(settings.database_url) as s:
        job = tenant_job(s, tenant, job_id, for_update=True)
        if job.status in (CANCELLING, CANCELLED):
            return job
        if job.status not in (VALIDATING, IN_PROGRESS):
            raise Conflict(f"Cannot cancel a batch with status {job.status}.")
        job.status = CANCELLING
        job.cancelling_at = utcnow()
        s.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == SHARD_QUEUED)
            .values(status=SHARD_CANCELLED, finished_at=utcnow())
        )
    maybe_finalize(settings, job_id)
    return get_job(settings, tenant, job_id)


def expire_job(settings: Settings, job_id: str) -> bool:
    """Stop a job past its completion window; the finalizer makes it `expired`, keeping what finished.
    False when the job is not running or not yet due."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        now = utcnow()
        if job is None or job.status != IN_PROGRESS or job.expired_at is not None:
            return False
        if job.expires_at is None or job.expires_at > now:
            return False
        job.expired_at = now
        s.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == SHARD_QUEUED)
            .values(status=SHARD_CANCELLED, finished_at=now, lease_until=None)
        )
    log.info("job %s expired", job_id)
    maybe_finalize(settings, job_id)
    return True


def cancelling_jobs(settings: Settings, job_ids: Iterable[str]) -> set[str]:
    """Which of these jobs must stop their requests: cancelled, or past their completion window."""
    job_ids = list(job_ids)
    if not job_ids:
        return set()
    stopping = Job.status.in_((CANCELLING, CANCELLED, EXPIRED)) | Job.expired_at.is_not(None)
    with session_scope(settings.database_url) as s:
        return set(s.scalars(select(Job.id).where(Job.id.in_(job_ids), stopping)))


def stop_reason(settings: Settings, job_id: str) -> str | None:
    """Why a job's unfinished requests were stopped: "expired", "cancelled" or None."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None:
            return None
        if job.expired_at is not None:
            return "expired"
        return "cancelled" if job.status in (CANCELLING, CANCELLED) else None

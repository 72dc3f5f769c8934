"""Per-tenant limits on active jobs and queued requests, checked when a job is created.

A tenant's row in `tenants` may override the settings' limits (NULL: the settings'; 0: unlimited).
The check runs in the transaction that inserts the job, under a per-tenant advisory lock, so two
concurrent submissions cannot both take the last free place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from store.errors import StoreError
from store.models import (
    ACTIVE_STATUSES,
    SHARD_QUEUED,
    SHARD_RUNNING,
    VALIDATING,
    File,
    Job,
    Shard,
    Tenant,
)
from store.settings import Settings


class LimitExceeded(StoreError):
    """A 429: the tenant may try again once some of its work has finished."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.headers = {"Retry-After": str(max(int(retry_after), 1))}


@dataclass(frozen=True)
class Limits:
    max_active_jobs: int  # 0: unlimited
    max_queued_requests: int


@dataclass(frozen=True)
class Usage:
    active_jobs: int
    queued_requests: int


def limits_for(session: Session, settings: Settings, tenant: str) -> Limits:
    row = session.get(Tenant, tenant)
    jobs = row.max_active_jobs if row is not None and row.max_active_jobs is not None else None
    queued = row.max_queued_requests if row is not None and row.max_queued_requests is not None else None
    return Limits(
        settings.max_active_jobs_per_tenant if jobs is None else jobs,
        settings.max_queued_requests_per_tenant if queued is None else queued,
    )


def usage(session: Session, tenant: str) -> Usage:
    """Jobs not yet finished, and requests not yet run: those in queued or running shards, plus the lines
    of jobs still being validated (their shards do not exist yet)."""
    active = session.scalar(
        select(func.count()).select_from(Job).where(Job.tenant == tenant, Job.status.in_(ACTIVE_STATUSES))
    )
    in_shards = session.scalar(
        select(func.coalesce(func.sum(Shard.request_count), 0))
        .join(Job, Job.id == Shard.job_id)
        .where(Job.tenant == tenant, Shard.status.in_((SHARD_QUEUED, SHARD_RUNNING)))
    )
    validating = session.scalar(
        select(func.coalesce(func.sum(File.line_count), 0))
        .join(Job, Job.input_file_id == File.id)
        .where(Job.tenant == tenant, Job.status == VALIDATING)
    )
    return Usage(int(active or 0), int(in_shards or 0) + int(validating or 0))


def _lock_tenant(session: Session, tenant: str) -> None:
    if session.get_bind().dialect.name != "postgresql":
        return
    key = int.from_bytes(hashlib.sha256(b"pagedbatch.tenant:" + tenant.encode()).digest()[:8], "big", signed=True)
    session.execute(text("select pg_advisory_xact_lock(:key)"), {"key": key})


def check_new_job(session: Session, settings: Settings, tenant: str, requests: int) -> None:
    """Raise LimitExceeded unless `tenant` may start one more job of `requests` requests.

    Call inside the transaction that inserts the job: the lock is held until it commits.
    """
    _lock_tenant(session, tenant)
    limits = limits_for(session, settings, tenant)
    if not limits.max_active_jobs and not limits.max_queued_requests:
        return
    used = usage(session, tenant)
    retry = settings.limit_retry_after_s
    if limits.max_active_jobs and used.active_jobs + 1 > limits.max_active_jobs:
        raise LimitExceeded(
            f"Tenant has {used.active_jobs} active batches, the limit is {limits.max_active_jobs}. "
            "Retry when one of them has finished.",
            retry,
        )
    if limits.max_queued_requests and used.queued_requests + requests > limits.max_queued_requests:
        raise LimitExceeded(
            f"Tenant has {used.queued_requests} queued requests and this batch adds {requests}; "
            f"the limit is {limits.max_queued_requests}. Retry when queued requests have run.",
            retry,
        )

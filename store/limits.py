"""Per-tenant limits on active jobs and queued requests, checked when a job is created (and, for the
active jobs, before its upload is stored), and the per-tenant file quota, checked before and after
an upload is stored.

A tenant's row in `tenants` may override the settings' limits (NULL: the settings'; 0: unlimited).
The check runs in the transaction that inserts the job, under a per-tenant advisory lock, so two
concurrent submissions cannot both take the last free place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sqlalchemy import func, or_, select, text
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
    utcnow,
)
from store.settings import Settings

UPLOAD_PURPOSE = "batch"  # the files a tenant uploads (output and error files are the platform's)


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


def _tenant_or_default(row: Tenant | None, column: str, default: int) -> int:
    """The tenant's own setting where it has one, else the deployment's default."""
    value = getattr(row, column) if row is not None else None
    return default if value is None else value


def limits_for(session: Session, settings: Settings, tenant: str) -> Limits:
    row = session.get(Tenant, tenant)
    return Limits(
        _tenant_or_default(row, "max_active_jobs", settings.max_active_jobs_per_tenant),
        _tenant_or_default(row, "max_queued_requests", settings.max_queued_requests_per_tenant),
    )


def usage(session: Session, tenant: str) -> Usage:
    """Jobs not yet finished, and requests not yet run: those in queued or running shards, plus the lines
    of jobs still being validated (their shards do not exist yet)."""
    active = session.scalar(
        select(func.count()).select_from(Job).where(Job.tenant == tenant, Job.status.in_(ACTIVE_STATUSES))
    )
    # One statement, so one snapshot: a validation committing its shards (and leaving `validating`)
    # between two separate reads would be counted in neither.
    in_shards = (
        select(func.coalesce(func.sum(Shard.request_count), 0))
        .join(Job, Job.id == Shard.job_id)
        .where(Job.tenant == tenant, Shard.status.in_((SHARD_QUEUED, SHARD_RUNNING)))
        .scalar_subquery()
    )
    validating = (
        select(func.coalesce(func.sum(File.line_count), 0))
        .join(Job, Job.input_file_id == File.id)
        .where(Job.tenant == tenant, Job.status == VALIDATING)
        .scalar_subquery()
    )
    queued = session.scalar(select(in_shards + validating))
    return Usage(int(active or 0), int(queued or 0))


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


def check_job_room(session: Session, settings: Settings, tenant: str) -> None:
    """LimitExceeded when the tenant could not start even an empty job: checked before an upload is
    stored, so a tenant at its limit writes nothing."""
    check_new_job(session, settings, tenant, 0)


class QuotaExceeded(StoreError):
    """The tenant's uploaded files are at their quota; deleting files frees it (a 400: retrying the
    same upload cannot help)."""

    status = 400
    code = "file_quota_exceeded"


@dataclass(frozen=True)
class FileQuota:
    max_files: int  # 0: unlimited
    max_bytes: int


def file_quota_for(session: Session, settings: Settings, tenant: str) -> FileQuota:
    row = session.get(Tenant, tenant)
    return FileQuota(
        _tenant_or_default(row, "max_files", settings.max_files_per_tenant),
        _tenant_or_default(row, "max_file_bytes", settings.max_file_bytes_per_tenant),
    )


def files_used(session: Session, tenant: str) -> tuple[int, int]:
    """(count, bytes) of the tenant's uploaded files that are neither deleted nor expired."""
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(File.bytes), 0)).where(
            File.tenant == tenant,
            File.purpose == UPLOAD_PURPOSE,
            File.deleted_at.is_(None),
            or_(File.expires_at.is_(None), File.expires_at > utcnow()),
        )
    ).one()
    return int(count), int(size)


def upload_room(session: Session, settings: Settings, tenant: str) -> int | None:
    """The bytes one more upload may hold under the quota (None: unlimited); QuotaExceeded when full."""
    quota = file_quota_for(session, settings, tenant)
    if not quota.max_files and not quota.max_bytes:
        return None
    count, size = files_used(session, tenant)
    if quota.max_files and count + 1 > quota.max_files:
        raise QuotaExceeded(
            f"Tenant has {count} files, the limit is {quota.max_files}. Delete files (DELETE /v1/files/{{id}}) "
            "to upload more.",
            param="file",
        )
    if not quota.max_bytes:
        return None
    if size >= quota.max_bytes:
        raise QuotaExceeded(
            f"Tenant's files hold {size} bytes, the limit is {quota.max_bytes}. Delete files to upload more.",
            param="file",
        )
    return quota.max_bytes - size


def check_file_quota(session: Session, settings: Settings, tenant: str, new_bytes: int) -> None:
    """QuotaExceeded unless a file of `new_bytes` fits; call in the transaction that inserts it (the
    tenant's lock is held until it commits, so concurrent uploads cannot both take the last room)."""
    _lock_tenant(session, tenant)
    room = upload_room(session, settings, tenant)
    if room is not None and new_bytes > room:
        raise QuotaExceeded(
            f"This file ({new_bytes} bytes) does not fit in the tenant's file quota ({room} bytes left). "
            "Delete files to upload more.",
            param="file",
        )

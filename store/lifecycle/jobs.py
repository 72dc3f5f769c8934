"""Jobs: create one from an uploaded file, read, list.

`create_job` only inserts the job, `validating`; `store.lifecycle.validating.validate_job` then validates its
input in the background, writes its shards and hands them to the broker through an `enqueue` callable
(the API binds `broker.queue.enqueue_shards`).
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from store import ids
from store.db import session_scope
from store.errors import NotFound, StoreError
from store.lifecycle.validating import model_limits
from store.limits import check_new_job
from store.models import INVALID_LINE_POLICIES, MAX_PRIORITY, MIN_PRIORITY, VALIDATING, File, Job, utcnow
from store.pagination import page
from store.settings import Settings


def create_job(
    settings: Settings,
    input_file: File,
    *,
    tenant: str,
    on_invalid_lines: str,
    model: str | None = None,
    endpoint: str | None = None,
    defaults: dict | None = None,
    metadata: dict | None = None,
    completion_window: str = "24h",
    output_expires_after_s: int | None = None,
    priority: int = 0,
) -> tuple[Job, str]:
    """Insert the job, `validating`, if the tenant's limits allow one more (else LimitExceeded: a 429).

    Returns the job and the validation owner token to pass to `store.lifecycle.validating.validate_job`.
    """
    if on_invalid_lines not in INVALID_LINE_POLICIES:
        raise StoreError(
            f"on_invalid_lines must be one of {', '.join(INVALID_LINE_POLICIES)}", param="on_invalid_lines"
        )
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise StoreError(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}", param="priority")
    model_limits(settings, model)  # an unknown model is refused now, not in the background
    now = utcnow()
    owner = f"validator-{uuid.uuid4().hex}"
    job = Job(
        id=ids.job_id(),
        tenant=tenant,
        status=VALIDATING,
        input_file_id=input_file.id,
        completion_window=completion_window,
        created_at=now,
        expires_at=now + parse_window(completion_window),
        endpoint=endpoint,
        model=model,
        defaults=defaults or None,
        job_metadata=metadata,
        output_expires_after_s=output_expires_after_s,
        on_invalid_lines=on_invalid_lines,
        priority=priority,
        request_total=input_file.line_count or 0,  # its non-blank lines, counted at upload
        validation_owner=owner,
        validation_heartbeat_at=now,
    )
    with session_scope(settings.database_url) as s:
        check_new_job(s, settings, tenant, input_file.line_count or 0)
        s.add(job)
    return job, owner


_WINDOW = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")


def parse_window(window: str | None) -> timedelta:
    """A completion window such as "24h" (also s, m, d) as a timedelta; 24 hours when unset."""
    match = _WINDOW.match(window or "24h")
    if match is None:
        raise StoreError(f"bad completion_window {window!r}", param="completion_window")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]
    return timedelta(**{unit: int(match.group(1))})


def get_job(settings: Settings, tenant: str, job_id: str) -> Job:
    with session_scope(settings.database_url) as s:
        return tenant_job(s, tenant, job_id)


def tenant_job(session: Session, tenant: str, job_id: str, *, for_update: bool = False) -> Job:
    """The tenant's job; another tenant's job is NotFound, like a missing one."""
    job = session.get(Job, job_id, with_for_update=for_update)
    if job is None or job.tenant != tenant:
        raise NotFound(f"No such batch: {job_id}", param="batch_id")
    return job


def list_jobs(
    settings: Settings, tenant: str, *, status: str | None = None, limit: int = 20, after: str | None = None
) -> tuple[list[Job], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    with session_scope(settings.database_url) as s:
        query = select(Job).where(Job.tenant == tenant)
        if status:
            query = query.where(Job.status == status)
        return page(s, Job, query, tenant, limit, after, "batch")

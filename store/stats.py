"""Lookups for operators: jobs by status across tenants (metrics), a job's tenant (log lines)."""

from __future__ import annotations

from sqlalchemy import func, select

from store.db import session_scope
from store.models import JOB_STATUSES, Job
from store.settings import Settings


def jobs_by_status(settings: Settings) -> dict[str, int]:
    """Every job status (zero included) -> how many jobs have it now."""
    counts = dict.fromkeys(JOB_STATUSES, 0)
    with session_scope(settings.database_url) as session:
        for status, count in session.execute(select(Job.status, func.count()).group_by(Job.status)):
            counts[status] = count
    return counts


def tenant_of(settings: Settings, job_id: str) -> str | None:
    """The tenant owning `job_id`, None for an unknown job."""
    with session_scope(settings.database_url) as session:
        return session.scalar(select(Job.tenant).where(Job.id == job_id))

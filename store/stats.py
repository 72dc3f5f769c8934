"""Platform-wide counts for operators (metrics): jobs by status, across tenants."""

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

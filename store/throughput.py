"""A tenant's token throughput over recent minutes, for the dashboard's chart.

Tokens count in the minute their shard finished (a shard's counts are written once, from its part), so
the series is as fine as the shards are small.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select

from store.db import session_scope
from store.models import SHARD_DONE, Job, Shard, utcnow
from store.settings import Settings

MAX_MINUTES = 24 * 60  # the longest window a caller may ask for


@dataclass(frozen=True)
class Minute:
    start: datetime
    prompt_tokens: int
    completion_tokens: int
    requests: int


def tokens_per_minute(settings: Settings, tenant: str, minutes: int = 30, now: datetime | None = None) -> list[Minute]:
    """One entry per minute of the last `minutes` (oldest first, empty minutes included)."""
    minutes = max(1, min(int(minutes), MAX_MINUTES))
    end = (now or utcnow()).replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    bucket = func.date_trunc("minute", Shard.finished_at)
    query = (
        select(
            bucket,
            func.sum(Shard.prompt_tokens),
            func.sum(Shard.completion_tokens),
            func.sum(Shard.completed + Shard.failed + Shard.cancelled),
        )
        .join(Job, Job.id == Shard.job_id)
        .where(Job.tenant == tenant, Shard.status == SHARD_DONE, Shard.finished_at >= start)
        .group_by(bucket)
    )
    with session_scope(settings.database_url) as s:
        found = {row[0]: row[1:] for row in s.execute(query)}  # aware datetimes: equal across time zones
    series = []
    for i in range(minutes):
        at = start + timedelta(minutes=i)
        prompt, completion, requests = found.get(at, (0, 0, 0))
        series.append(Minute(at, int(prompt or 0), int(completion or 0), int(requests or 0)))
    return series

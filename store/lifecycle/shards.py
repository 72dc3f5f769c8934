"""The worker's side of shards: lease one, keep the lease, hand it back, or record its written part.

A lease (`Shard.lease_until`) makes a shard one worker's at a time: a broker redelivery while it runs
is skipped, and a shard whose lease runs out (its worker died) is taken back by the sweeper. Each claim
is a new attempt, whatever redelivered it (a broker redelivery, the sweeper taking back a lost lease, a
retry, a hand-back); only the current attempt may finish the shard. A claim past `max_attempts` is marked
`exhausted`: the shard keeps killing or losing its workers. The worker then splits it (`split_shard`) into
new shards with fresh attempts, so the innocent requests still run, down to single requests, which fail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from store.db import session_scope
from store.filestore.paths import shard_id as shard_id_of
from store.filestore.paths import shard_input_key
from store.filestore.storage import get_storage
from store.models import (
    CANCELLED,
    CANCELLING,
    SHARD_CANCELLED,
    SHARD_DONE,
    SHARD_QUEUED,
    SHARD_RUNNING,
    TERMINAL_STATUSES,
    Job,
    Shard,
    Tenant,
    utcnow,
)
from store.results.parquet import ResultCounts
from store.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class ClaimedShard:
    """What a worker needs to run the shard it leased."""

    job_id: str
    attempt: int
    input_key: str
    job_cancelling: bool
    job_created_at: datetime
    tenant: str = "default"
    tenant_weight: float = 1.0  # the tenant's fair-share weight in the worker
    priority: int = 0  # the job's: lower first among the tenant's requests in the worker
    deadline: float | None = None  # the job's completion window's end (Unix seconds): earliest first, then
    exhausted: bool = False  # the attempts before this one used up the limit: do not run it again


def claim_shard(
    settings: Settings, shard_id: str, worker: str, lease_s: float = 60.0, max_attempts: int = 0
) -> ClaimedShard | None:
    """Lease a queued shard (or a running one whose lease ran out) for `lease_s` seconds: attempt += 1.

    With `max_attempts` (0: no limit), a claim after that many attempts comes back `exhausted`.

    None when there is nothing to do: the shard is finished, or another worker holds a live lease on it
    (a broker redelivery while it runs). The lease must be renewed (`renew_leases`) while the shard runs.
    """
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id, with_for_update=True)
        if shard is None or shard.status not in (SHARD_QUEUED, SHARD_RUNNING):
            return None
        now = utcnow()
        if shard.status == SHARD_RUNNING and shard.lease_until is not None and shard.lease_until > now:
            log.info(
                "shard %s is leased by %s (attempt %d); not running it twice", shard.id, shard.worker, shard.attempts
            )
            return None
        if shard.status == SHARD_QUEUED and shard.retry_at is not None and shard.retry_at > now:
            return None  # waiting out a storage failure's backoff: the sweeper sends it then
        job = s.get(Job, shard.job_id)
        tenant = s.get(Tenant, job.tenant)  # None: a tenant without a key (the default), weight 1
        shard.status = SHARD_RUNNING
        shard.completed = shard.failed = shard.cancelled = 0
        shard.prompt_tokens = shard.completion_tokens = shard.cached_tokens = 0
        shard.attempts += 1
        shard.started_at = now
        shard.lease_until = now + timedelta(seconds=lease_s)
        shard.worker = worker
        return ClaimedShard(
            job_id=shard.job_id,
            attempt=shard.attempts,
            input_key=shard.input_key,
            job_cancelling=job.status in (CANCELLING, CANCELLED),
            job_created_at=job.created_at,
            tenant=job.tenant,
            tenant_weight=tenant.weight if tenant is not None else 1.0,
            priority=job.priority,
            deadline=job.expires_at.timestamp() if job.expires_at is not None else None,
            exhausted=0 < max_attempts < shard.attempts,
        )


def owns_shard(settings: Settings, shard_id: str, attempt: int) -> bool:
    """Whether `attempt` is still the shard's current, running attempt (no other worker took it over)."""
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id)
        return shard is not None and shard.status == SHARD_RUNNING and shard.attempts == attempt


def renew_leases(settings: Settings, held: dict[str, int], lease_s: float) -> set[str]:
    """Extend the leases of the shards this worker runs ({shard id: attempt}); returns those it lost."""
    lost = set()
    until = utcnow() + timedelta(seconds=lease_s)
    with session_scope(settings.database_url) as s:
        for shard_id, attempt in held.items():
            result = s.execute(
                update(Shard)
                .where(Shard.id == shard_id, Shard.attempts == attempt, Shard.status == SHARD_RUNNING)
                .values(lease_until=until)
            )
            if result.rowcount == 0:
                lost.add(shard_id)
    return lost


def release_shard(settings: Settings, shard_id: str, attempt: int) -> bool:
    """Hand an unfinished shard back (a worker shutting down): queued again, for the next worker."""
    with session_scope(settings.database_url) as s:
        result = s.execute(
            update(Shard)
            .where(Shard.id == shard_id, Shard.attempts == attempt, Shard.status == SHARD_RUNNING)
            .values(status=SHARD_QUEUED, lease_until=None, worker=None)
        )
        return result.rowcount == 1


def finish_shard(
    settings: Settings, shard_id: str, part_key: str, counts: ResultCounts, attempt: int | None = None
) -> bool:
    """Record a shard's durable part; counts are set from the part, never added.

    With `attempt`, only that attempt may finish the shard (False for a stale one).
    """
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id, with_for_update=True)
        if shard is None:
            return False
        if attempt is not None and (shard.attempts != attempt or shard.status != SHARD_RUNNING):
            return False
        shard.status = SHARD_DONE
        shard.lease_until = None
        shard.part_key = part_key
        shard.completed = counts.completed
        shard.failed = counts.failed
        shard.cancelled = counts.cancelled
        shard.prompt_tokens = counts.prompt_tokens
        shard.completion_tokens = counts.completion_tokens
        shard.cached_tokens = counts.cached_tokens
        shard.finished_at = utcnow()
        s.execute(  # its part is written: the job no longer waits on the storage
            update(Job)
            .where(Job.id == shard.job_id, Job.status_detail.is_not(None), Job.finalizing_at.is_(None))
            .values(status_detail=None, retry_at=None, storage_failing_since=None, storage_failures=0)
        )
    return True


def storage_release(shard_id: str, attempt: int):
    """The `store.filestore.storage_waits` release of a shard whose writer failed: queued again, sent by the sweeper at
    the job's `retry_at` (the failure is not one of its poison attempts); cancelled if the job failed."""

    def release(s: Session, job: Job) -> None:
        shard = s.get(Shard, shard_id, with_for_update=True)
        if shard is None or shard.status != SHARD_RUNNING or shard.attempts != attempt:
            return
        shard.worker, shard.lease_until = None, None
        if job.status in TERMINAL_STATUSES:
            shard.status, shard.finished_at, shard.part_key = SHARD_CANCELLED, utcnow(), None
            return
        shard.status, shard.attempts, shard.retry_at = SHARD_QUEUED, attempt - 1, job.retry_at

    return release


def report_progress(settings: Settings, shard_id: str, attempt: int, counts: ResultCounts) -> None:
    """A running shard's counts so far (set, not added), so that a job's progress moves per request;
    `finish_shard` then sets them from the written part. A stale attempt changes nothing."""
    with session_scope(settings.database_url) as s:
        s.execute(
            update(Shard)
            .where(Shard.id == shard_id, Shard.attempts == attempt, Shard.status == SHARD_RUNNING)
            .values(
                completed=counts.completed,
                failed=counts.failed,
                cancelled=counts.cancelled,
                prompt_tokens=counts.prompt_tokens,
                completion_tokens=counts.completion_tokens,
                cached_tokens=counts.cached_tokens,
            )
        )


def split_shard(
    settings: Settings, shard_id: str, attempt: int, chunks: list[list[bytes]], requeue_s: float = 60.0
) -> list[tuple[str, str]] | None:
    """Replace a running shard (its current `attempt`) with one new queued shard per chunk of its input lines
    (attempts start again at 0); the old shard is done with no part and no counts. Returns the new shards'
    (id, model), to enqueue; None if `attempt` is stale (nothing changes then)."""
    with session_scope(settings.database_url) as s:
        job_id = s.get(Shard, shard_id).job_id
        job = s.get(Job, job_id, with_for_update=True)  # its shard_count numbers the new shards
        shard = s.get(Shard, shard_id, with_for_update=True)
        if shard.status != SHARD_RUNNING or shard.attempts != attempt:
            return None
        now = utcnow()
        storage = get_storage(settings.storage_url)
        new = []
        for lines in chunks:
            index = job.shard_count
            job.shard_count += 1
            key = shard_input_key(job_id, index)
            with storage.open_write(key) as out:
                out.write(b"".join(lines))
            new.append(
                Shard(
                    id=shard_id_of(job_id, index),
                    job_id=job_id,
                    index=index,
                    model=shard.model,
                    request_count=len(lines),
                    input_key=key,
                    status=SHARD_QUEUED,
                    lease_until=now + timedelta(seconds=requeue_s),
                )
            )
        s.add_all(new)
        shard.status, shard.lease_until, shard.worker, shard.finished_at = SHARD_DONE, None, None, now
        shard.completed = shard.failed = shard.cancelled = 0
        shard.prompt_tokens = shard.completion_tokens = shard.cached_tokens = 0
        return [(n.id, n.model) for n in new]

"""Recovery from the database: the broker is only a hint, PostgreSQL holds the truth.

Every worker runs a `Sweeper` thread. Each sweep, idempotent and safe to run from many processes:

1. expires jobs past their completion window (`store.lifecycle.cancel.expire_job`);
2. takes back running shards whose lease ran out (their worker died or hung): queued again and re-sent,
   or, when their job is being cancelled or expired, marked cancelled so the finalizer writes their rows;
3. re-sends queued shards whose broker message may be lost (Redis restarted without persistence, or the
   API died between committing a job and enqueueing it): when a model's queue holds fewer messages than
   the model has queued shards, twice CONFIRM_S apart (a message a worker has just taken is out of the
   queue before its shard is claimed: once, that sent every queued shard of a busy job again), the shards
   not checked for `requeue_s` are sent again. A duplicate message costs little: `claim_shard` skips
   finished shards and shards under a live lease;
4. finalizes jobs whose shards are all finished but whose finalizer never ran, died, or gave its claim back
   after a failure (once its backoff, `Job.retry_at`, is over);
5. resumes the validation of jobs whose validator died with its API process (or gave its claim back);
6. sends again the shards whose writer failed on the storage, once their backoff (`Shard.retry_at`) is over;
7. expires uploads in parts not completed in time, deleting their parts (`store.filestore.uploads.expire_uploads`).
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

from sqlalchemy import exists, select, update

from broker.queue import enqueue_shards, queue_size
from settings import WorkerSettings, current
from store.db import session_scope
from store.filestore.uploads import expire_uploads
from store.lifecycle.cancel import expire_job
from store.lifecycle.finalize import maybe_finalize
from store.lifecycle.validating import claim_validation, run_validation, stale_validations
from store.models import (
    CANCELLING,
    FINALIZING,
    IN_PROGRESS,
    SHARD_CANCELLED,
    SHARD_DONE,
    SHARD_QUEUED,
    SHARD_RUNNING,
    Job,
    Shard,
    utcnow,
)
from store.settings import Settings

log = logging.getLogger(__name__)
WORKER_ID = socket.gethostname()
CONFIRM_S = 1.0  # a model's queue found short is counted again this much later before anything is re-sent


@dataclass
class Recovery:
    """Timings of leases and sweeps, and the attempt limit (PAGEDBATCH_LEASE_S, PAGEDBATCH_SWEEP_S,
    PAGEDBATCH_REQUEUE_S, PAGEDBATCH_MAX_SHARD_ATTEMPTS)."""

    lease_s: float = 60.0  # a running shard not renewed for this long is taken back
    sweep_s: float = 10.0  # time between sweeps (with jitter)
    requeue_s: float = 60.0  # how often a queued shard's broker message is checked
    max_attempts: int = 5  # claims of one shard before its requests are failed (0: no limit)

    @classmethod
    def from_env(cls) -> Recovery:
        env = current(WorkerSettings)
        return cls(
            lease_s=env.lease_s, sweep_s=env.sweep_s, requeue_s=env.requeue_s, max_attempts=env.max_shard_attempts
        )


def sweep(settings: Settings, recovery: Recovery) -> dict[str, int]:
    """One pass of every recovery step; returns how many things each step acted on."""
    return {
        "expired_jobs": _expire_jobs(settings),
        "taken_back": _take_back_expired_leases(settings, recovery),
        "resent": _resend_lost_messages(settings, recovery),
        "finalized": _finalize_finished_jobs(settings),
        "resumed_validations": _resume_stale_validations(settings),
        "storage_retries": _retry_storage_waits(settings, recovery),
        "expired_uploads": expire_uploads(settings),
    }


def _expire_jobs(settings: Settings) -> int:
    with session_scope(settings.database_url) as s:
        due = list(
            s.scalars(
                select(Job.id).where(Job.status == IN_PROGRESS, Job.expired_at.is_(None), Job.expires_at <= utcnow())
            )
        )
    return sum(expire_job(settings, job_id) for job_id in due)


def _take_back_expired_leases(settings: Settings, recovery: Recovery) -> int:
    now = utcnow()
    resend: list[tuple[str, str]] = []
    with session_scope(settings.database_url) as s:
        rows = s.execute(
            select(Shard, Job.status, Job.expired_at)
            .join(Job, Job.id == Shard.job_id)
            .where(Shard.status == SHARD_RUNNING, Shard.lease_until < now)
            .with_for_update(of=Shard, skip_locked=True)
        ).all()
        for shard, job_status, job_expired_at in rows:
            log.warning(
                "shard %s: lease of %s (attempt %d) ran out; taking it back", shard.id, shard.worker, shard.attempts
            )
            shard.worker = None
            if job_status == CANCELLING or job_expired_at is not None:
                shard.status, shard.finished_at, shard.lease_until = SHARD_CANCELLED, now, None
                shard.part_key = None  # the finalizer writes a cancelled (or expired) row for every line
            else:
                shard.status = SHARD_QUEUED
                shard.lease_until = now + timedelta(seconds=recovery.requeue_s)
                resend.append((shard.id, shard.model))
    if resend:
        enqueue_shards(settings, resend)
    return len(rows)


def _resend_lost_messages(settings: Settings, recovery: Recovery) -> int:
    now = utcnow()
    queued = _queued_shards(settings)
    due = [(shard_id, model) for shard_id, model, checked in queued if checked is None or checked <= now]
    short = _short_queues(settings, queued, {model for _, model in due})
    if short:  # a message a worker has just taken leaves the queue before its shard is claimed: look again
        time.sleep(CONFIRM_S)
        short = _short_queues(settings, _queued_shards(settings), short)
    resend = [(shard_id, model) for shard_id, model in due if model in short]
    if due:
        with session_scope(settings.database_url) as s:
            s.execute(
                update(Shard)
                .where(Shard.id.in_([shard_id for shard_id, _ in due]), Shard.status == SHARD_QUEUED)
                .values(lease_until=now + timedelta(seconds=recovery.requeue_s))
            )
    if resend:
        log.warning("re-sending %d queued shards whose broker messages are missing", len(resend))
        enqueue_shards(settings, resend)
    return len(resend)


def _queued_shards(settings: Settings) -> list:
    """The queued shards not waiting out a storage backoff: (id, model, last checked)."""
    with session_scope(settings.database_url) as s:
        return s.execute(
            select(Shard.id, Shard.model, Shard.lease_until).where(
                Shard.status == SHARD_QUEUED, Shard.retry_at.is_(None)
            )
        ).all()


def _short_queues(settings: Settings, queued: list, models: set[str]) -> set[str]:
    """Those of `models` whose queue holds fewer messages than they have `queued` shards."""
    total = Counter(model for _, model, _ in queued)
    return {model for model in models if queue_size(settings, model) < total[model]}


def _finalize_finished_jobs(settings: Settings) -> int:
    unfinished = exists().where(Shard.job_id == Job.id, Shard.status.not_in((SHARD_DONE, SHARD_CANCELLED)))
    with session_scope(settings.database_url) as s:
        job_ids = list(
            s.scalars(
                select(Job.id).where(
                    Job.status.in_((IN_PROGRESS, CANCELLING, FINALIZING)),
                    Job.shard_count > 0,
                    ~unfinished,
                    Job.retry_at.is_(None) | (Job.retry_at <= utcnow()),
                )
            )
        )
    return sum(maybe_finalize(settings, job_id) for job_id in job_ids)


def _retry_storage_waits(settings: Settings, recovery: Recovery) -> int:
    """Queued shards whose writer failed on the storage, their backoff over: sent again."""
    now = utcnow()
    with session_scope(settings.database_url) as s:
        rows = s.execute(
            update(Shard)
            .where(Shard.status == SHARD_QUEUED, Shard.retry_at <= now)
            .values(retry_at=None, lease_until=now + timedelta(seconds=recovery.requeue_s))
            .returning(Shard.id, Shard.model)
        ).all()
    if rows:
        enqueue_shards(settings, [(shard_id, model) for shard_id, model in rows])
    return len(rows)


_resuming = threading.BoundedSemaphore(1)  # validations this process resumes at once


def _resume_stale_validations(settings: Settings) -> int:
    """Jobs whose validator died (its API process stopped) and whose model this worker knows: validated on,
    one at a time, on a thread of this process (`store.lifecycle.validating` skips the lines already committed). The
    API processes resume them too, those of every model (`api.validations`)."""
    started = 0
    for job_id in stale_validations(settings, models=list(settings.models), limit=1):
        if not _resuming.acquire(blocking=False):
            break
        owner = f"sweeper-{WORKER_ID}-{uuid.uuid4().hex[:8]}"
        if not claim_validation(settings, job_id, owner):
            _resuming.release()
            continue
        log.warning("resuming the validation of %s (its validator stopped)", job_id)
        threading.Thread(target=_resume, args=(settings, job_id, owner), name="resume-validation", daemon=True).start()
        started += 1
    return started


def _resume(settings: Settings, job_id: str, owner: str) -> None:
    try:
        run_validation(settings, job_id, owner, partial(enqueue_shards, settings))
    finally:
        _resuming.release()


class Sweeper:
    """Runs `sweep` every `recovery.sweep_s` seconds (with jitter) on a daemon thread."""

    def __init__(self, settings: Settings, recovery: Recovery | None = None):
        self.settings = settings
        self.recovery = recovery or Recovery.from_env()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sweeper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.recovery.sweep_s * random.uniform(0.75, 1.25)):
            try:
                acted = sweep(self.settings, self.recovery)
            except Exception:  # the database or broker is down: try again next time
                log.warning("sweep failed", exc_info=True)
                continue
            if any(acted.values()):
                log.info("sweep: %s", acted)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

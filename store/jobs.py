"""Jobs: create one from an uploaded file (validate, shard, hand the shards to the broker), read, list.

The store does not know the broker: `create_job` is given an `enqueue` callable that sends shards
to the workers (the API binds `broker.queue.enqueue_shards`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchfile.model_limits import ModelLimits, UnknownModel, limits_by_name, limits_of
from store import ids, models_registry
from store.db import session_scope
from store.errors import NotFound, StoreError
from store.finalize import finalize_failed, maybe_finalize
from store.limits import check_new_job
from store.models import (
    CANCELLING,
    FAILED,
    IN_PROGRESS,
    SHARD_CANCELLED,
    VALIDATING,
    File,
    Job,
    Shard,
    utcnow,
)
from store.pagination import page
from store.paths import VALIDATION_PART
from store.results.parts import results_store
from store.results.rows import error_row
from store.settings import Settings
from store.sharding import ShardedInput, shard_input

log = logging.getLogger(__name__)

# Sends (shard id, model name) pairs to the workers.
Enqueue = Callable[[list[tuple[str, str]]], None]

MAX_STORED_ERRORS = 100  # line errors kept on the job row; all of them are in the error file
STALE_VALIDATION = timedelta(minutes=30)  # a job validating this long lost its API process
EMPTY_FILE_ERROR = {"code": "empty_file", "message": "The input file has no requests.", "param": None, "line": None}


def create_job(
    settings: Settings,
    input_file: File,
    *,
    tenant: str,
    enqueue: Enqueue,
    model: str | None = None,
    endpoint: str | None = None,
    defaults: dict | None = None,
    metadata: dict | None = None,
    completion_window: str = "24h",
    output_expires_after_s: int | None = None,
) -> Job:
    """Validate `input_file` line by line (streamed), split the valid lines into shards and enqueue them.

    Bad lines become per-line errors; when every line is bad the job fails with those errors.
    """
    models = _model_limits(settings, model)
    job = _insert_job(
        settings,
        input_file,
        tenant=tenant,
        completion_window=completion_window,
        endpoint=endpoint,
        model=model,
        defaults=defaults or None,
        job_metadata=metadata or None,
        output_expires_after_s=output_expires_after_s,
    )
    sharded = shard_input(settings, job.id, input_file, models, endpoint=endpoint, defaults=defaults)
    if sharded.bad_lines:
        rows = [error_row(bad.error, created_at=job.created_at) for bad in sharded.bad_lines]
        results_store(settings).write_part(job.id, VALIDATION_PART, rows)
    status, to_run = _end_validation(settings, job.id, sharded)
    if to_run:
        try:
            enqueue([(shard.id, shard.model) for shard in to_run])
        except Exception:  # noqa: BLE001 - the shards are in the database; the sweeper enqueues them
            log.exception("enqueueing the shards of %s failed; the sweeper will retry", job.id)
    elif status == CANCELLING:
        maybe_finalize(settings, job.id)
    else:
        finalize_failed(settings, job.id)
    return get_job(settings, tenant, job.id)


def _model_limits(settings: Settings, model: str | None) -> ModelLimits | dict[str, ModelLimits]:
    """The job's model, or every configured model when each line names its own."""
    paths = models_registry.model_paths(settings)  # running workers' models, PAGEDBATCH_MODELS overriding
    if model is None:
        return limits_by_name(paths, settings.special_tokens_in_content)
    try:
        return limits_of(paths, model, settings.special_tokens_in_content)
    except UnknownModel as exc:
        raise StoreError(str(exc), param="model") from None
    except (OSError, ValueError) as exc:  # a registered path this host cannot read
        raise StoreError(
            f"model {model!r} is served from {paths[model]!r}, which the API cannot read ({exc}); "
            "mount the model at the same path on the API host or set PAGEDBATCH_MODELS",
            param="model",
        ) from None


def _insert_job(settings: Settings, input_file: File, *, tenant: str, completion_window: str, **fields) -> Job:
    """A new job, validating, inserted if the tenant's limits allow one more (else LimitExceeded: a 429)."""
    now = utcnow()
    job = Job(
        id=ids.job_id(),
        tenant=tenant,
        status=VALIDATING,
        input_file_id=input_file.id,
        completion_window=completion_window,
        created_at=now,
        expires_at=now + parse_window(completion_window),
        **fields,
    )
    with session_scope(settings.database_url) as s:
        check_new_job(s, settings, tenant, input_file.line_count or 0)
        s.add(job)
    return job


def _end_validation(settings: Settings, job_id: str, sharded: ShardedInput) -> tuple[str, list[Shard]]:
    """Record the validation's counts, errors and shards; returns the job's status and the shards to run.

    A job cancelled while it was validating runs nothing: its shards are stored cancelled, so the
    finalizer gives every line a row.
    """
    errors = [bad.as_dict for bad in sharded.bad_lines[:MAX_STORED_ERRORS]]
    if sharded.total == 0:
        errors.append(dict(EMPTY_FILE_ERROR))
    shards = sharded.shards
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        job.request_total = sharded.total
        job.invalid_lines = len(sharded.bad_lines)
        job.errors = errors or None
        job.shard_count = len(shards)
        if job.status == CANCELLING:
            job.in_progress_at = utcnow()  # validation is over; the finalizer may now run
            for shard in shards:
                shard.status = SHARD_CANCELLED
            s.add_all(shards)
            return job.status, []
        if not shards:
            job.status = FAILED
            job.failed_at = utcnow()
            return job.status, []
        job.status = IN_PROGRESS
        job.in_progress_at = utcnow()
        s.add_all(shards)
        return job.status, shards


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

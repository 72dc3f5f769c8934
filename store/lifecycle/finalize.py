"""Finalize a job once every shard is finished: counts from the written parts, the merged Parquet file,
the OpenAI output and error files, the final status.

Safe to call from many places at once (every worker finishing a shard, the sweeper, a cancel): the job
row lock lets exactly one caller do it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select

from batchfile.shard_input import decode_request
from store.db import session_scope
from store.filestore.files import register_file, set_output_expiry
from store.filestore.paths import errors_key, output_key
from store.filestore.storage import get_storage
from store.filestore.storage_faults import TRANSIENT, StorageFault, classify, health
from store.filestore.storage_waits import clear_wait, due, record_failure
from store.models import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    SHARD_CANCELLED,
    SHARD_DONE,
    TERMINAL_STATUSES,
    File,
    Job,
    Shard,
    utcnow,
)
from store.results.parquet import ResultCounts
from store.results.parts import ResultsStore, results_store
from store.results.rows import cancelled_row, expired_row
from store.settings import Settings

log = logging.getLogger(__name__)

STALE_FINALIZE = timedelta(minutes=10)  # a finalizer silent this long (died without raising) is presumed dead


@dataclass
class _Finalization:
    target: str  # the final status: completed, cancelled or expired
    tenant: str
    created_at: datetime
    never_run: list[tuple[str, str]]  # (shard id, input key) of the shards stopped before they ran
    expected_rows: int  # every input line has one row in the parts


def maybe_finalize(settings: Settings, job_id: str) -> bool:
    """Finalize the job if every shard is finished; True when this call did it.

    A finalizer that fails gives its claim back at once and records why on the job (`store.filestore.storage_waits`):
    the sweeper finalizes it again after a backoff; a permanent storage failure fails the job."""
    plan = _start(settings, job_id)
    if plan is None:
        return False
    try:
        done = _finalize(settings, job_id, plan)
    except Exception as exc:  # recorded on the job, retried by the sweeper
        record_failure(settings, job_id, exc, "finalizing the results", "finalizing will retry", _keep)
        if classify(exc) is None:
            log.exception("finalizing %s failed; it will be retried", job_id)
        return False
    health.worked()
    return done


def _keep(_session, _job) -> None:
    """The finalizer's claim is given back by `record_failure` setting `retry_at` (see `_finalizable`)."""


def _finalize(settings: Settings, job_id: str, plan: _Finalization) -> bool:
    store = results_store(settings)
    for shard_id, input_key in plan.never_run:
        _write_never_run_part(settings, store, job_id, shard_id, input_key, plan)
    counts, output_file, error_file = _write_final_files(settings, job_id, plan.tenant, plan.expected_rows)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job.status in TERMINAL_STATUSES:
            return False
        clear_wait(job)
        _set_counts(job, counts)
        job.output_file_id = output_file.id if output_file else None
        job.error_file_id = error_file.id if error_file else None
        set_output_expiry(s, job)
        job.status = plan.target
        if plan.target == COMPLETED:
            job.completed_at = utcnow()
        elif plan.target == CANCELLED:
            job.cancelled_at = utcnow()
            job.finalizing_at = None  # OpenAI's cancelled batch never finalized
    return True


def _start(settings: Settings, job_id: str) -> _Finalization | None:
    """Under the job row's lock: claim the finalization if the job is ready for it and nobody else is at it."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or not _finalizable(job) or not due(job):
            return None
        unfinished = s.scalar(
            select(func.count())
            .select_from(Shard)
            .where(Shard.job_id == job_id, Shard.status.not_in((SHARD_DONE, SHARD_CANCELLED)))
        )
        if unfinished:
            return None
        if job.expired_at is not None:
            target = EXPIRED
        else:
            target = CANCELLED if job.cancelling_at is not None else COMPLETED
        if target == COMPLETED:  # visible as "finalizing" while the files are written
            job.status = FINALIZING
        job.finalizing_at, job.retry_at = utcnow(), None  # claimed (a given-back claim has `retry_at`)
        never_run = s.execute(
            select(Shard.id, Shard.input_key).where(
                Shard.job_id == job_id, Shard.status == SHARD_CANCELLED, Shard.part_key.is_(None)
            )
        )
        never_run = [tuple(row) for row in never_run]
        return _Finalization(target, job.tenant, job.created_at, never_run, job.request_total)


def _finalizable(job: Job) -> bool:
    if job.status not in (IN_PROGRESS, CANCELLING, FINALIZING):
        return False
    if job.validated_at is None:
        return False  # still validating: store.lifecycle.validating finalizes it when validation ends
    # `finalizing_at` marks a finalizer at work unless it gave its claim back (`retry_at`); one silent for
    # too long is presumed dead
    if job.finalizing_at is None or job.retry_at is not None:
        return True
    return utcnow() - job.finalizing_at > STALE_FINALIZE


def _write_never_run_part(
    settings: Settings, store: ResultsStore, job_id: str, shard_id: str, input_key: str, plan: _Finalization
) -> None:
    """A shard stopped before it ran: a cancelled (or expired) row per request, so every line has a row."""
    make_row = expired_row if plan.target == EXPIRED else cancelled_row
    with get_storage(settings.storage_url).open_read(input_key) as f:
        rows = [
            make_row(decode_request(line), shard_id=shard_id, created_at=plan.created_at) for line in f if line.strip()
        ]
    path = store.write_part(job_id, shard_id, rows)
    with session_scope(settings.database_url) as s:
        s.get(Shard, shard_id).part_key = path


def finalize_failed(settings: Settings, job_id: str, *, mark_failed: bool = False) -> None:
    """A job that failed validation: its counts and error file. With `mark_failed` the job turns `failed`
    only now, with them (a poll never sees it failed without its error file); else it is already."""
    with session_scope(settings.database_url) as s:
        tenant = s.get(Job, job_id).tenant
    counts, _, error_file = _write_final_files(settings, job_id, tenant, output=False)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if mark_failed:
            now = utcnow()
            job.status, job.failed_at, job.validated_at = FAILED, now, job.validated_at or now
        _set_counts(job, counts)
        job.error_file_id = error_file.id if error_file else None
        set_output_expiry(s, job)


def _set_counts(job: Job, counts: ResultCounts) -> None:
    job.request_completed = counts.completed
    job.request_failed = counts.failed
    job.request_cancelled = counts.cancelled
    job.prompt_tokens = counts.prompt_tokens
    job.completion_tokens = counts.completion_tokens
    job.cached_tokens = counts.cached_tokens


def _write_final_files(
    settings: Settings, job_id: str, tenant: str, expected_rows: int | None = None, output: bool = True
) -> tuple[ResultCounts, File | None, File | None]:
    """Merge the parts into one Parquet file; write the OpenAI output and error files; count rows. Fewer rows
    than `expected_rows` (a part the storage does not show yet) is a transient storage failure: never a job
    completed short."""
    store = results_store(settings)
    store.merge(job_id)
    counts = store.count(job_id)
    if expected_rows is not None and counts.total < expected_rows:
        raise StorageFault(TRANSIENT, f"reading the results' parts ({counts.total} of {expected_rows} rows found)")
    output_file = error_file = None
    if output and counts.completed:  # no output file of no lines (OpenAI's output_file_id is then null)
        output_file = _write_jsonl_file(
            settings, tenant, output_key(job_id), store.iter_output_jsonl(job_id), f"{job_id}_output.jsonl"
        )
    if counts.failed or counts.cancelled:
        error_file = _write_jsonl_file(
            settings, tenant, errors_key(job_id), store.iter_error_jsonl(job_id), f"{job_id}_error.jsonl"
        )
    return counts, output_file, error_file


def _write_jsonl_file(settings: Settings, tenant: str, key: str, lines: Iterator[str], filename: str) -> File:
    with get_storage(settings.storage_url).open_write(key) as out:
        for line in lines:
            out.write(line.encode())
    return register_file(settings, tenant=tenant, key=key, filename=filename, purpose="batch_output")

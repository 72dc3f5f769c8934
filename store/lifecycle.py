"""Job lifecycle: store uploads, validate and shard a job, cancel, and finalize from written parts.

Used by the API (create, cancel, read) and by the workers (claim and finish shards, finalize).
Statuses are OpenAI's batch status names for both API faces.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import bindparam, func, select, update

from broker.queue import enqueue_shards
from store import ids
from store.db import session_scope
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
    SHARD_QUEUED,
    SHARD_RUNNING,
    TERMINAL_STATUSES,
    VALIDATING,
    File,
    Job,
    Shard,
    utcnow,
)
from store.settings import Settings
from store.storage import get_storage

log = logging.getLogger(__name__)

MAX_STORED_ERRORS = 100  # line errors kept on the job row; all of them are in the error file
STALE_FINALIZE = timedelta(minutes=10)  # a finalizer silent this long is presumed dead
STALE_VALIDATION = timedelta(minutes=30)  # a job validating this long lost its API process
EXPIRED_CODE = "batch_expired"
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


class StoreError(Exception):
    status = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class NotFound(StoreError):
    status = 404
    code = "not_found"


class Conflict(StoreError):
    status = 409
    code = "conflict"


class TooLarge(StoreError):
    status = 413
    code = "payload_too_large"


# ---- keys in the results store -------------------------------------------------------


def file_key(file_id: str) -> str:
    return f"files/{file_id}.jsonl"


def shard_input_key(job_id: str, index: int) -> str:
    return f"jobs/{job_id}/inputs/shard-{index:05d}.jsonl"


def output_key(job_id: str) -> str:
    return f"jobs/{job_id}/output.jsonl"


def errors_key(job_id: str) -> str:
    return f"jobs/{job_id}/errors.jsonl"


VALIDATION_PART = "validation"  # the part holding a job's invalid lines, one failed row each


def results_store(settings: Settings):
    """Parquet parts and merged results live under <storage>/results (see store.results)."""
    from store.results import ResultsStore

    return ResultsStore(settings.storage_url.rstrip("/") + "/results")


def shard_id(job_id: str, index: int) -> str:
    return f"{job_id}.{index:05d}"


# ---- files -----------------------------------------------------------------------------


def store_upload(
    settings: Settings,
    chunks: Iterable[bytes],
    *,
    tenant: str,
    filename: str,
    purpose: str = "batch",
) -> File:
    """Stream an upload into the results store, enforcing the size and line limits (413)."""
    file_id = ids.file_id()
    key = file_key(file_id)
    storage = get_storage(settings.storage_url)
    size = lines = 0
    last = b"\n"
    with storage.open_write(key) as out:
        for chunk in chunks:
            if not chunk:
                continue
            size += len(chunk)
            if size > settings.max_upload_bytes:
                raise TooLarge(f"file exceeds the limit of {settings.max_upload_bytes} bytes")
            lines += chunk.count(b"\n")
            if lines > settings.max_lines:
                raise TooLarge(f"file exceeds the limit of {settings.max_lines} lines")
            last = chunk[-1:]
            out.write(chunk)
    if last != b"\n":
        lines += 1
        if lines > settings.max_lines:
            storage.delete(key)
            raise TooLarge(f"file exceeds the limit of {settings.max_lines} lines")
    record = File(
        id=file_id,
        tenant=tenant,
        purpose=purpose,
        filename=filename or "input.jsonl",
        bytes=size,
        line_count=lines,
        storage_key=key,
    )
    with session_scope(settings.database_url) as s:
        s.add(record)
    return record


def register_file(settings: Settings, *, tenant: str, key: str, filename: str, purpose: str) -> File:
    storage = get_storage(settings.storage_url)
    record = File(
        id=ids.file_id(),
        tenant=tenant,
        purpose=purpose,
        filename=filename,
        bytes=storage.size(key),
        storage_key=key,
    )
    with session_scope(settings.database_url) as s:
        s.add(record)
    return record


def get_file(settings: Settings, tenant: str, file_id: str) -> File:
    with session_scope(settings.database_url) as s:
        record = s.get(File, file_id)
        if record is None or record.tenant != tenant:
            raise NotFound(f"No such file: {file_id}", param="file_id")
        return record


# ---- creating a job --------------------------------------------------------------------


@dataclass
class _ShardBuffer:
    model: str
    items: list[str] = field(default_factory=list)


def create_job(
    settings: Settings,
    input_file: File,
    *,
    tenant: str,
    model: str | None = None,
    endpoint: str | None = None,
    defaults: dict | None = None,
    metadata: dict | None = None,
    completion_window: str = "24h",
) -> Job:
    """Validate `input_file` line by line (streamed), split the valid lines into shards and enqueue them.

    Bad lines become per-line errors; when every line is bad the job fails with those errors.
    """
    from batchfile import parsing

    if model is not None:
        try:
            parsing.model_limits(settings, model)
        except parsing.UnknownModel as exc:
            raise StoreError(str(exc), param="model") from None
    now = utcnow()
    job = Job(
        id=ids.job_id(),
        tenant=tenant,
        status=VALIDATING,
        endpoint=endpoint,
        model=model,
        defaults=defaults or None,
        job_metadata=metadata or None,
        completion_window=completion_window,
        input_file_id=input_file.id,
        created_at=now,
        expires_at=now + parse_window(completion_window),
    )
    with session_scope(settings.database_url) as s:
        from store.limits import check_new_job

        check_new_job(s, settings, tenant, input_file.line_count or 0)  # 429 over the tenant's limits
        s.add(job)

    storage = get_storage(settings.storage_url)
    buffers: dict[str, _ShardBuffer] = {}
    shards: list[Shard] = []
    stored_errors: list[dict] = []
    total = invalid = 0

    def flush(buffer: _ShardBuffer) -> None:
        index = len(shards)
        key = shard_input_key(job.id, index)
        with storage.open_write(key) as out:
            out.write("".join(buffer.items).encode())
        shards.append(
            Shard(
                id=shard_id(job.id, index),
                job_id=job.id,
                index=index,
                model=buffer.model,
                status=SHARD_QUEUED,
                request_count=len(buffer.items),
                input_key=key,
            )
        )
        buffer.items.clear()

    line_errors: list = []
    with storage.open_read(input_file.storage_key) as source:
        for item in parsing.validate_stream(
            source, settings=settings, model=model, endpoint=endpoint, defaults=defaults
        ):
            total += 1
            if isinstance(item, parsing.BadLine):
                invalid += 1
                line_errors.append(item.error)
                if len(stored_errors) < MAX_STORED_ERRORS:
                    stored_errors.append(item.as_dict)
                continue
            buffer = buffers.get(item.model)
            if buffer is None:
                buffer = buffers[item.model] = _ShardBuffer(item.model)
            buffer.items.append(item.shard_line)
            if len(buffer.items) >= settings.shard_size:
                flush(buffer)
        for buffer in buffers.values():
            if buffer.items:
                flush(buffer)
    if line_errors:
        from store.results import error_row

        results_store(settings).write_part(
            job.id, VALIDATION_PART, [error_row(e, created_at=now) for e in line_errors]
        )
        del line_errors

    with session_scope(settings.database_url) as s:
        row = s.get(Job, job.id, with_for_update=True)
        row.request_total = total
        row.invalid_lines = invalid
        row.errors = stored_errors or None
        row.shard_count = len(shards)
        if total == 0:
            stored_errors.append(
                {
                    "code": "empty_file",
                    "message": "The input file has no requests.",
                    "param": None,
                    "line": None,
                }
            )
            row.errors = stored_errors
        if row.status == CANCELLING:  # cancelled while validating: nothing runs, every line gets a row
            row.in_progress_at = utcnow()  # validation is over; the finalizer may now run
            for shard in shards:
                shard.status = SHARD_CANCELLED
            s.add_all(shards)
            shards = []
        elif not shards:
            row.status = FAILED
            row.failed_at = utcnow()
        else:
            row.status = IN_PROGRESS
            row.in_progress_at = utcnow()
            s.add_all(shards)
        job = row
    if shards:
        try:
            enqueue_shards(settings, [(shard.id, shard.model) for shard in shards])
        except Exception:  # noqa: BLE001 - the shards are in the database; the sweeper enqueues them
            log.exception("enqueueing the shards of %s failed; the sweeper will retry", job.id)
    elif job.status == CANCELLING:
        maybe_finalize(settings, job.id)
    else:
        _finalize_failed(settings, job.id)
    return get_job(settings, tenant, job.id)


_WINDOW = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")


def parse_window(window: str | None) -> timedelta:
    """A completion window such as "24h" (also s, m, d) as a timedelta; 24 hours when unset."""
    match = _WINDOW.match(window or "24h")
    if match is None:
        raise StoreError(f"bad completion_window {window!r}", param="completion_window")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]
    return timedelta(**{unit: int(match.group(1))})


# ---- reading jobs ----------------------------------------------------------------------


def get_job(settings: Settings, tenant: str, job_id: str) -> Job:
    with session_scope(settings.database_url) as s:
        return _tenant_job(s, tenant, job_id)


def get_job_and_progress(settings: Settings, tenant: str, job_id: str) -> tuple[Job, Progress]:
    """The job and its live counts in one transaction: what a poll reads."""
    with session_scope(settings.database_url) as s:
        job = _tenant_job(s, tenant, job_id)
        return job, job_progress(settings, job, session=s)


def _tenant_job(s, tenant: str, job_id: str) -> Job:
    job = s.get(Job, job_id)
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
        return _page(s, Job, query, tenant, limit, after, "batch")


def _page(s, model, query, tenant: str, limit: int, after: str | None, noun: str):
    """One page of `query`, newest first, starting after the row with id `after` (keyset pagination,
    stable while rows are added); returns (rows, whether more follow)."""
    if after:
        anchor = s.get(model, after)
        if anchor is None or anchor.tenant != tenant:
            raise NotFound(f"No such {noun}: {after}", param="after")
        query = query.where(
            (model.created_at < anchor.created_at)
            | ((model.created_at == anchor.created_at) & (model.id < anchor.id))
        )
    rows = list(s.scalars(query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


@dataclass
class Progress:
    completed: int
    failed: int  # requests that failed running (invalid lines are counted apart)
    cancelled: int
    prompt_tokens: int
    completion_tokens: int
    requests_done: int  # valid requests whose shard is finished
    requests_valid: int


def job_progress(settings: Settings, job: Job, session=None) -> Progress:
    """Live counts: from the finished shards while running, from the job row once finalized.
    With `session`, read in that transaction rather than a new one."""
    valid = job.request_total - job.invalid_lines
    if job.status in (COMPLETED, CANCELLED, FAILED, EXPIRED):
        return Progress(
            job.request_completed,
            max(job.request_failed - job.invalid_lines, 0),
            job.request_cancelled,
            job.prompt_tokens,
            job.completion_tokens,
            valid,
            valid,
        )
    if not job.shard_count:
        return Progress(0, 0, 0, 0, 0, 0, valid)
    params = {"job_id": job.id}
    if session is not None:
        row = session.execute(_progress_query(), params).one()
    else:
        with session_scope(settings.database_url) as s:
            row = s.execute(_progress_query(), params).one()
    return Progress(*(int(v) for v in row), valid)


@functools.cache
def _progress_query():
    """Built once: pollers run it many times a second."""
    done = Shard.status == SHARD_DONE
    return select(
        func.coalesce(func.sum(Shard.completed), 0),
        func.coalesce(func.sum(Shard.failed), 0),
        func.coalesce(func.sum(Shard.cancelled), 0),
        func.coalesce(func.sum(Shard.prompt_tokens), 0),
        func.coalesce(func.sum(Shard.completion_tokens), 0),
        func.coalesce(func.sum(Shard.request_count).filter(done), 0),
    ).where(Shard.job_id == bindparam("job_id"))


# ---- cancelling ------------------------------------------------------------------------


def cancel_job(settings: Settings, tenant: str, job_id: str) -> Job:
    """Mark the job cancelling, drop its queued shards; running ones are aborted by their workers."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.tenant != tenant:
            raise NotFound(f"No such batch: {job_id}", param="batch_id")
        if job.status in (CANCELLING, CANCELLED):
            return job
        if job.status not in (VALIDATING, IN_PROGRESS):
            raise Conflict(f"Cannot cancel a batch with status {job.status}.")
        job.status = CANCELLING
        job.cancelling_at = utcnow()
        s.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == SHARD_QUEUED)
            .values(status=SHARD_CANCELLED, finished_at=utcnow())
        )
    maybe_finalize(settings, job_id)
    return get_job(settings, tenant, job_id)


def _stopping():
    """Jobs whose requests must stop: cancelled, or past their completion window."""
    return Job.status.in_((CANCELLING, CANCELLED, EXPIRED)) | Job.expired_at.is_not(None)


def cancelling_jobs(settings: Settings, job_ids: Iterable[str]) -> set[str]:
    """Which of these jobs are being (or have been) cancelled or expired."""
    job_ids = list(job_ids)
    if not job_ids:
        return set()
    with session_scope(settings.database_url) as s:
        return set(s.scalars(select(Job.id).where(Job.id.in_(job_ids), _stopping())))


def stop_reason(settings: Settings, job_id: str) -> str | None:
    """Why a job's unfinished requests were stopped: "expired", "cancelled" or None."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None:
            return None
        if job.expired_at is not None:
            return "expired"
        return "cancelled" if job.status in (CANCELLING, CANCELLED) else None


def expired_row(request, **kwargs) -> dict:
    """The row of a valid request that did not finish within its job's completion window."""
    from store.results import request_failed_row

    return request_failed_row(request, EXPIRED_CODE, EXPIRED_MESSAGE, **kwargs)


# ---- worker side: shards -------------------------------------------------------------


@dataclass
class ClaimedShard:
    id: str
    job_id: str
    index: int
    model: str
    attempt: int
    input_key: str
    job_model: str | None
    job_endpoint: str | None
    job_defaults: dict | None
    job_cancelling: bool
    job_created_at: object


def claim_shard(settings: Settings, shard_id_: str, worker: str, lease_s: float = 60.0) -> ClaimedShard | None:
    """Lease a queued shard (or a running one whose lease ran out) for `lease_s` seconds: attempt += 1.

    None when there is nothing to do: the shard is finished, or another worker holds a live lease on it
    (a broker redelivery while it runs). The lease must be renewed (`renew_leases`) while the shard runs.
    """
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id_, with_for_update=True)
        if shard is None or shard.status not in (SHARD_QUEUED, SHARD_RUNNING):
            return None
        now = utcnow()
        if shard.status == SHARD_RUNNING and shard.lease_until is not None and shard.lease_until > now:
            log.info("shard %s is leased by %s (attempt %d); not running it twice", shard.id, shard.worker,
                     shard.attempts)  # fmt: skip
            return None
        job = s.get(Job, shard.job_id)
        shard.status = SHARD_RUNNING
        shard.attempts += 1
        shard.started_at = now
        shard.lease_until = now + timedelta(seconds=lease_s)
        shard.worker = worker
        return ClaimedShard(
            id=shard.id,
            job_id=shard.job_id,
            index=shard.index,
            model=shard.model,
            attempt=shard.attempts,
            input_key=shard.input_key,
            job_model=job.model,
            job_endpoint=job.endpoint,
            job_defaults=job.defaults,
            job_cancelling=job.status in (CANCELLING, CANCELLED),
            job_created_at=job.created_at,
        )


def owns_shard(settings: Settings, shard_id_: str, attempt: int) -> bool:
    """Whether `attempt` is still the shard's current, running attempt (no other worker took it over)."""
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id_)
        return shard is not None and shard.status == SHARD_RUNNING and shard.attempts == attempt


def renew_leases(settings: Settings, held: dict[str, int], lease_s: float) -> set[str]:
    """Extend the leases of the shards this worker runs ({shard id: attempt}); returns those it lost."""
    lost = set()
    until = utcnow() + timedelta(seconds=lease_s)
    with session_scope(settings.database_url) as s:
        for shard_id_, attempt in held.items():
            result = s.execute(
                update(Shard)
                .where(Shard.id == shard_id_, Shard.attempts == attempt, Shard.status == SHARD_RUNNING)
                .values(lease_until=until)
            )
            if result.rowcount == 0:
                lost.add(shard_id_)
    return lost


def release_shard(settings: Settings, shard_id_: str, attempt: int) -> bool:
    """Hand an unfinished shard back (a worker shutting down): queued again, for the next worker."""
    with session_scope(settings.database_url) as s:
        result = s.execute(
            update(Shard)
            .where(Shard.id == shard_id_, Shard.attempts == attempt, Shard.status == SHARD_RUNNING)
            .values(status=SHARD_QUEUED, lease_until=None, worker=None)
        )
        return result.rowcount == 1


def finish_shard(settings: Settings, shard_id_: str, part_key: str, counts, attempt: int | None = None) -> bool:
    """Record a shard's durable part; counts are set from the part, never added.

    With `attempt`, only that attempt may finish the shard (False for a stale one).
    """
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id_, with_for_update=True)
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
        shard.finished_at = utcnow()
        shard.error = None
    return True


def fail_shard(settings: Settings, shard_id_: str, error: str) -> None:
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id_)
        if shard is not None:
            shard.error = error[-4000:]


def expire_job(settings: Settings, job_id: str) -> bool:
    """Stop a job past its completion window: queued shards never run, running ones are aborted by their
    workers (the cancel watcher), and the finalizer makes it `expired`, keeping what finished."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        now = utcnow()
        if job is None or job.status != IN_PROGRESS or job.expired_at is not None:
            return False
        if job.expires_at is None or job.expires_at > now:
            return False
        job.expired_at = now
        s.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == SHARD_QUEUED)
            .values(status=SHARD_CANCELLED, finished_at=now, lease_until=None)
        )
    log.info("job %s expired", job_id)
    maybe_finalize(settings, job_id)
    return True


# ---- finalizing --------------------------------------------------------------------------


def maybe_finalize(settings: Settings, job_id: str) -> bool:
    """Finalize the job if every shard is finished: merge parts, write files, set counts and status.

    Safe to call from many places at once: the job row lock lets exactly one caller do it.
    """
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None:
            return False
        if job.status not in (IN_PROGRESS, CANCELLING, FINALIZING):
            return False
        if job.status == CANCELLING and job.in_progress_at is None:
            return False  # cancelled while validating: create_job finalizes it when validation ends
        # `finalizing_at` marks a finalizer at work; one silent for too long is presumed dead
        busy = job.finalizing_at is not None and utcnow() - job.finalizing_at <= STALE_FINALIZE
        if busy:
            return False
        unfinished = s.scalar(
            select(func.count())
            .select_from(Shard)
            .where(Shard.job_id == job_id, Shard.status.not_in((SHARD_DONE, SHARD_CANCELLED)))
        )
        if unfinished:
            return False
        if job.expired_at is not None:
            target = EXPIRED
        else:
            target = CANCELLED if job.cancelling_at is not None else COMPLETED
        if target == COMPLETED:  # visible as "finalizing" while the files are written
            job.status = FINALIZING
        job.finalizing_at = utcnow()
        never_run = list(
            s.execute(
                select(Shard.id, Shard.input_key).where(
                    Shard.job_id == job_id, Shard.status == SHARD_CANCELLED, Shard.part_key.is_(None)
                )
            )
        )
        created_at = job.created_at
        tenant = job.tenant
    store = results_store(settings)
    for shard_id_, input_key in never_run:
        _write_cancelled_part(settings, store, job_id, shard_id_, input_key, created_at, target == EXPIRED)
    counts, output_file, error_file = _write_final_files(settings, job_id, tenant)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job.status in TERMINAL_STATUSES:
            return False
        _set_counts(job, counts)
        job.output_file_id = output_file.id if output_file else None
        job.error_file_id = error_file.id if error_file else None
        job.status = target
        if target == COMPLETED:
            job.completed_at = utcnow()
        elif target == CANCELLED:
            job.cancelled_at = utcnow()
    return True


def _set_counts(job: Job, counts) -> None:
    job.request_completed = counts.completed
    job.request_failed = counts.failed
    job.request_cancelled = counts.cancelled
    job.prompt_tokens = counts.prompt_tokens
    job.completion_tokens = counts.completion_tokens


def _write_cancelled_part(settings, store, job_id, shard_id_, input_key, created_at, expired=False) -> None:
    """A shard stopped before it ran: one "cancelled" (or expired) row per request, so every line has a row."""
    from batchfile import parsing
    from store.results import cancelled_row

    row = expired_row if expired else cancelled_row
    with get_storage(settings.storage_url).open_read(input_key) as f:
        rows = [
            row(parsing.decode_request(line), shard_id=shard_id_, created_at=created_at)
            for line in f
            if line.strip()
        ]
    path = store.write_part(job_id, shard_id_, rows)
    with session_scope(settings.database_url) as s:
        shard = s.get(Shard, shard_id_)
        shard.part_key = path


def _finalize_failed(settings: Settings, job_id: str) -> None:
    """A job that failed validation: its error file (and an all-failed results file)."""
    with session_scope(settings.database_url) as s:
        tenant = s.get(Job, job_id).tenant
    counts, _, error_file = _write_final_files(settings, job_id, tenant, output=False)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        _set_counts(job, counts)
        job.error_file_id = error_file.id if error_file else None


def _write_final_files(settings: Settings, job_id: str, tenant: str, output: bool = True):
    """Merge the parts into one Parquet file; write the OpenAI output and error files; count rows."""
    store = results_store(settings)
    storage = get_storage(settings.storage_url)
    store.merge(job_id)
    counts = store.count(job_id)
    output_file = error_file = None
    if output:
        with storage.open_write(output_key(job_id)) as out:
            for line in store.iter_output_jsonl(job_id):
                out.write(line.encode())
        output_file = register_file(
            settings,
            tenant=tenant,
            key=output_key(job_id),
            filename=f"{job_id}_output.jsonl",
            purpose="batch_output",
        )
    if counts.failed or counts.cancelled:
        with storage.open_write(errors_key(job_id)) as out:
            for line in store.iter_error_jsonl(job_id):
                out.write(line.encode())
        error_file = register_file(
            settings,
            tenant=tenant,
            key=errors_key(job_id),
            filename=f"{job_id}_error.jsonl",
            purpose="batch_output",
        )
    return counts, output_file, error_file


def list_files(
    settings: Settings, tenant: str, *, purpose: str | None = None, limit: int = 100, after: str | None = None
) -> tuple[list[File], bool]:
    with session_scope(settings.database_url) as s:
        query = select(File).where(File.tenant == tenant)
        if purpose:
            query = query.where(File.purpose == purpose)
        return _page(s, File, query, tenant, limit, after, "file")

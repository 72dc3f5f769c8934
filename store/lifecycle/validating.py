"""A job's input validated in the background, streamed and resumable.

`store.lifecycle.jobs.create_job` inserts the job `validating` and returns at once; `validate_job` (run by the API's
validation pool, or by a worker's sweeper when the API process that owned it died) reads the input line by
line, writes the valid lines as shards and the invalid ones as failed rows, and commits in checkpoints:
each checkpoint writes every pending shard and error part, then records in one transaction how many input
lines are done (`Job.validated_lines`). A validator that dies loses only the lines since its last
checkpoint: the next one re-reads the file and skips the committed lines (shard and part names are
derived from the counts, so rewriting them is harmless).

With `on_invalid_lines=skip` shards are enqueued as they are written (work starts while a large file is
still being validated: the first plan windows are small, `batchfile.prefix_plan.window_lines`) and the job
turns `in_progress` with its first shard; with `fail` (OpenAI's /v1/batches) shards are held until the whole
file passed, and one invalid line fails the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial

from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError

from batchfile.model_limits import ModelLimits, UnknownModel, limits_by_name, limits_of
from batchfile.prefix_plan import PlanLine, plan_shards, window_lines
from batchfile.shard_input import BadLine, validate_stream
from store import models_registry
from store.db import session_scope
from store.errors import StoreError
from store.filestore.paths import shard_id, shard_input_key
from store.filestore.storage import get_storage
from store.filestore.storage_faults import classify, retrying
from store.filestore.storage_waits import clear_wait, due, record_failure
from store.lifecycle.finalize import finalize_failed, maybe_finalize
from store.models import (
    CANCELLING,
    FAIL_INVALID,
    FAILED,
    IN_PROGRESS,
    SHARD_CANCELLED,
    SHARD_HELD,
    SHARD_QUEUED,
    VALIDATING,
    File,
    Job,
    Shard,
    utcnow,
)
from store.results.parts import results_store
from store.results.rows import error_row
from store.settings import Settings

log = logging.getLogger(__name__)

Enqueue = Callable[[list[tuple[str, str]]], None]  # (shard id, model) pairs to the workers

MAX_STORED_ERRORS = 100  # line errors kept on the job row; all of them are in the error file
MAX_BUFFERED_ERRORS = 1000  # invalid lines held before a checkpoint writes them
HEARTBEAT_S = 5.0  # a validator renews its claim at least this often
STALE_VALIDATION = timedelta(seconds=60)  # a validator silent this long is replaced
EMPTY_FILE_ERROR = {"code": "empty_file", "message": "The input file has no requests.", "param": None, "line": None}
ACTIVE = (VALIDATING, IN_PROGRESS, CANCELLING)


class ValidationLost(Exception):
    """Another validator took the job over (this one was presumed dead)."""


def model_limits(settings: Settings, model: str | None) -> ModelLimits | dict[str, ModelLimits]:
    """The job's model, or every known model when each line names its own: running workers' models from
    the registry, PAGEDBATCH_MODELS overriding."""
    paths = models_registry.model_paths(settings)
    adapters = {
        name: base
        for name, (base, _) in models_registry.running_adapters(settings).items()
        if base in paths and name not in paths
    }
    if model is None:
        limits = limits_by_name(paths, settings.special_tokens_in_content)
        return limits | {name: replace(limits[base], name=name, base_model=base) for name, base in adapters.items()}
    try:
        if model in adapters:  # a LoRA adapter: its base model's limits, the lines routed to the base
            base = limits_of(paths, adapters[model], settings.special_tokens_in_content)
            return replace(base, name=model, base_model=adapters[model])
        return limits_of(paths, model, settings.special_tokens_in_content)
    except UnknownModel as exc:
        raise StoreError(str(exc), param="model") from None
    except (OSError, ValueError) as exc:  # a registered path this host cannot read
        raise StoreError(
            f"model {model!r} is served from {paths[model]!r}, which the API cannot read ({exc}); "
            "mount the model at the same path on the API host or set PAGEDBATCH_MODELS",
            param="model",
        ) from None


def claim_validation(settings: Settings, job_id: str, owner: str) -> bool:
    """Whether `owner` may validate the job: it holds the claim, or the holder went silent (taken over)."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.validated_at is not None or job.status not in ACTIVE:
            return False
        now = utcnow()
        beat = job.validation_heartbeat_at
        if job.validation_owner != owner and beat is not None and now - beat < STALE_VALIDATION:
            return False
        if not due(job):  # its last validator failed on the storage: not before the backoff is over
            return False
        job.validation_owner, job.validation_heartbeat_at, job.retry_at = owner, now, None
        return True


def stale_validations(settings: Settings, models: Collection[str] | None = None, limit: int = 100) -> list[str]:
    """Jobs whose validator went silent, oldest first. With `models`, only the jobs of one of them (a worker
    knows only the models it serves, and a job whose lines name their own models needs them all)."""
    cutoff = utcnow() - STALE_VALIDATION
    query = select(Job.id).where(
        Job.validated_at.is_(None),
        Job.status.in_(ACTIVE),
        (Job.validation_heartbeat_at.is_(None)) | (Job.validation_heartbeat_at < cutoff),
        Job.retry_at.is_(None) | (Job.retry_at <= utcnow()),
    )
    if models is not None:
        query = query.where(Job.model.in_(list(models)))
    with session_scope(settings.database_url) as s:
        return list(s.scalars(query.order_by(Job.created_at).limit(limit)))


@dataclass
class _Run:
    """One validator's state between checkpoints."""

    job_id: str
    owner: str
    fail_mode: bool
    created_at: object
    done_lines: int  # committed input lines (the last line number)
    total: int  # lines read, the committed ones included
    invalid: int
    shard_count: int
    parts: int
    errors: list[dict]
    planned: tuple[int, int, int] = (0, 0, 0)  # committed: prompt tokens, expected cached, max completion tokens
    workers: int = 1  # the workers serving the job's model: the plan spreads its prefix groups over them
    pending: dict[str, list[PlanLine]] = field(default_factory=dict)  # model -> valid lines, planned at checkpoints
    bad: list[BadLine] = field(default_factory=list)
    last_line: int = 0
    beat: float = field(default_factory=time.monotonic)


def validate_job(settings: Settings, job_id: str, owner: str, enqueue: Enqueue) -> bool:
    """Validate (or resume validating) the job; False when another validator holds it."""
    if not claim_validation(settings, job_id, owner):
        return False
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        input_file = s.get(File, job.input_file_id)
        run = _Run(
            job_id,
            owner,
            job.on_invalid_lines == FAIL_INVALID,
            job.created_at,
            job.validated_lines,
            0,
            0,
            job.shard_count,
            job.validation_parts,
            list(job.errors or []),
            (job.planned_prompt_tokens, job.planned_cached_tokens, job.planned_completion_tokens),
        )
        model, endpoint, defaults = job.model, job.endpoint, job.defaults
    try:
        models = model_limits(settings, model)
        bounds = settings.request_bounds(openai=endpoint is not None)
        run.workers = models_registry.worker_count(settings, model)
        storage = get_storage(settings.storage_url)
        with retrying(lambda: storage.open_read(input_file.storage_key), "reading the input file") as source:
            stream = validate_stream(
                source, models, endpoint=endpoint, defaults=defaults, bounds=bounds, block_size=settings.plan_block_size
            )
            for item in stream:
                line = item.error.line if isinstance(item, BadLine) else item.line
                if line <= run.done_lines:  # committed by an earlier validator: only counted
                    run.total += 1
                    run.invalid += isinstance(item, BadLine)
                    if time.monotonic() - run.beat > HEARTBEAT_S:
                        _heartbeat(settings, run)
                    continue
                _take(settings, run, item, line, enqueue)
        _checkpoint(settings, run, enqueue)
        _finish(settings, run, enqueue)
    except ValidationLost:
        log.warning("validation of %s was taken over by another validator", job_id)
        return False
    return True


def _take(settings: Settings, run: _Run, item, line: int, enqueue: Enqueue) -> None:
    run.total += 1
    run.last_line = line
    if isinstance(item, BadLine):
        run.invalid += 1
        run.bad.append(item)
        if len(run.errors) < MAX_STORED_ERRORS:
            run.errors.append(item.as_dict)
        full = len(run.bad) >= MAX_BUFFERED_ERRORS
    else:
        lines = run.pending.setdefault(item.model, [])
        lines.append(item.plan_line)
        window = settings.plan_window_lines if settings.plan_prefixes else 1
        full = len(lines) >= window_lines(window, settings.shard_size, run.shard_count)
    if full:
        _checkpoint(settings, run, enqueue)
    elif time.monotonic() - run.beat > HEARTBEAT_S:
        _heartbeat(settings, run)


def _heartbeat(settings: Settings, run: _Run) -> None:
    with session_scope(settings.database_url) as s:
        done = s.execute(
            update(Job)
            .where(Job.id == run.job_id, Job.validation_owner == run.owner)
            .values(validation_heartbeat_at=utcnow())
        )
    if not done.rowcount:
        raise ValidationLost
    run.beat = time.monotonic()


def _checkpoint(settings: Settings, run: _Run, enqueue: Enqueue) -> None:
    """Write the pending shards and invalid lines, then commit them and the lines read so far."""
    storage = get_storage(settings.storage_url)
    shards = []
    prompt, cached, completion = run.planned
    for model, lines in run.pending.items():
        planned = plan_shards(
            lines,
            shard_size=settings.shard_size,
            workers=run.workers,
            block_size=settings.plan_block_size,
            # a window of at most one shard has nothing to plan: shards as validated, in file order
            planned=settings.plan_prefixes and settings.plan_window_lines > settings.shard_size,
        )
        for plan in planned:
            index = run.shard_count + len(shards)
            key = shard_input_key(run.job_id, index)
            with storage.open_write(key) as out:
                out.write("".join(line.shard_line for line in plan.lines).encode())
            shards.append(
                Shard(
                    id=shard_id(run.job_id, index),
                    job_id=run.job_id,
                    index=index,
                    model=model,
                    request_count=len(plan.lines),
                    input_key=key,
                )
            )
            prompt += sum(line.prompt_tokens for line in plan.lines)
            completion += sum(line.max_tokens for line in plan.lines)
            cached += plan.expected_cached
    parts = run.parts
    if run.bad:
        rows = [error_row(bad.error, created_at=run.created_at) for bad in run.bad]
        results_store(settings).write_part(run.job_id, f"validation-{parts}", rows)
        parts += 1
    with session_scope(settings.database_url) as s:
        job = s.get(Job, run.job_id, with_for_update=True)
        if job.validation_owner != run.owner:
            raise ValidationLost
        stopping = job.status == CANCELLING or job.expired_at is not None
        status = SHARD_CANCELLED if stopping else SHARD_HELD if run.fail_mode else SHARD_QUEUED
        for shard in shards:
            shard.status = status
        s.add_all(shards)
        clear_wait(job)  # written: it no longer waits on the storage
        job.validated_lines = max(run.last_line, run.done_lines)
        job.invalid_lines, job.errors = run.invalid, list(run.errors) or None
        job.shard_count = run.shard_count + len(shards)
        job.planned_prompt_tokens, job.planned_cached_tokens, job.planned_completion_tokens = prompt, cached, completion
        job.validation_parts = parts
        if shards and job.served_model is None:
            job.served_model = shards[0].model
        job.validation_heartbeat_at = utcnow()
        if status == SHARD_QUEUED and shards and job.status == VALIDATING:
            job.status, job.in_progress_at = IN_PROGRESS, utcnow()
    run.done_lines = max(run.last_line, run.done_lines)
    run.shard_count, run.parts = run.shard_count + len(shards), parts
    run.planned = (prompt, cached, completion)
    run.pending.clear()
    run.bad.clear()
    run.beat = time.monotonic()
    if status == SHARD_QUEUED and shards:
        _enqueue(enqueue, run.job_id, [(shard.id, shard.model) for shard in shards])


def _enqueue(enqueue: Enqueue, job_id: str, shards: list[tuple[str, str]]) -> None:
    try:
        enqueue(shards)
    except Exception:  # the shards are in the database; the sweeper enqueues them
        log.exception("enqueueing the shards of %s failed; the sweeper will retry", job_id)


def _finish(settings: Settings, run: _Run, enqueue: Enqueue) -> None:
    """The whole file is read: the job runs, fails (nothing valid; or an invalid line under `fail`), or,
    stopped meanwhile, finalizes."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, run.job_id, with_for_update=True)
        if job.validation_owner != run.owner:
            raise ValidationLost
        now = utcnow()
        job.validation_heartbeat_at = now
        job.request_total, job.invalid_lines = run.total, run.invalid
        if run.total == 0:
            job.errors = [*(job.errors or []), dict(EMPTY_FILE_ERROR)]
        held = select(Shard).where(Shard.job_id == run.job_id, Shard.status == SHARD_HELD)
        stopping = job.status == CANCELLING or job.expired_at is not None
        failed = not stopping and (run.total == run.invalid or (run.fail_mode and run.invalid > 0))
        to_run: list[tuple[str, str]] = []
        for shard in s.scalars(held):
            if stopping or failed:
                shard.status, shard.finished_at = SHARD_CANCELLED, now
            else:
                shard.status = SHARD_QUEUED
                to_run.append((shard.id, shard.model))
        if not failed:  # a failed job is marked validated and failed once its error file is written
            job.validated_at = now
            if not stopping:
                job.in_progress_at = job.in_progress_at or now
                job.status = IN_PROGRESS
            elif job.in_progress_at is None:
                job.in_progress_at = now
    if failed:
        finalize_failed(settings, run.job_id, mark_failed=True)
        return
    if to_run:
        _enqueue(enqueue, run.job_id, to_run)
    maybe_finalize(settings, run.job_id)  # its shards may all be finished already, or it was stopped


def _give_back(owner: str, _s, job: Job) -> None:
    if job.validation_owner == owner:
        job.validation_owner, job.validation_heartbeat_at = None, None


def fail_validation(settings: Settings, job_id: str, owner: str, message: str) -> None:
    """A validator hit an error it cannot get past (not a bad line): the job fails with it."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.validation_owner != owner or job.validated_at is not None:
            return
        now = utcnow()
        job.status, job.failed_at, job.validated_at = FAILED, now, now
        error = {"code": "validation_error", "message": message, "param": None, "line": None}
        job.errors = [*(job.errors or []), error]
        s.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status.in_((SHARD_QUEUED, SHARD_HELD)))
            .values(status=SHARD_CANCELLED, finished_at=now)
        )


def run_validation(settings: Settings, job_id: str, owner: str, enqueue: Enqueue) -> None:
    """`validate_job` for a background thread: a database outage leaves the job to be resumed (by a
    worker's sweeper once the claim is stale); any other error fails the job with its message."""
    try:
        validate_job(settings, job_id, owner, enqueue)
    except DBAPIError:
        log.exception("validating %s: the database failed; it will be resumed", job_id)
    except Exception as exc:  # the job must not stay validating forever
        if classify(exc) is not None:  # given back at once: resumed after a backoff, or failed with a clear code
            try:
                record_failure(
                    settings, job_id, exc, "validating the input", "validation will retry", partial(_give_back, owner)
                )
            except Exception:  # the database too: the claim goes stale and is taken over
                log.exception("could not record the storage failure of %s", job_id)
            return
        log.exception("validating %s failed", job_id)
        try:
            fail_validation(settings, job_id, owner, f"validation failed: {type(exc).__name__}: {exc}")
            finalize_failed(settings, job_id)
        except Exception:
            log.exception("could not record the failed validation of %s", job_id)

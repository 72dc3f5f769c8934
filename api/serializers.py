"""Store rows as the API's objects (api.objects): OpenAI's File and Batch, the native Job, and pages."""

from __future__ import annotations

from datetime import datetime

from api import objects
from store.lifecycle.progress import Progress
from store.lifecycle.quotes import Quote, estimated_completion
from store.models import File, Job


def ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_object(record: File) -> objects.File:
    return objects.File(
        id=record.id,
        bytes=record.bytes,
        created_at=ts(record.created_at),
        filename=record.filename,
        purpose=record.purpose,
        expires_at=ts(record.expires_at),
    )


def _timestamps(job: Job) -> dict:
    return {
        "created_at": ts(job.created_at),
        "in_progress_at": ts(job.in_progress_at),
        "expires_at": ts(job.expires_at),
        "finalizing_at": ts(job.finalizing_at),
        "completed_at": ts(job.completed_at),
        "failed_at": ts(job.failed_at),
        "expired_at": ts(job.expired_at),
        "cancelling_at": ts(job.cancelling_at),
        "cancelled_at": ts(job.cancelled_at),
    }


def _line_errors(job: Job) -> list[objects.LineError]:
    return [
        objects.LineError(code=e.get("code"), message=e.get("message"), param=e.get("param"), line=e.get("line"))
        for e in (job.errors or [])
    ]


def _waiting(job: Job) -> list[objects.LineError]:
    """Why the job waits (its status_detail) as an error entry without a line: OpenAI's Batch has no other field
    for it. Gone once the job moves on."""
    if not job.status_detail:
        return []
    code = job.status_detail.split(":", 1)[0]
    return [objects.LineError(code=code, message=job.status_detail, param=None, line=None)]


def batch_object(job: Job, progress: Progress) -> objects.Batch:
    """OpenAI's Batch. Lines that failed validation and cancelled requests count as failed requests, so
    that `completed` and `failed` are the lines of the output and error files."""
    errors = _line_errors(job) + _waiting(job)
    return objects.Batch(
        id=job.id,
        endpoint=job.endpoint or "/v1/chat/completions",
        model=job.model or job.served_model,
        errors=objects.BatchErrors(data=errors) if errors else None,
        input_file_id=job.input_file_id,
        completion_window=job.completion_window,
        status=job.status,
        output_file_id=job.output_file_id,
        error_file_id=job.error_file_id,
        **_timestamps(job),
        request_counts=objects.BatchRequestCounts(
            # every line of the error file: failed running, invalid, cancelled or expired unrun
            total=job.request_total,
            completed=progress.completed,
            failed=progress.failed + progress.cancelled + job.invalid_lines,
        ),
        usage=objects.BatchUsage(
            input_tokens=progress.prompt_tokens,
            input_tokens_details=objects.InputTokensDetails(cached_tokens=progress.cached_tokens),
            output_tokens=progress.completion_tokens,
            total_tokens=progress.prompt_tokens + progress.completion_tokens,
        ),
        metadata=job.job_metadata,
    )


def _estimate(job: Job, progress: Progress) -> dict:
    """A running job's estimated completion from its progress and live rate, and whether it misses its window."""
    eta = estimated_completion(job, progress)
    at_risk = eta is not None and job.expires_at is not None and eta > job.expires_at
    return {"estimated_completion_at": None if eta is None else int(eta.timestamp()), "deadline_at_risk": at_risk}


def job_object(job: Job, progress: Progress) -> objects.Job:
    """The native job: status, request counts, token usage, timestamps and progress."""
    valid = job.request_total - job.invalid_lines
    return objects.Job(
        id=job.id,
        status=job.status,
        model=job.model,
        endpoint=job.endpoint,
        defaults=job.defaults,
        metadata=job.job_metadata,
        priority=job.priority or 0,
        input_file_id=job.input_file_id,
        output_file_id=job.output_file_id,
        error_file_id=job.error_file_id,
        request_counts=objects.JobRequestCounts(
            total=job.request_total,
            valid=valid,
            invalid=job.invalid_lines,
            completed=progress.completed,
            failed=progress.failed,
            cancelled=progress.cancelled,
        ),
        usage=objects.JobUsage(
            prompt_tokens=progress.prompt_tokens,
            prompt_tokens_details=objects.PromptTokensDetails(cached_tokens=progress.cached_tokens),
            completion_tokens=progress.completion_tokens,
            total_tokens=progress.prompt_tokens + progress.completion_tokens,
        ),
        progress=round(progress.requests_done / valid, 4) if valid else 1.0,
        shards=job.shard_count,
        plan=objects.JobPlan(
            prompt_tokens=job.planned_prompt_tokens or 0,
            expected_cached_tokens=job.planned_cached_tokens or 0,
            max_completion_tokens=job.planned_completion_tokens or 0,
            cached_tokens=progress.cached_tokens,
        ),
        **_estimate(job, progress),
        errors=_line_errors(job),
        status_detail=job.status_detail,
        **_timestamps(job),
    )


def page(list_type: type[objects.ListOf], items: list[objects.ApiObject], has_more: bool) -> objects.ListOf:
    """One page of a list endpoint; `last_id` is the cursor for the next."""
    return list_type(
        data=items,
        first_id=items[0].id if items else None,
        last_id=items[-1].id if items else None,
        has_more=has_more,
    )


def quote_object(model: str, quote: Quote) -> objects.JobQuote:
    def unix(when):
        return None if when is None else int(when.timestamp())

    return objects.JobQuote(
        model=model,
        lines=quote.lines,
        invalid_lines=quote.invalid_lines,
        shards=quote.shards,
        prompt_tokens=quote.work.prompt_tokens,
        expected_cached_tokens=quote.work.cached_tokens,
        max_completion_tokens=quote.work.completion_tokens,
        workers=quote.workers,
        estimated_run_seconds=None if quote.run_seconds is None else round(quote.run_seconds, 3),
        queue_ahead_seconds=None if quote.queue_seconds is None else round(quote.queue_seconds, 3),
        estimated_start_at=unix(quote.start_at),
        estimated_completion_at=unix(quote.completion_at),
    )

"""JSON shapes: OpenAI's file and batch objects, and the native job object."""

from __future__ import annotations

from datetime import datetime

from store.lifecycle import Progress
from store.models import File, Job


def ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_object(record: File) -> dict:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": ts(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


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


def _line_errors(job: Job) -> list[dict]:
    return [
        {"code": e.get("code"), "message": e.get("message"), "param": e.get("param"), "line": e.get("line")}
        for e in (job.errors or [])
    ]


def batch_object(job: Job, progress: Progress) -> dict:
    """OpenAI's Batch. Lines that failed validation count as failed requests."""
    errors = _line_errors(job)
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": job.endpoint or "/v1/chat/completions",
        "model": job.model,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": job.input_file_id,
        "completion_window": job.completion_window,
        "status": job.status,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        **_timestamps(job),
        "request_counts": {
            "total": job.request_total,
            "completed": progress.completed,
            "failed": progress.failed + job.invalid_lines,
        },
        "usage": {
            "input_tokens": progress.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": progress.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": progress.prompt_tokens + progress.completion_tokens,
        },
        "metadata": job.job_metadata,
    }


def job_object(job: Job, progress: Progress) -> dict:
    """The native job: status, request counts, token usage, timestamps and progress."""
    valid = job.request_total - job.invalid_lines
    return {
        "id": job.id,
        "object": "job",
        "status": job.status,
        "model": job.model,
        "endpoint": job.endpoint,
        "defaults": job.defaults,
        "metadata": job.job_metadata,
        "input_file_id": job.input_file_id,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "request_counts": {
            "total": job.request_total,
            "valid": valid,
            "invalid": job.invalid_lines,
            "completed": progress.completed,
            "failed": progress.failed,
            "cancelled": progress.cancelled,
        },
        "usage": {
            "prompt_tokens": progress.prompt_tokens,
            "completion_tokens": progress.completion_tokens,
            "total_tokens": progress.prompt_tokens + progress.completion_tokens,
        },
        "progress": round(progress.requests_done / valid, 4) if valid else 1.0,
        "shards": job.shard_count,
        "errors": _line_errors(job),
        **_timestamps(job),
    }

"""Where a job's files live in the storage, and how shards are named."""

from __future__ import annotations


def file_key(file_id: str) -> str:
    return f"files/{file_id}.jsonl"


def shard_input_key(job_id: str, index: int) -> str:
    return f"jobs/{job_id}/inputs/shard-{index:05d}.jsonl"


def output_key(job_id: str) -> str:
    return f"jobs/{job_id}/output.jsonl"


def errors_key(job_id: str) -> str:
    return f"jobs/{job_id}/errors.jsonl"


def shard_id(job_id: str, index: int) -> str:
    return f"{job_id}.{index:05d}"

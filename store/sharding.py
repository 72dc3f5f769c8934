"""A job's input file, validated line by line (streamed), its valid lines written as shard input files.

A shard holds up to `settings.shard_size` lines of one model, in input order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfile.model_limits import ModelLimits
from batchfile.shard_input import BadLine, validate_stream
from store.models import SHARD_QUEUED, File, Shard
from store.paths import shard_id, shard_input_key
from store.settings import Settings
from store.storage import Storage, get_storage


@dataclass
class ShardedInput:
    total: int = 0  # every line of the input
    shards: list[Shard] = field(default_factory=list)  # written, not yet in the database
    bad_lines: list[BadLine] = field(default_factory=list)


def shard_input(
    settings: Settings,
    job_id: str,
    input_file: File,
    models: ModelLimits | dict[str, ModelLimits],
    *,
    endpoint: str | None,
    defaults: dict | None,
) -> ShardedInput:
    """`models`: the one model every line runs on, or {name: limits} for lines that name their model."""
    storage = get_storage(settings.storage_url)
    result = ShardedInput()
    pending: dict[str, list[str]] = {}  # model -> shard lines not yet written

    def write(model_name: str, lines: list[str]) -> None:
        result.shards.append(_write_shard(storage, job_id, len(result.shards), model_name, lines))
        lines.clear()

    with storage.open_read(input_file.storage_key) as source:
        bounds = settings.request_bounds(openai=endpoint is not None)
        for item in validate_stream(source, models, endpoint=endpoint, defaults=defaults, bounds=bounds):
            result.total += 1
            if isinstance(item, BadLine):
                result.bad_lines.append(item)
                continue
            lines = pending.setdefault(item.model, [])
            lines.append(item.shard_line)
            if len(lines) >= settings.shard_size:
                write(item.model, lines)
    for model_name, lines in pending.items():
        if lines:
            write(model_name, lines)
    return result


def _write_shard(storage: Storage, job_id: str, index: int, model: str, lines: list[str]) -> Shard:
    key = shard_input_key(job_id, index)
    with storage.open_write(key) as out:
        out.write("".join(lines).encode())
    return Shard(
        id=shard_id(job_id, index),
        job_id=job_id,
        index=index,
        model=model,
        status=SHARD_QUEUED,
        request_count=len(lines),
        input_key=key,
    )

"""Parquet results: one row per request, one part file per shard, merged per job.

Layout in a results store (a local directory or any fsspec URL, e.g. ``s3://bucket/results``)::

    <root>/<job id>/parts/<shard id>.parquet   one part per shard; a rewritten shard overwrites it
    <root>/<job id>/results.parquet            all parts merged, sorted by line (`merge`)

Every file is written under a temporary name next to its final one (``.<name>.<random>.tmp``,
never listed as a part) and then renamed (local) or moved (fsspec) into place, so readers never
see half a file. Counts and OpenAI JSONL come from the rows, read in batches, never a whole job
in memory.

Schema (`RESULT_SCHEMA`), one row per request line:

=================  ===================  ========================================================
column             type                 meaning
=================  ===================  ========================================================
custom_id          string               the line's custom_id (null when the line had none)
line               int64, not null      1-based line number in the input file
status             string, not null     "completed" | "failed" | "cancelled"
url                string               "/v1/chat/completions" | "/v1/completions"
model              string               the model that served (or would have served) it
output_text        string               text of choice 0
output_token_ids   list<int32>          token ids of choice 0
finish_reason      string               choice 0's: "stop" | "length"
prompt_tokens      int32                prompt length in tokens
completion_tokens  int32                generated tokens, all choices together
error_code         string               for failed/cancelled rows (see batchfile.requests codes)
error_message      string               for failed/cancelled rows
response_body      string               the full OpenAI response body as JSON (every choice)
shard_id           string               the shard that produced the row
created_at         timestamp[us, UTC]   when the request was accepted (job creation)
started_at         timestamp[us, UTC]   when it entered the engine
finished_at        timestamp[us, UTC]   when it finished (or failed)
latency_ms         float64              finished_at - started_at in milliseconds
=================  ===================  ========================================================
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchfile.requests import (
    REQUEST_ERROR_CODES,
    LineError,
    ParsedRequest,
    batch_error_line,
    response_body,
)

COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
STATUSES = (COMPLETED, FAILED, CANCELLED)
CANCELLED_CODE = "batch_cancelled"
ABORTED_CODE = "request_aborted"

_TS = pa.timestamp("us", tz="UTC")
RESULT_SCHEMA = pa.schema([
    pa.field("custom_id", pa.string()),
    pa.field("line", pa.int64(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("url", pa.string()),
    pa.field("model", pa.string()),
    pa.field("output_text", pa.string()),
    pa.field("output_token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("error_code", pa.string()),
    pa.field("error_message", pa.string()),
    pa.field("response_body", pa.string()),
    pa.field("shard_id", pa.string()),
    pa.field("created_at", _TS),
    pa.field("started_at", _TS),
    pa.field("finished_at", _TS),
    pa.field("latency_ms", pa.float64()),
])  # fmt: skip

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# --------------------------------------------------------------------------------------------------
# Rows


def _ts(value) -> datetime | None:
    """A UTC datetime from a datetime (naive means UTC) or epoch seconds."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromtimestamp(float(value), UTC)


def _times(created_at, started_at, finished_at) -> dict:
    started, finished = _ts(started_at), _ts(finished_at)
    latency = (finished - started).total_seconds() * 1000 if started and finished else None
    return {
        "created_at": _ts(created_at),
        "started_at": started,
        "finished_at": finished,
        "latency_ms": latency,
    }


def completed_row(
    request: ParsedRequest,
    output,
    *,
    shard_id: str | None = None,
    body: dict | None = None,
    tokenizer=None,
    created_at=None,
    started_at=None,
    finished_at=None,
) -> dict:
    """The row for a request the engine finished (`output`: engine RequestOutput).

    `body` defaults to `response_body(request, output, tokenizer=tokenizer)`. A request whose
    choices the engine aborted becomes a "cancelled" row with the partial text kept.
    Times: datetimes or epoch seconds.
    """
    choices = sorted(output.outputs, key=lambda c: c.index)
    first = choices[0] if choices else None
    aborted = any(c.finish_reason == "abort" for c in choices)
    if body is None and not aborted:
        body = response_body(request, output, tokenizer=tokenizer)
    prompt_tokens = len(output.prompt_token_ids or request.prompt_token_ids or [])
    return {
        "custom_id": request.custom_id,
        "line": request.line,
        "status": CANCELLED if aborted else COMPLETED,
        "url": request.url,
        "model": request.model,
        "output_text": first.text if first else None,
        "output_token_ids": list(first.token_ids) if first else None,
        "finish_reason": first.finish_reason if first else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(len(c.token_ids) for c in choices),
        "error_code": ABORTED_CODE if aborted else None,
        "error_message": "the request was aborted before it finished" if aborted else None,
        "response_body": None if body is None else json.dumps(body, ensure_ascii=False),
        "shard_id": None if shard_id is None else str(shard_id),
        **_times(created_at, started_at, finished_at),
    }


def failed_row(
    line: int,
    custom_id: str | None,
    code: str,
    message: str,
    *,
    status: str = FAILED,
    url: str | None = None,
    model: str | None = None,
    prompt_tokens: int | None = None,
    shard_id: str | None = None,
    created_at=None,
    started_at=None,
    finished_at=None,
) -> dict:
    """The row for a request that failed (or, with status="cancelled", was never run)."""
    if status not in (FAILED, CANCELLED):
        raise ValueError(f"a failed row's status is failed or cancelled, not {status!r}")
    row = dict.fromkeys(RESULT_SCHEMA.names)
    row.update(
        custom_id=custom_id,
        line=line,
        status=status,
        url=url,
        model=model,
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        error_code=code,
        error_message=message,
        shard_id=None if shard_id is None else str(shard_id),
        **_times(created_at, started_at, finished_at),
    )
    return row


def error_row(error: LineError, **kwargs) -> dict:
    """The failed row for a line that did not validate."""
    return failed_row(error.line, error.custom_id, error.code, error.message, **kwargs)


def request_failed_row(request: ParsedRequest, code: str, message: str, **kwargs) -> dict:
    """`failed_row` for a valid request: its line, custom_id, url, model and prompt length."""
    prompt_tokens = len(request.prompt_token_ids) if request.prompt_token_ids is not None else None
    return failed_row(
        request.line, request.custom_id, code, message,
        url=request.url, model=request.model, prompt_tokens=prompt_tokens, **kwargs,
    )  # fmt: skip


def cancelled_row(request: ParsedRequest, *, message: str = "the batch was cancelled", **kwargs) -> dict:
    """The row for a valid request that never ran because its job was cancelled."""
    return request_failed_row(request, CANCELLED_CODE, message, status=CANCELLED, **kwargs)


def rows_to_table(rows: Iterable[dict]) -> pa.Table:
    """Rows (dicts with the schema's keys; missing keys are null) as a table sorted by line."""
    table = pa.Table.from_pylist(list(rows), schema=RESULT_SCHEMA)
    return table.sort_by("line") if table.num_rows > 1 else table


# --------------------------------------------------------------------------------------------------
# Files


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    return fs, path.rstrip("/") or "/"


def _is_local(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


@contextlib.contextmanager
def _atomic_open(fs, path: str) -> Iterator:
    """A binary file that appears at `path` only when the block finishes without an error.

    Local: a temporary file in the same directory, fsynced, then os.replace (atomic). Other
    fsspec stores: a temporary object, then moved into place (a single PUT is atomic on object
    stores, and the move never exposes a partial object under the final name).
    """
    parent, name = path.rsplit("/", 1) if "/" in path else (".", path)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
    fs.makedirs(parent, exist_ok=True)
    local = _is_local(fs)
    try:
        if local:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            with contextlib.suppress(OSError):  # make the rename itself durable
                dir_fd = os.open(parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        else:
            with fs.open(tmp, "wb") as f:
                yield f
            fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if local:
                os.unlink(tmp)
            else:
                fs.rm(tmp)
        raise


def _write_atomic(fs, path: str, table: pa.Table) -> None:
    with _atomic_open(fs, path) as f:
        pq.write_table(table, f)


def _as_table(rows: Iterable[dict] | pa.Table) -> pa.Table:
    if isinstance(rows, pa.Table):
        return rows.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)
    return rows_to_table(rows)


def write_results(url: str, rows: Iterable[dict] | pa.Table, *, storage_options: dict | None = None) -> str:
    """Write rows (or a schema table) as one Parquet file at a path or fsspec URL, atomically."""
    fs, path = _fs(url, storage_options)
    _write_atomic(fs, path, _as_table(rows))
    return path


def _batches(fs, paths: list[str], columns: list[str] | None, batch_size: int = 1024) -> Iterator[pa.RecordBatch]:
    for path in paths:
        with fs.open(path, "rb") as f:
            yield from pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=columns)


@dataclass
class ResultCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _count(batches: Iterable[pa.RecordBatch]) -> ResultCounts:
    counts = ResultCounts()
    for batch in batches:
        counts.total += batch.num_rows
        for entry in pc.value_counts(batch.column("status")).to_pylist():
            if entry["values"] in STATUSES:
                setattr(counts, entry["values"], getattr(counts, entry["values"]) + entry["counts"])
        counts.prompt_tokens += pc.sum(batch.column("prompt_tokens")).as_py() or 0
        counts.completion_tokens += pc.sum(batch.column("completion_tokens")).as_py() or 0
    return counts


def count_table(table: pa.Table) -> ResultCounts:
    """Completed/failed/cancelled rows and token usage of a results table."""
    return _count(table.select(["status", "prompt_tokens", "completion_tokens"]).to_batches())


def _line_ids(seed: str, line: int) -> tuple[str, str]:
    """The output line's id and its request id: stable for a job's line, so a regenerated file is identical."""
    digest = hashlib.blake2b(f"{seed}:{line}".encode(), digest_size=32, person=b"pagedbatch-ids").hexdigest()
    return "batch_req_" + digest[:32], "req_" + digest[32:]


_JSONL_COLUMNS = ["custom_id", "line", "status", "error_code", "error_message", "response_body"]


def _output_line(custom_id: str, body_json: str, line_id: str, request_id: str) -> str:
    """`batch_output_line` as text, with the stored response body spliced in rather than parsed and re-encoded."""
    response = {"status_code": 200, "request_id": request_id}
    head = json.dumps({"id": line_id, "custom_id": custom_id, "response": response}, ensure_ascii=False)
    return f'{head[:-2]}, "body": {body_json}}}, "error": null}}\n'


def _jsonl(batches: Iterable[pa.RecordBatch], seed: str, *, errors: bool) -> Iterator[str]:
    for batch in batches:
        completed = pc.equal(batch.column("status"), COMPLETED)
        for row in batch.filter(pc.invert(completed) if errors else completed).to_pylist():
            line_id, request_id = _line_ids(seed, row["line"])
            if not errors:
                yield _output_line(row["custom_id"], row["response_body"], line_id, request_id)
                continue
            # Lines the API rejected look like OpenAI's HTTP 400s; cancelled or engine failures
            # carry no response, only an error.
            status_code = 400 if row["status"] == FAILED and row["error_code"] in REQUEST_ERROR_CODES else None
            obj = batch_error_line(
                row["custom_id"], row["error_code"] or "error", row["error_message"] or "",
                status_code=status_code, line_id=line_id, request_id=request_id,
            )  # fmt: skip
            yield json.dumps(obj, ensure_ascii=False) + "\n"


def iter_output_jsonl(url: str, *, id_seed: str = "", storage_options: dict | None = None) -> Iterator[str]:
    """OpenAI batch output lines (completed rows) of one Parquet results file, streamed.

    Line and request ids are derived from `id_seed` (the job id) and the line number, so they are
    the same every time the file is produced.
    """
    fs, path = _fs(url, storage_options)
    return _jsonl(_batches(fs, [path], _JSONL_COLUMNS), id_seed, errors=False)


def iter_error_jsonl(url: str, *, id_seed: str = "", storage_options: dict | None = None) -> Iterator[str]:
    """OpenAI batch error lines (failed and cancelled rows) of one Parquet results file, streamed."""
    fs, path = _fs(url, storage_options)
    return _jsonl(_batches(fs, [path], _JSONL_COLUMNS), id_seed, errors=True)


def count_results(url: str, *, storage_options: dict | None = None) -> ResultCounts:
    fs, path = _fs(url, storage_options)
    return _count(_batches(fs, [path], ["status", "prompt_tokens", "completion_tokens"], 65536))


# --------------------------------------------------------------------------------------------------
# The store


def _check_id(kind: str, value) -> str:
    value = str(value)
    if not _SAFE_ID.fullmatch(value) or ".." in value:
        raise ValueError(f"{kind} {value!r} is not usable in a path (letters, digits, '.', '_', '-')")
    return value


class ResultsStore:
    """Parquet parts and merged results of jobs under one root (a directory or an fsspec URL)."""

    def __init__(self, url: str, *, storage_options: dict | None = None):
        self.url = str(url)
        self.fs, self.root = _fs(self.url, storage_options)

    # paths
    def job_dir(self, job_id) -> str:
        return f"{self.root}/{_check_id('job id', job_id)}"

    def part_path(self, job_id, shard_id) -> str:
        return f"{self.job_dir(job_id)}/parts/{_check_id('shard id', shard_id)}.parquet"

    def merged_path(self, job_id) -> str:
        return f"{self.job_dir(job_id)}/results.parquet"

    def url_for(self, path: str) -> str:
        """A path of this store as a URL that fsspec and pyarrow open from any process."""
        return path if _is_local(self.fs) else self.fs.unstrip_protocol(path)

    # parts
    def write_part(self, job_id, shard_id, rows: Iterable[dict] | pa.Table) -> str:
        """Write (or overwrite) the shard's part atomically; returns its path."""
        path = self.part_path(job_id, shard_id)
        _write_atomic(self.fs, path, _as_table(rows))
        return path

    def list_parts(self, job_id) -> list[str]:
        parts_dir = f"{self.job_dir(job_id)}/parts"
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(parts_dir)  # see parts other workers wrote
        try:
            entries = self.fs.ls(parts_dir, detail=False)
        except FileNotFoundError:
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in entries)
        return sorted(f"{parts_dir}/{n}" for n in names if n.endswith(".parquet") and not n.startswith("."))

    def read_part(self, path: str) -> pa.Table:
        with self.fs.open(path, "rb") as f:
            return pq.read_table(f, schema=RESULT_SCHEMA)

    def count(self, job_id) -> ResultCounts:
        """Completed/failed/cancelled rows and token usage, from the parts."""
        columns = ["status", "prompt_tokens", "completion_tokens"]
        return _count(_batches(self.fs, self.list_parts(job_id), columns, 65536))

    def _ordered_parts(self, job_id) -> tuple[list[str], bool]:
        """Parts ordered by first line, and whether their line ranges are disjoint."""
        ranges = []
        for path in self.list_parts(job_id):
            with self.fs.open(path, "rb") as f:
                lines = pq.read_table(f, columns=["line"]).column("line")
            if len(lines):
                ranges.append((pc.min(lines).as_py(), pc.max(lines).as_py(), path))
        ranges.sort()
        disjoint = all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))
        return [path for _, _, path in ranges], disjoint

    def merge(self, job_id, dest: str | None = None) -> str:
        """All parts of the job as one Parquet file sorted by line (default `merged_path`).

        Parts with disjoint line ranges (shards are contiguous slices) are streamed part by part;
        overlapping ones are sorted in memory.
        """
        path = dest or self.merged_path(job_id)
        parts, disjoint = self._ordered_parts(job_id)
        if not disjoint:
            table = pa.concat_tables([self.read_part(p) for p in parts]).sort_by("line")
            _write_atomic(self.fs, path, table)
            return path
        with _atomic_open(self.fs, path) as f, pq.ParquetWriter(f, RESULT_SCHEMA) as writer:
            for part in parts:  # one part in memory at a time
                writer.write_table(self.read_part(part))
        return path

    def _job_batches(self, job_id, columns) -> Iterator[pa.RecordBatch]:
        merged = self.merged_path(job_id)
        if self.fs.exists(merged):
            return _batches(self.fs, [merged], columns)
        parts, disjoint = self._ordered_parts(job_id)
        if disjoint:
            return _batches(self.fs, parts, columns)
        table = pa.concat_tables([self.read_part(p).select(columns) for p in parts]).sort_by("line")
        return iter(table.to_batches(max_chunksize=1024))

    def iter_output_jsonl(self, job_id) -> Iterator[str]:
        """OpenAI output lines of the job in line order (from the merged file, else the parts)."""
        return _jsonl(self._job_batches(job_id, _JSONL_COLUMNS), str(job_id), errors=False)

    def iter_error_jsonl(self, job_id) -> Iterator[str]:
        """OpenAI error lines of the job in line order (from the merged file, else the parts)."""
        return _jsonl(self._job_batches(job_id, _JSONL_COLUMNS), str(job_id), errors=True)

    def delete_job(self, job_id) -> int:
        """Remove the job's parts and merged file; returns how many files were removed."""
        job_dir = self.job_dir(job_id)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(job_dir)
        try:
            files = self.fs.find(job_dir)
        except FileNotFoundError:
            return 0
        if files:
            self.fs.rm(job_dir, recursive=True)
        return len(files)

"""The results schema, and the row of each outcome of a request line.

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
cached_tokens      int32                prompt tokens read from the prefix cache (null in old parts)
error_code         string               for failed/cancelled rows (see batchfile.errors)
error_message      string               for failed/cancelled rows
response_body      string               the full OpenAI response body as JSON (every choice)
shard_id           string               the shard that produced the row
created_at         timestamp[us, UTC]   when the request was accepted (job creation)
started_at         timestamp[us, UTC]   when it entered the engine
finished_at        timestamp[us, UTC]   when it finished (or failed)
latency_ms         float64              finished_at - started_at in milliseconds
embedding          list<float32>        /v1/embeddings lines of one input: its vector
embeddings         list<list<float32>>  /v1/embeddings lines of several inputs: one vector per input, in order
scores             list<float64>        /v1/score and /v1/rerank lines: one score per pair / document, in input order
=================  ===================  ========================================================
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime

import pyarrow as pa

from batchfile.endpoints.responses import response_body, returned_output
from batchfile.errors import LineError
from batchfile.request import ParsedRequest
from store.results.no_pandas import skip_pandas_probe

COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
STATUSES = (COMPLETED, FAILED, CANCELLED)
CANCELLED_CODE = "batch_cancelled"
ABORTED_CODE = "request_aborted"
EXPIRED_CODE = "batch_expired"
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."

_TS = pa.timestamp("us", tz="UTC")
RESULT_SCHEMA = pa.schema(
    [
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
        pa.field("cached_tokens", pa.int32()),
        pa.field("error_code", pa.string()),
        pa.field("error_message", pa.string()),
        pa.field("response_body", pa.string()),
        pa.field("shard_id", pa.string()),
        pa.field("created_at", _TS),
        pa.field("started_at", _TS),
        pa.field("finished_at", _TS),
        pa.field("latency_ms", pa.float64()),
        pa.field("embedding", pa.list_(pa.float32())),
        pa.field("embeddings", pa.list_(pa.list_(pa.float32()))),
        pa.field("scores", pa.list_(pa.float64())),
    ]
)


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
    returned = sorted(returned_output(request, output).outputs, key=lambda c: c.index)  # best_of: the best first
    first = returned[0] if returned else None
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
        "cached_tokens": min(getattr(output, "num_cached_tokens", 0) or 0, prompt_tokens),
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
        cached_tokens=0,
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
        request.line,
        request.custom_id,
        code,
        message,
        url=request.url,
        model=request.model,
        prompt_tokens=prompt_tokens,
        **kwargs,
    )


def cancelled_row(request: ParsedRequest, *, message: str = "the batch was cancelled", **kwargs) -> dict:
    """The row for a valid request that never ran (or was aborted) because its job was cancelled."""
    return request_failed_row(request, CANCELLED_CODE, message, status=CANCELLED, **kwargs)


def expired_row(request: ParsedRequest, **kwargs) -> dict:
    """The row for a valid request that did not finish within its job's completion window."""
    return request_failed_row(request, EXPIRED_CODE, EXPIRED_MESSAGE, **kwargs)


def rows_to_table(rows: Iterable[dict] | pa.Table) -> pa.Table:
    """Rows (dicts with the schema's keys; missing keys are null) as a table sorted by line.
    A table is only cast to the schema (its order is kept)."""
    if isinstance(rows, pa.Table):
        return rows.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)
    skip_pandas_probe()
    table = pa.Table.from_pylist(list(rows), schema=RESULT_SCHEMA)
    return table.sort_by("line") if table.num_rows > 1 else table

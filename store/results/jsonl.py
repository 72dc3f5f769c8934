"""OpenAI batch output and error lines from result rows, streamed batch by batch.

A line's id and request id derive from a seed (the job id) and the line number, so a file produced
again is identical.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from batchfile.endpoints.responses import batch_error_line
from batchfile.errors import REQUEST_ERROR_CODES
from store.filestore.storage import url_to_fs
from store.results.parquet import read_batches
from store.results.rows import COMPLETED, FAILED

JSONL_COLUMNS = ["custom_id", "line", "status", "error_code", "error_message", "response_body"]


def _line_ids(seed: str, line: int) -> tuple[str, str]:
    """The output line's id and its request id."""
    digest = hashlib.blake2b(f"{seed}:{line}".encode(), digest_size=32, person=b"pagedbatch-ids").hexdigest()
    return "batch_req_" + digest[:32], "req_" + digest[32:]


# Line separators that JSON leaves raw in strings but `str.splitlines()` splits on; C0 controls
# are escaped by json.dumps already.
_SPLITLINES_ESCAPES = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


_NEEDS_ESCAPES = re.compile("[\u0085\u2028\u2029]")


def _one_line(text: str) -> str:
    return text.translate(_SPLITLINES_ESCAPES) if _NEEDS_ESCAPES.search(text) else text


def _output_line(row: dict, line_id: str, request_id: str) -> str:
    """`batch_output_line` as text, with the stored response body spliced in rather than parsed and re-encoded."""
    response = {"status_code": 200, "request_id": request_id}
    head = json.dumps({"id": line_id, "custom_id": row["custom_id"], "response": response}, ensure_ascii=False)
    return _one_line(f'{head[:-2]}, "body": {row["response_body"]}}}, "error": null}}') + "\n"


def _error_line(row: dict, line_id: str, request_id: str) -> str:
    # Lines the API rejected look like OpenAI's HTTP 400s; cancelled or engine failures carry no
    # response, only an error.
    status_code = 400 if row["status"] == FAILED and row["error_code"] in REQUEST_ERROR_CODES else None
    obj = batch_error_line(
        row["custom_id"],
        row["error_code"] or "error",
        row["error_message"] or "",
        status_code=status_code,
        line_id=line_id,
        request_id=request_id,
    )
    return _one_line(json.dumps(obj, ensure_ascii=False)) + "\n"


def result_line(row: dict, seed: str) -> str:
    """A row as its OpenAI line: an output line when it completed, else an error line."""
    make_line = _output_line if row["status"] == COMPLETED else _error_line
    return make_line(row, *_line_ids(seed, row["line"]))


def jsonl_lines(batches: Iterable[pa.RecordBatch], seed: str, *, errors: bool) -> Iterator[str]:
    """Output lines of the completed rows, or (`errors`) error lines of the others, in row order.
    The batches hold `JSONL_COLUMNS`."""
    for batch in batches:
        completed = pc.equal(batch.column("status"), COMPLETED)
        rows = batch.filter(pc.invert(completed) if errors else completed)
        if errors:
            for row in rows.to_pylist():
                yield _error_line(row, *_line_ids(seed, row["line"]))
        else:
            yield from _output_lines(rows, seed)


def _output_lines(rows: pa.RecordBatch, seed: str) -> Iterator[str]:
    """`_output_line` of each row, column by column (no dict per row: a job's output file is written while its
    submitter waits). The same text: json.dumps of the head with its default separators, the body spliced in."""
    dumps = json.JSONEncoder(ensure_ascii=False).encode
    columns = (rows.column(name).to_pylist() for name in ("custom_id", "line", "response_body"))
    for custom_id, line, body in zip(*columns):
        line_id, request_id = _line_ids(seed, line)
        text = (
            f'{{"id": {dumps(line_id)}, "custom_id": {dumps(custom_id)}, "response": {{"status_code": 200, '
            f'"request_id": {dumps(request_id)}, "body": {body}}}, "error": null}}'
        )
        yield _one_line(text) + "\n"


def iter_output_jsonl(url: str, *, id_seed: str = "", storage_options: dict | None = None) -> Iterator[str]:
    """OpenAI batch output lines (completed rows) of one Parquet results file."""
    fs, path = url_to_fs(url, storage_options)
    return jsonl_lines(read_batches(fs, [path], JSONL_COLUMNS), id_seed, errors=False)


def iter_error_jsonl(url: str, *, id_seed: str = "", storage_options: dict | None = None) -> Iterator[str]:
    """OpenAI batch error lines (failed and cancelled rows) of one Parquet results file."""
    fs, path = url_to_fs(url, storage_options)
    return jsonl_lines(read_batches(fs, [path], JSONL_COLUMNS), id_seed, errors=True)

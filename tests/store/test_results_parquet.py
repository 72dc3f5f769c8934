"""Parquet results: rows, atomic parts, overwrite, merge, counts and OpenAI JSONL, local and memory://."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchfile.endpoints.responses import batch_output_line
from batchfile.errors import INVALID_JSON, LineError
from batchfile.request import CHAT_URL, COMPLETIONS_URL, ParsedRequest
from engine.params.outputs import CompletionOutput, RequestOutput
from engine.params.sampling_params import SamplingParams
from store.results.jsonl import iter_error_jsonl, iter_output_jsonl, result_line
from store.results.parquet import ResultCounts, count_results, write_results
from store.results.parts import ResultsStore
from store.results.rows import (
    ABORTED_CODE,
    CANCELLED_CODE,
    RESULT_SCHEMA,
    cancelled_row,
    completed_row,
    error_row,
    failed_row,
    rows_to_table,
)

T0 = 1_700_000_000.0


def _request(line: int, url: str = CHAT_URL, n: int = 1) -> ParsedRequest:
    return ParsedRequest(
        line=line,
        custom_id=f"req-{line}",
        url=url,
        model="tiny",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(n=n, max_tokens=4),
        body={"model": "tiny"},
    )


def _output(line: int, n: int = 1, finish_reason: str = "stop") -> RequestOutput:
    choices = [
        CompletionOutput(index=i, text=f"answer {line}.{i}", token_ids=[7] * (i + 2), finish_reason=finish_reason)
        for i in range(n)
    ]
    return RequestOutput(request_id=str(line), prompt=None, prompt_token_ids=[1, 2, 3], outputs=choices)


def _completed(line: int, **kwargs) -> dict:
    return completed_row(
        _request(line), _output(line), created_at=T0, started_at=T0 + 1, finished_at=T0 + 1.5, **kwargs
    )


def _rows(lines, shard="s") -> list[dict]:
    rows = []
    for line in lines:
        if line % 5 == 0:
            rows.append(error_row(LineError(line, f"req-{line}", INVALID_JSON, "bad json"), shard_id=shard))
        elif line % 7 == 0:
            rows.append(cancelled_row(_request(line), shard_id=shard))
        else:
            rows.append(_completed(line, shard_id=shard))
    return rows


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        yield ResultsStore(str(tmp_path / "results"))
    else:
        url = f"memory://results-{uuid.uuid4().hex}"
        store = ResultsStore(url)
        yield store
        if store.fs.exists(store.root):
            store.fs.rm(store.root, recursive=True)


def _all_files(store) -> list[str]:
    try:
        return sorted(store.fs.find(store.root))
    except FileNotFoundError:
        return []


def test_rows_follow_the_schema():
    row = _completed(3, shard_id="job.0")
    table = rows_to_table([row, _completed(1)])
    assert table.schema == RESULT_SCHEMA
    assert table.column("line").to_pylist() == [1, 3]
    got = table.to_pylist()[1]
    assert (got["status"], got["output_text"], got["output_token_ids"], got["finish_reason"]) == (
        "completed",
        "answer 3.0",
        [7, 7],
        "stop",
    )
    assert (got["prompt_tokens"], got["completion_tokens"], got["latency_ms"]) == (3, 2, 500.0)
    assert got["started_at"] == datetime.fromtimestamp(T0 + 1, UTC)
    body = json.loads(got["response_body"])
    assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] == 5


def test_n_choices_keep_choice_zero_in_columns_and_all_in_the_body():
    row = completed_row(_request(1, n=3), _output(1, n=3))
    assert row["output_text"] == "answer 1.0" and row["completion_tokens"] == 2 + 3 + 4
    body = json.loads(row["response_body"])
    assert [c["message"]["content"] for c in body["choices"]] == ["answer 1.0", "answer 1.1", "answer 1.2"]


def test_aborted_output_is_a_cancelled_row():
    row = completed_row(_request(1), _output(1, finish_reason="abort"))
    assert (row["status"], row["error_code"], row["response_body"]) == ("cancelled", ABORTED_CODE, None)
    with pytest.raises(ValueError):
        failed_row(1, "x", "c", "m", status="completed")


def test_write_part_overwrites_and_leaves_no_temp_files(store):
    first = store.write_part("job1", "job1.0", _rows(range(1, 11)))
    assert store.list_parts("job1") == [first]
    second = store.write_part("job1", "job1.0", _rows(range(1, 4)))  # a redelivered shard
    assert second == first and store.list_parts("job1") == [first]
    assert store.read_part(first).num_rows == 3
    assert all(not f.rsplit("/", 1)[-1].startswith(".") for f in _all_files(store))
    assert store.list_parts("nope") == []


def test_failed_write_keeps_the_old_part(store, monkeypatch):
    path = store.write_part("job1", "s0", _rows([1, 2]))

    def broken(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError, match="disk full"):
        store.write_part("job1", "s0", _rows([1, 2, 3]))
    monkeypatch.undo()
    assert store.read_part(path).num_rows == 2
    assert _all_files(store) == [path]


def test_merge_counts_and_jsonl(store):
    # shards written out of order; each part sorted by line
    store.write_part("job1", "job1.2", _rows(range(21, 31), "job1.2"))
    store.write_part("job1", "job1.0", _rows(range(1, 11), "job1.0"))
    store.write_part("job1", "job1.1", list(reversed(_rows(range(11, 21), "job1.1"))))
    counts = store.count("job1")
    lines = range(1, 31)
    failed = [i for i in lines if i % 5 == 0]
    cancelled = [i for i in lines if i % 5 and i % 7 == 0]
    completed = [i for i in lines if i not in failed and i not in cancelled]
    assert counts == ResultCounts(
        total=30,
        completed=len(completed),
        failed=len(failed),
        cancelled=len(cancelled),
        prompt_tokens=3 * len(completed),
        completion_tokens=2 * len(completed),  # usage: completed requests only
    )

    # JSONL straight from the parts, then from the merged file: same lines, same ids, line order
    from_parts = list(store.iter_output_jsonl("job1")), list(store.iter_error_jsonl("job1"))
    merged = store.merge("job1")
    assert merged == store.merged_path("job1")
    table = pq.read_table(store.fs.open(merged, "rb"))
    assert table.schema == RESULT_SCHEMA and table.column("line").to_pylist() == list(lines)
    out, err = list(store.iter_output_jsonl("job1")), list(store.iter_error_jsonl("job1"))
    assert (out, err) == from_parts
    assert count_results(store.url_for(merged)) == counts

    assert all(s.endswith("\n") for s in out + err)
    outputs = [json.loads(s) for s in out]
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in completed]
    first = outputs[0]
    assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
    assert first["id"].startswith("batch_req_") and first["response"]["request_id"].startswith("req_")
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "answer 1.0"

    errors = {e["custom_id"]: e for e in map(json.loads, err)}
    assert list(errors) == [f"req-{i}" for i in lines if i in failed or i in cancelled]
    bad = errors["req-5"]
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["code"] == INVALID_JSON
    gone = errors["req-7"]
    assert gone["response"] is None and gone["error"] == {
        "code": CANCELLED_CODE,
        "message": "the batch was cancelled",
    }

    assert list(store.iter_output_jsonl("job1")) == out  # ids are stable
    assert json.loads(next(iter_output_jsonl(store.url_for(merged), id_seed="other")))["id"] != first["id"]


def test_output_lines_are_the_openai_objects_with_the_stored_body(tmp_path):
    """Output lines are written by splicing the stored body into the line; they must parse to exactly
    what `batch_output_line` builds, whatever the custom_id and the text hold."""
    custom_ids = ["plain", 'quo"te \\ back', "ünï \u2028 line\nbreak", "{}", "nel \u0085 ps \u2029 end", None]
    rows = []
    for line, custom_id in enumerate(custom_ids, start=1):
        request = ParsedRequest(
            line=line,
            custom_id=custom_id,
            url=COMPLETIONS_URL,
            model="tiny",
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(max_tokens=4),
            body={"model": "tiny"},
        )
        output = RequestOutput(
            request_id=str(line),
            prompt=None,
            prompt_token_ids=[1, 2],
            outputs=[CompletionOutput(index=0, text=f'"{custom_id}"\n', token_ids=[5, 6], finish_reason="length")],
        )
        rows.append(completed_row(request, output, created_at=T0, started_at=T0, finished_at=T0))
    path = write_results(str(tmp_path / "r.parquet"), rows)
    lines = list(iter_output_jsonl(path, id_seed="job9"))
    assert len(lines) == len(custom_ids) and all(s.endswith("\n") and s.count("\n") == 1 for s in lines)
    assert all(len(s.splitlines()) == 1 for s in lines)  # U+0085/U+2028/U+2029 escaped, not raw
    for row, text in zip(rows, lines):
        parsed = json.loads(text)
        expected = batch_output_line(
            row["custom_id"],
            json.loads(row["response_body"]),
            line_id=parsed["id"],
            request_id=parsed["response"]["request_id"],
        )
        assert parsed == expected
    assert lines == [result_line(row, "job9") for row in rows]  # the live results' lines, byte for byte
    ids = [json.loads(t)["id"] for t in lines] + [json.loads(t)["response"]["request_id"] for t in lines]
    assert len(set(ids)) == len(ids)  # distinct per line and between line and request ids


def test_merge_of_overlapping_parts_sorts_them(store):
    store.write_part("job2", "a", _rows([1, 3, 5]))
    store.write_part("job2", "b", _rows([2, 4, 6]))
    merged = store.merge("job2")
    with store.fs.open(merged, "rb") as f:
        assert pq.read_table(f).column("line").to_pylist() == [1, 2, 3, 4, 5, 6]
    assert [json.loads(s)["custom_id"] for s in store.iter_output_jsonl("job2")] == [
        f"req-{i}" for i in (1, 2, 3, 4, 6)
    ]


def test_large_merge_streams_in_line_order(store):
    for shard in range(3):
        store.write_part(
            "big", f"big.{shard}", [_completed(line) for line in range(shard * 1500 + 1, shard * 1500 + 1501)]
        )
    merged = store.merge("big")
    with store.fs.open(merged, "rb") as f:
        parquet = pq.ParquetFile(f)
        assert parquet.metadata.num_rows == 4500 and parquet.metadata.num_row_groups >= 3
    ids = [json.loads(s)["custom_id"] for s in store.iter_output_jsonl("big")]
    assert ids == [f"req-{i}" for i in range(1, 4501)]


def test_delete_job(store):
    store.write_part("job3", "x", _rows([1]))
    store.write_part("job3", "y", _rows([2]))
    store.merge("job3")
    store.write_part("other", "x", _rows([1]))
    assert store.delete_job("job3") == 3
    assert store.list_parts("job3") == [] and store.count("job3") == ResultCounts()
    assert store.delete_job("job3") == 0
    assert len(store.list_parts("other")) == 1


def test_ids_must_be_path_safe(store):
    for bad in ["../x", "a/b", "", ".hidden", "a..b"]:
        with pytest.raises(ValueError):
            store.part_path(bad, "s")
        with pytest.raises(ValueError):
            store.part_path("job", bad)
    assert store.part_path("batch_abc-DEF", "batch_abc-DEF.12").endswith(
        "/batch_abc-DEF/parts/batch_abc-DEF.12.parquet"
    )


def test_write_results_single_file(tmp_path):
    url = f"memory://single-{uuid.uuid4().hex}/out.parquet"
    rows = _rows(range(1, 6))
    write_results(url, rows)
    assert count_results(url).total == 5
    path = write_results(str(tmp_path / "sub" / "out.parquet"), pa.Table.from_pylist(rows, schema=RESULT_SCHEMA))
    assert pq.read_table(path).num_rows == 5
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["out.parquet"]


def test_error_lines_escape_what_splitlines_splits_on(tmp_path):
    custom_id = "a\u2028b\u0085c\u2029d"
    rows = [error_row(LineError(1, custom_id, INVALID_JSON, "bad \u2028 json"), shard_id="s")]
    path = write_results(str(tmp_path / "r.parquet"), rows)
    [text] = list(iter_error_jsonl(path, id_seed="job"))
    assert len(text.splitlines()) == 1 and "\u2028" not in text and "\u0085" not in text
    parsed = json.loads(text)
    assert parsed["custom_id"] == custom_id
    assert parsed["response"]["body"]["error"]["message"] == "bad \u2028 json"


def test_cached_tokens_capped_summed_for_completed_and_old_parts_still_read(store):
    hit = _output(1)
    hit.num_cached_tokens = 2
    over = _output(2)
    over.num_cached_tokens = 99  # more than the prompt's 3 tokens: capped
    rows = [completed_row(_request(1), hit), completed_row(_request(2), over), cancelled_row(_request(3))]
    assert [r["cached_tokens"] for r in rows] == [2, 3, 0]
    store.write_part("job1", "job1.0", rows)
    # a part written before the column existed
    old = rows_to_table([completed_row(_request(4), _output(4))]).drop_columns(["cached_tokens"])
    store.fs.makedirs(store.job_dir("job1") + "/parts", exist_ok=True)
    with store.fs.open(store.part_path("job1", "job1.1"), "wb") as f:
        pq.write_table(old, f)
    counts = store.count("job1")
    assert (counts.completed, counts.cancelled, counts.prompt_tokens, counts.cached_tokens) == (3, 1, 9, 5)
    merged = pq.read_table(store.fs.open(store.merge("job1"), "rb"))
    assert merged.column("cached_tokens").to_pylist() == [2, 3, 0, None]
    assert len(list(store.iter_output_jsonl("job1"))) == 3

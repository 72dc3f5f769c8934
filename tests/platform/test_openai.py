"""End to end with the official openai client against a live server, a real worker and real services."""

import io
import json

import pytest

from tests.helpers import chat_line, completion_line, jsonl, wait_for

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def oai(live_url, worker):
    return openai.OpenAI(base_url=live_url + "/v1", api_key=worker.api_key, max_retries=0)


def _offline(platform, lines, tmp_path):
    """The same lines through the offline path: custom_id -> generated text."""
    import pyarrow.parquet as pq

    from workers.offline import run_offline

    src, out = tmp_path / "offline.jsonl", tmp_path / "offline.parquet"
    src.write_bytes(jsonl(lines))
    run_offline(str(src), str(out), platform.model_path, progress=False)
    table = pq.read_table(out).to_pylist()
    return {row["custom_id"]: row for row in table}


def test_chat_batch_roundtrip_matches_offline(oai, platform, tmp_path):
    lines = [chat_line(f"req-{i}", f"Tell me about number {i}", max_tokens=6) for i in range(30)]
    lines.append(chat_line("bad-1", "x", temperature="hot"))
    uploaded = oai.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch" and uploaded.bytes > 0
    assert oai.files.retrieve(uploaded.id).id == uploaded.id
    assert oai.files.content(uploaded.id).read() == jsonl(lines)

    batch = oai.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"purpose": "test"},
        extra_body={"on_invalid_lines": "skip"},  # OpenAI would fail the file for bad-1
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"purpose": "test"}
    batch = wait_for(lambda: oai.batches.retrieve(batch.id).model_dump(), timeout=180)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 31, "completed": 30, "failed": 1}
    assert batch["completed_at"] >= batch["in_progress_at"] >= batch["created_at"]
    assert batch["usage"]["output_tokens"] > 0

    output = [json.loads(x) for x in oai.files.content(batch["output_file_id"]).read().splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(30))
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert body["usage"]["completion_tokens"] <= 6
    errors = [json.loads(x) for x in oai.files.content(batch["error_file_id"]).read().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad-1"]

    offline = _offline(platform, lines[:30], tmp_path)
    for o in output:
        text = o["response"]["body"]["choices"][0]["message"]["content"]
        expected = offline[o["custom_id"]]
        assert expected["status"] == "completed" and text == expected["output_text"], o["custom_id"]


def test_completions_batch_and_listing(oai):
    lines = [completion_line(f"c-{i}", f"The number {i} is", max_tokens=5) for i in range(12)]
    uploaded = oai.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(lambda: oai.batches.retrieve(batch.id).model_dump(), timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 12
    output = [json.loads(x) for x in oai.files.content(done["output_file_id"]).read().splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"c-{i}" for i in range(12))
    assert all(o["response"]["body"]["object"] == "text_completion" for o in output)
    assert all("text" in o["response"]["body"]["choices"][0] for o in output)

    listed = [b.id for b in oai.batches.list(limit=1)]  # auto-pagination walks every page with `after`
    assert batch.id in listed and len(listed) == len(set(listed))
    page = oai.batches.list(limit=1)
    assert len(page.data) == 1 and page.has_more
    files = [f.id for f in oai.files.list(purpose="batch")]
    assert uploaded.id in files and done["output_file_id"] not in files


def test_batch_validation_errors(oai):
    uploaded = oai.files.create(file=("bad.jsonl", io.BytesIO(b"nope\n{}\n")), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"  # answered at once; validation runs in the background
    batch = oai.batches.retrieve(wait_for(lambda: oai.batches.retrieve(batch.id).model_dump())["id"])
    assert batch.status == "failed" and batch.failed_at
    assert [e.line for e in batch.errors.data] == [1, 2]
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError):
        oai.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    # lines whose url is not the batch's endpoint are errors
    wrong = jsonl([completion_line("x", "y")])
    uploaded = oai.files.create(file=("w.jsonl", io.BytesIO(wrong)), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = oai.batches.retrieve(wait_for(lambda: oai.batches.retrieve(batch.id).model_dump())["id"])
    assert batch.status == "failed" and batch.errors.data[0].code == "invalid_url"

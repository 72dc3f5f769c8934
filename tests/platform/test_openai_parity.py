"""Acceptance: the official openai client drives every Batch and Files call against a live server and a
real worker, and every object it gets back, and every output and error line, validates against the
client's own pydantic types (no missing field, no field OpenAI does not have), for completed, failed,
cancelled and expired batches; the request counts agree with the files, one line per custom_id."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pydantic
import pytest
from sqlalchemy import update

from store.db import session_scope
from store.lifecycle.cancel import expire_job
from store.models import Job, utcnow
from tests.helpers import chat_line, completion_line, jsonl, long_line, wait_for

openai = pytest.importorskip("openai")
from openai import types as oat  # noqa: E402
from openai.types import chat as chat_types  # noqa: E402

pytestmark = pytest.mark.slow  # a few batches through the real worker (~40 s)


@pytest.fixture(scope="module")
def oai(live_url, worker):
    return openai.OpenAI(base_url=live_url + "/v1", api_key=worker.api_key, max_retries=0)


def strict(model_type, data):
    """`model_type.model_validate(data)`, and no field anywhere that the type does not declare."""
    model = model_type.model_validate(data)
    _no_extra(model, model_type.__name__)
    return model


def _no_extra(value, where: str) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            _no_extra(item, f"{where}[{i}]")
    elif isinstance(value, pydantic.BaseModel):
        assert not (value.model_extra or {}), f"{where} has fields OpenAI does not: {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            _no_extra(getattr(value, name), f"{where}.{name}")


def _raw(call, *args, **kwargs):
    """The JSON body of a call through the client's raw response, checking its x-request-id."""
    response = call(*args, **kwargs)
    assert response.headers.get("x-request-id", "").startswith("req_")
    return json.loads(response.http_response.content)


def _retrieve(oai, batch_id: str) -> dict:
    body = json.loads(oai.batches.with_raw_response.retrieve(batch_id).http_response.content)
    strict(oat.Batch, body)
    return body


def _lines(oai, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    strict(oat.FileObject, json.loads(oai.files.with_raw_response.retrieve(file_id).http_response.content))
    return [json.loads(x) for x in oai.files.content(file_id).read().splitlines()]


def _check_output_line(line: dict, endpoint: str) -> None:
    assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body_type = chat_types.ChatCompletion if endpoint == "/v1/chat/completions" else oat.Completion
    body = strict(body_type, response["body"])
    assert body.system_fingerprint and body.usage.prompt_tokens_details.cached_tokens >= 0
    if endpoint == "/v1/chat/completions":
        assert all(c.message.refusal is None for c in body.choices)


def _check_error_line(line: dict) -> None:
    assert set(line) == {"id", "custom_id", "response", "error"}
    if line["response"] is None:  # cancelled, expired, failed running
        strict(oat.BatchError, line["error"])
        assert line["error"]["code"] and line["error"]["message"]
    else:  # rejected at validation, as OpenAI answers a bad request
        assert line["error"] is None and line["response"]["status_code"] == 400
        strict(oat.ErrorObject, line["response"]["body"]["error"])


def _consistent(oai, batch: dict, custom_ids: list[str], endpoint: str) -> tuple[list[dict], list[dict]]:
    """The batch's files agree with its counts; each custom_id has exactly one line in them."""
    output, errors = _lines(oai, batch["output_file_id"]), _lines(oai, batch["error_file_id"])
    for line in output:
        _check_output_line(line, endpoint)
    for line in errors:
        _check_error_line(line)
    counts = batch["request_counts"]
    assert counts["completed"] == len(output) and counts["failed"] == len(errors), (counts, len(output), len(errors))
    named = [line["custom_id"] for line in output + errors if line["custom_id"] is not None]
    assert len(named) == len(set(named))  # never two lines for one custom_id
    if batch["status"] != "failed":
        assert sorted(named) == sorted(custom_ids) and counts["total"] == len(custom_ids)
    usage = sum(line["response"]["body"]["usage"]["total_tokens"] for line in output)
    assert batch["usage"]["total_tokens"] == usage  # only completed requests are counted
    return output, errors


def test_every_batch_and_files_call_of_the_official_client(oai, worker):
    # files: create, retrieve, list (auto-paging), content, delete
    chat = [chat_line(f"chat-{i}", f"Question {i}?", max_tokens=5) for i in range(10)]
    completions = [completion_line(f"cmp-{i}", f"Count {i}", max_tokens=4, logprobs=2) for i in range(4)]
    created = [
        oai.files.create(file=(f"in{i}.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        for i, lines in enumerate((chat, completions))
    ]
    raw = _raw(oai.files.with_raw_response.create, file=("x.jsonl", io.BytesIO(jsonl(chat[:1]))), purpose="batch")
    doomed = strict(oat.FileObject, raw)
    for file in created:
        strict(oat.FileObject, _raw(oai.files.with_raw_response.retrieve, file.id))
    listed = [f.id for f in oai.files.list(limit=2, purpose="batch")]  # three pages and more
    assert {doomed.id, *(f.id for f in created)} <= set(listed) and len(listed) == len(set(listed))
    assert oai.files.content(created[0].id).read() == jsonl(chat)
    strict(oat.FileDeleted, _raw(oai.files.with_raw_response.delete, doomed.id))
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(doomed.id)

    # a completed chat batch and a completed completions batch (with logprobs)
    batches = {}
    for file, endpoint in zip(created, ("/v1/chat/completions", "/v1/completions")):
        raw = _raw(
            oai.batches.with_raw_response.create,
            input_file_id=file.id,
            endpoint=endpoint,
            completion_window="24h",
            metadata={},
        )
        batch = strict(oat.Batch, raw)
        assert batch.status == "validating" and batch.metadata == {}
        batches[endpoint] = batch.id
    for endpoint, lines in (("/v1/chat/completions", chat), ("/v1/completions", completions)):
        done = wait_for(lambda b=batches[endpoint]: _retrieve(oai, b), timeout=180)
        assert done["status"] == "completed" and done["model"] == "tiny", done
        assert done["finalizing_at"] and done["completed_at"] >= done["in_progress_at"]
        output, errors = _consistent(oai, done, [x["custom_id"] for x in lines], endpoint)
        assert errors == [] and done["error_file_id"] is None

    # a failed batch: OpenAI fails a file with a bad line (a repeated custom_id is one)
    bad = chat[:2] + [chat_line("chat-0", "again"), chat_line("hot", "x", temperature=9)]
    file = oai.files.create(file=("bad.jsonl", io.BytesIO(jsonl(bad))), purpose="batch")
    batch = oai.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for(lambda: _retrieve(oai, batch.id))
    assert failed["status"] == "failed" and failed["failed_at"] and failed["output_file_id"] is None
    assert [(e["line"], e["code"], e["param"]) for e in failed["errors"]["data"]] == [
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_parameter", "temperature"),
    ]
    _consistent(oai, failed, [], "/v1/chat/completions")

    # a cancelled batch
    slow = [long_line(f"slow-{i}", max_tokens=200) for i in range(12)]
    file = oai.files.create(file=("slow.jsonl", io.BytesIO(jsonl(slow))), purpose="batch")
    batch = oai.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = strict(oat.Batch, _raw(oai.batches.with_raw_response.cancel, batch.id))
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for(lambda: _retrieve(oai, batch.id))
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] and cancelled["finalizing_at"] is None
    _, errors = _consistent(oai, cancelled, [x["custom_id"] for x in slow], "/v1/chat/completions")
    assert {e["error"]["code"] for e in errors} <= {"batch_cancelled", "request_aborted"} and errors

    # an expired batch (the sweeper expires it once its window passed; here at once)
    late = [long_line(f"late-{i}", max_tokens=900) for i in range(12)]  # still running when it expires
    file = oai.files.create(file=("late.jsonl", io.BytesIO(jsonl(late))), purpose="batch")
    batch = oai.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: _retrieve(oai, batch.id), statuses=("in_progress",))
    with session_scope(worker.settings.database_url) as s:
        s.execute(update(Job).where(Job.id == batch.id).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert expire_job(worker.settings, batch.id)
    expired = wait_for(lambda: _retrieve(oai, batch.id))
    assert expired["status"] == "expired" and expired["expired_at"]
    _, errors = _consistent(oai, expired, [x["custom_id"] for x in late], "/v1/chat/completions")
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}

    # batches: retrieve every one, list them all (auto-paging)
    listed = list(oai.batches.list(limit=2))
    ids = {*batches.values(), failed["id"], cancelled["id"], expired["id"]}
    assert ids <= {b.id for b in listed}
    for page in oai.batches.list(limit=3).iter_pages():
        body = page.model_dump()
        for item in body["data"]:
            strict(oat.Batch, item)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    assert missing.value.body["param"] == "input_file_id"

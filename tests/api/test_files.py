"""/v1/files: delete (with the official client), the per-tenant file quota and the job limit checked
before an upload is stored, and listing (order, limit, purpose, after)."""

import io
import json
from pathlib import Path

import pytest

from tests.helpers import chat_line, jsonl, validated

openai = pytest.importorskip("openai")


def _upload(client, body: bytes, name: str = "in.jsonl"):
    data = {"file": (io.BytesIO(body), name), "purpose": "batch"}
    return client.post("/v1/files", data=data, content_type="multipart/form-data")


def _stored_files(platform) -> set[str]:
    root = Path(platform.settings.storage_url) / "files"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def test_official_client_deletes_a_file_and_frees_its_storage(platform, live_url):
    client = openai.OpenAI(base_url=live_url + "/v1", api_key=platform.api_key, max_retries=0)
    created = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    stored = Path(platform.settings.storage_url) / "files" / f"{created.id}.jsonl"
    assert stored.exists()

    deleted = client.files.delete(created.id)
    assert isinstance(deleted, openai.types.FileDeleted)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    assert not stored.exists()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(created.id)
    assert created.id not in {f.id for f in client.files.list()}


def test_deleting_the_input_of_an_unfinished_batch_is_refused(client):
    file_id = _upload(client, jsonl([chat_line("a", "hi")])).get_json()["id"]
    created = client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert created.get_json()["status"] == "validating"
    r = client.delete(f"/v1/files/{file_id}")
    assert r.status_code == 409  # validating reads it
    batch = validated(client, created)
    assert batch["status"] == "in_progress"  # no worker serves this session's queue
    r = client.delete(f"/v1/files/{file_id}")
    assert r.status_code == 409 and r.get_json()["error"]["param"] == "file_id"
    assert client.get(f"/v1/files/{file_id}/content").status_code == 200  # nothing was lost

    client.post(f"/v1/batches/{batch['id']}/cancel")
    assert client.delete(f"/v1/files/{file_id}").get_json()["deleted"] is True


def test_file_count_quota_is_checked_before_storing(platform):
    client = platform.app(default_tenant="quota-count", max_files_per_tenant=2).test_client()
    ids = [_upload(client, jsonl([chat_line("a", "hi")])).get_json()["id"] for _ in range(2)]
    before = _stored_files(platform)
    r = _upload(client, jsonl([chat_line("a", "hi")]))
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["code"] == "file_quota_exceeded"
    assert _stored_files(platform) == before  # nothing written
    client.delete(f"/v1/files/{ids[0]}")
    assert _upload(client, jsonl([chat_line("a", "hi")])).status_code == 200


def test_file_bytes_quota_bounds_what_is_stored(platform):
    line = json.dumps(chat_line("a", "x" * 100)).encode() + b"\n"
    client = platform.app(default_tenant="quota-bytes", max_file_bytes_per_tenant=4 * len(line)).test_client()
    assert _upload(client, line * 3).status_code == 200
    before = _stored_files(platform)
    r = _upload(client, line * 2)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "file_quota_exceeded"
    assert _stored_files(platform) == before


def test_job_limit_is_checked_before_the_upload_is_stored(platform):
    client = platform.app(default_tenant="job-limit", max_active_jobs_per_tenant=1).test_client()
    body = jsonl([chat_line("a", "hi")])
    first = client.post("/v1/jobs?model=tiny", data=body, content_type="application/x-ndjson")
    assert first.status_code == 201, first.get_json()
    before = _stored_files(platform)
    for _ in range(5):
        r = client.post("/v1/jobs?model=tiny", data=body, content_type="application/x-ndjson")
        assert r.status_code == 429 and r.headers["Retry-After"]
    assert _stored_files(platform) == before
    listed = client.get("/v1/files").get_json()["data"]
    assert len(listed) == 1


def test_list_files_order_limit_purpose_after(platform):
    client = platform.app(default_tenant="lister").test_client()
    ids = [_upload(client, jsonl([chat_line("a", str(i))])).get_json()["id"] for i in range(4)]
    newest_first = [f["id"] for f in client.get("/v1/files").get_json()["data"]]
    assert newest_first == ids[::-1]
    assert [f["id"] for f in client.get("/v1/files?order=asc").get_json()["data"]] == ids
    page = client.get("/v1/files?order=asc&limit=2").get_json()
    assert [f["id"] for f in page["data"]] == ids[:2] and page["has_more"] is True
    rest = client.get(f"/v1/files?order=asc&limit=2&after={page['last_id']}").get_json()
    assert [f["id"] for f in rest["data"]] == ids[2:] and rest["has_more"] is False
    assert client.get("/v1/files?purpose=batch_output").get_json()["data"] == []
    assert len(client.get("/v1/files?purpose=batch").get_json()["data"]) == 4
    r = client.get("/v1/files?order=bogus")
    assert r.status_code == 400
    assert r.get_json()["error"]["param"] == "order" and r.get_json()["error"]["type"] == "invalid_request_error"


def test_list_files_default_limit_is_openais(platform):
    from api.spec.openapi import openapi_document

    (limit,) = [p for p in openapi_document()["paths"]["/v1/files"]["get"]["parameters"] if p["name"] == "limit"]
    assert limit["schema"]["default"] == 10_000
    client = platform.app(default_tenant="many-files").test_client()
    for i in range(105):
        _upload(client, jsonl([chat_line("a", str(i))]))
    listed = client.get("/v1/files").get_json()
    assert len(listed["data"]) == 105 and listed["has_more"] is False


def test_expires_after_is_stored_returned_and_honoured(platform, live_url):
    from datetime import timedelta

    from store.db import session_scope
    from store.models import File, utcnow

    client = openai.OpenAI(base_url=live_url + "/v1", api_key=platform.api_key, max_retries=0)
    created = client.files.create(
        file=("in.jsonl", jsonl([chat_line("a", "hi")])),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert created.expires_at == created.created_at + 3600
    assert client.files.retrieve(created.id).expires_at == created.expires_at
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(
            file=("in.jsonl", b"{}\n"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
        )
    assert bad.value.body["param"] == "expires_after.seconds"

    with session_scope(platform.settings.database_url) as s:  # an hour later
        s.get(File, created.id).expires_at = utcnow() - timedelta(seconds=1)
    stored = Path(platform.settings.storage_url) / "files" / f"{created.id}.jsonl"
    assert created.id not in {f.id for f in client.files.list()}
    client.files.create(file=("next.jsonl", jsonl([chat_line("b", "hi")])), purpose="batch")
    assert not stored.exists()  # the tenant's next upload purged it
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_batch_output_expires_after_sets_the_output_files_expiry(worker, live_url):
    from tests.helpers import wait_for

    client = openai.OpenAI(base_url=live_url + "/v1", api_key=worker.api_key, max_retries=0)
    lines = [chat_line("ok", "hi"), chat_line("bad", "hi", temperature=9)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 10},
        )
    assert bad.value.body["param"] == "output_expires_after.seconds"
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
        extra_body={"on_invalid_lines": "skip"},  # run "ok", report "bad"
    )
    done = wait_for(lambda: client.batches.retrieve(batch.id).model_dump())
    assert done["status"] == "completed"
    for file_id in (done["output_file_id"], done["error_file_id"]):
        produced = client.files.retrieve(file_id)
        assert produced.expires_at == produced.created_at + 7200
    assert client.files.retrieve(file.id).expires_at is None  # the input keeps its own policy

"""OpenAI's Uploads API: the official client's chunked upload of a ~200 MB file with a part resent after a
broken request, then a batch on the file; and the rules: limits, part order, md5, cancel and expiry."""

import hashlib
import io
import json
import socket
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import select, update

from store.db import session_scope
from store.filestore.uploads import expire_uploads
from store.models import Upload, UploadPart, utcnow
from tests.helpers import chat_line, jsonl, wait_for
from tests.rss import PeakRSS

openai = pytest.importorskip("openai")
from openai.types.uploads import UploadPart as UploadPartType  # noqa: E402

MIME = "application/jsonl"


def _create(client, size: int, **body):
    fields = {"purpose": "batch", "filename": "big.jsonl", "bytes": size, "mime_type": MIME, **body}
    return client.post("/v1/uploads", json=fields)


def _part(client, upload_id: str, data: bytes):
    return client.post(f"/v1/uploads/{upload_id}/parts", data={"data": (io.BytesIO(data), "blob")},
                       content_type="multipart/form-data")  # fmt: skip


def _complete(client, upload_id: str, part_ids, **body):
    return client.post(f"/v1/uploads/{upload_id}/complete", json={"part_ids": part_ids, **body})


def _stored_parts(platform, upload_id: str) -> set[str]:
    root = Path(platform.settings.storage_url) / "uploads" / upload_id
    return {p.name for p in root.iterdir()} if root.exists() else set()


def _padded_lines(path: Path, count: int, line_bytes: int) -> tuple[int, str, list[str]]:
    """`count` chat lines, each padded inside its JSON object with whitespace to `line_bytes`: a file of
    count x line_bytes bytes whose validation is cheap. Returns (bytes, md5, custom ids)."""
    digest, ids = hashlib.md5(), []
    with path.open("wb") as f:
        for i in range(count):
            ids.append(f"big-{i}")
            text = json.dumps(chat_line(ids[-1], f"number {i}", max_tokens=3))
            line = (text[:-1] + " " * (line_bytes - len(text) - 1) + "}\n").encode()
            digest.update(line)
            f.write(line)
    return path.stat().st_size, digest.hexdigest(), ids


def _send_broken_part(base_url: str, upload_id: str, data: bytes) -> None:
    """A part request that breaks off halfway through its body (the client's connection dropped)."""
    url = urlsplit(base_url)
    head = (b'--b0undary\r\nContent-Disposition: form-data; name="data"; filename="blob"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")  # fmt: skip
    body_length = len(head) + len(data) + len(b"\r\n--b0undary--\r\n")
    request = (f"POST /v1/uploads/{upload_id}/parts HTTP/1.1\r\nHost: {url.netloc}\r\n"
               f"Authorization: Bearer {_KEY[0]}\r\nContent-Type: multipart/form-data; boundary=b0undary\r\n"
               f"Content-Length: {body_length}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(request + head + data[: len(data) // 2])


_KEY: list[str] = []


@pytest.mark.slow
def test_official_client_uploads_200mb_in_parts_resends_a_broken_part_and_runs_a_batch(
    platform, live_url, worker, tmp_path
):
    _KEY[:] = [platform.api_key]
    client = openai.OpenAI(base_url=live_url + "/v1", api_key=platform.api_key, max_retries=0)
    path = tmp_path / "big.jsonl"
    size, md5, ids = _padded_lines(path, count=40, line_bytes=5_000_000)
    assert size == 200_000_000
    parts_create, calls = client.uploads.parts.create, []

    def flaky_parts_create(*, upload_id, data, **kwargs):
        calls.append(len(data))
        if len(calls) == 3:  # the third part's first request breaks off: the helper sends it again
            _send_broken_part(live_url, upload_id, data)
        return parts_create(upload_id=upload_id, data=data, **kwargs)

    complete, recorded = client.uploads.complete, []

    def counting_complete(*, upload_id, part_ids, **kwargs):
        with session_scope(platform.settings.database_url) as s:
            recorded.extend(s.scalars(select(UploadPart.id).where(UploadPart.upload_id == upload_id)))
        return complete(upload_id=upload_id, part_ids=part_ids, **kwargs)

    client.uploads.parts.create, client.uploads.complete = flaky_parts_create, counting_complete
    with PeakRSS() as rss:
        upload = client.uploads.upload_file_chunked(
            file=path, mime_type=MIME, purpose="batch", part_size=16 * 1024 * 1024, md5=md5
        )
    assert isinstance(upload, openai.types.Upload)
    raw = client.get(f"/files/{upload.file.id}", cast_to=object)
    assert set(upload.model_dump()) == set(openai.types.Upload.model_fields)
    assert (upload.status, upload.bytes, upload.file.bytes, raw["bytes"]) == ("completed", size, size, size)
    assert len(calls) == -(-size // (16 * 1024 * 1024)) == 12
    assert len(recorded) == 12  # the broken request left no part: only the one sent again counts
    # memory: parts are spooled to disk and streamed to storage; the client holds one 16 MiB part at a time
    assert rss.growth < 120 * 1024 * 1024, f"RSS grew by {rss.growth / 2**20:.0f} MiB for a 200 MB upload"
    assert _stored_parts(platform, upload.id) == set()  # joined into the file, then deleted
    stored = Path(platform.settings.storage_url) / "files" / f"{upload.file.id}.jsonl"
    with stored.open("rb") as f:
        assert hashlib.file_digest(f, "md5").hexdigest() == md5

    batch = client.batches.create(input_file_id=upload.file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    done = wait_for(lambda: client.batches.retrieve(batch.id).model_dump(), timeout=600)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    output = [json.loads(x) for x in client.files.content(done["output_file_id"]).read().splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(ids)
    print(f"200 MB chunked upload: peak RSS growth {rss.growth / 2**20:.0f} MiB")


def test_parts_join_in_the_order_complete_names_and_md5_is_checked(client, platform):
    a, b = jsonl([chat_line("a", "first")]), jsonl([chat_line("b", "second")])
    upload = _create(client, len(a) + len(b)).get_json()
    assert set(upload) == set(openai.types.Upload.model_fields)
    assert upload["status"] == "pending" and upload["file"] is None and upload["object"] == "upload"
    assert upload["expires_at"] - upload["created_at"] == platform.settings.upload_expires_s
    assert upload["id"] in {u["id"] for u in client.get("/v1/uploads").get_json()["data"]}
    part_a, part_b = (_part(client, upload["id"], x).get_json() for x in (a, b))
    assert set(part_a) == set(UploadPartType.model_fields) and part_a["object"] == "upload.part"
    assert _stored_parts(platform, upload["id"]) == {part_a["id"], part_b["id"]}

    wrong = _complete(client, upload["id"], [part_b["id"], part_a["id"]], md5=hashlib.md5(a + b).hexdigest())
    assert wrong.status_code == 409 and wrong.get_json()["error"]["param"] == "md5"
    assert _stored_parts(platform, upload["id"]) == {part_a["id"], part_b["id"]}  # still pending, parts kept

    done = _complete(client, upload["id"], [part_b["id"], part_a["id"]], md5=hashlib.md5(b + a).hexdigest())
    assert done.status_code == 200, done.get_json()
    body = done.get_json()
    assert body["status"] == "completed" and body["file"]["bytes"] == len(a) + len(b)
    assert client.get(f"/v1/files/{body['file']['id']}/content").data == b + a
    assert _stored_parts(platform, upload["id"]) == set()
    assert _part(client, upload["id"], a).status_code == 409
    assert _complete(client, upload["id"], [part_a["id"]]).status_code == 409


def test_upload_limits(platform):
    client = platform.app(max_upload_bytes=1000, max_upload_part_bytes=100, max_upload_parts=2).test_client()
    assert _create(client, 1001).status_code == 400  # over the maximum the OpenAPI document publishes
    assert _create(client, 10, purpose="fine-tune").status_code == 400
    assert _create(client, 10, mime_type="image/png").get_json()["error"]["param"] == "mime_type"
    assert _create(client, 0).status_code == 400
    upload = _create(client, 250).get_json()["id"]
    assert _part(client, upload, b"x" * 101).status_code == 413  # over the part limit
    assert _stored_parts(platform, upload) == set()  # nothing left of it
    first = _part(client, upload, b"x" * 100).get_json()["id"]
    second = _part(client, upload, b"x" * 100).get_json()["id"]
    assert _part(client, upload, b"x" * 50).status_code == 409  # over the part count
    short = _complete(client, upload, [first, second])
    assert short.status_code == 409 and "200 bytes" in short.get_json()["error"]["message"]
    assert _complete(client, upload, [first, first]).status_code == 400
    unknown = _complete(client, upload, [first, "part_nope"])
    assert unknown.status_code == 409 and unknown.get_json()["error"]["param"] == "part_ids"
    over = platform.app(max_upload_bytes=1000, max_upload_part_bytes=100).test_client()
    upload = _create(over, 150).get_json()["id"]
    _part(over, upload, b"x" * 100)
    assert _part(over, upload, b"x" * 60).status_code == 409  # past the upload's declared bytes
    other = platform.app(default_tenant="other").test_client()
    assert _part(other, upload, b"x").status_code == 404  # another tenant's upload


def test_the_completed_file_is_held_to_the_line_limit(platform):
    client = platform.app(max_lines=1).test_client()
    body = jsonl([chat_line("a", "x"), chat_line("b", "y")])
    upload = _create(client, len(body)).get_json()["id"]
    part = _part(platform.app().test_client(), upload, body).get_json()["id"]
    refused = _complete(client, upload, [part])
    assert refused.status_code == 413 and "lines" in refused.get_json()["error"]["message"]


def test_cancel_and_expiry_delete_the_parts(client, platform):
    upload = _create(client, 10).get_json()["id"]
    _part(client, upload, b"0123456789")
    cancelled = client.post(f"/v1/uploads/{upload}/cancel").get_json()
    assert cancelled["status"] == "cancelled" and _stored_parts(platform, upload) == set()
    assert client.post(f"/v1/uploads/{upload}/cancel").status_code == 409

    upload = _create(client, 10).get_json()["id"]
    part = _part(client, upload, b"0123456789").get_json()["id"]
    with session_scope(platform.settings.database_url) as s:
        s.execute(update(Upload).where(Upload.id == upload).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert expire_uploads(platform.settings) == 1  # the workers' sweeper runs this
    assert _stored_parts(platform, upload) == set()
    with session_scope(platform.settings.database_url) as s:
        assert s.get(Upload, upload).status == "expired"
    assert _complete(client, upload, [part]).status_code == 409

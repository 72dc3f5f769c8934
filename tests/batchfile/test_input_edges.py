"""Small input edges: duplicate JSON keys, a native job's line naming another model, blank lines and the
line limit, CR-only line endings."""

from __future__ import annotations

import io
import json

import pytest

from tests.helpers import MODEL, chat_line, jsonl, validated


def _job(client, body: bytes):
    return client.post(f"/v1/jobs?model={MODEL}", data=body, content_type="application/x-ndjson")


def test_duplicate_json_keys_are_a_per_line_error(client):
    good = json.dumps(chat_line("ok", "hi"))
    twice = '{"custom_id": "a", "custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    nested = json.dumps(chat_line("n", "hi")).replace('"max_tokens": 4', '"max_tokens": 4, "max_tokens": 9000')
    job = validated(client, _job(client, "\n".join([good, twice, nested]).encode() + b"\n"))
    assert job["request_counts"]["valid"] == 1 and job["request_counts"]["invalid"] == 2
    errors = {e["line"]: e for e in job["errors"]}
    assert errors[2]["code"] == errors[3]["code"] == "duplicate_key"
    assert "'custom_id'" in errors[2]["message"] and "'max_tokens'" in errors[3]["message"]


def test_a_native_line_naming_another_model_is_a_per_line_error(client):
    lines = [chat_line("same", "hi"), chat_line("other", "hi", model="gpt-4o-mini"), chat_line("none", "hi")]
    del lines[2]["body"]["model"]
    job = validated(client, _job(client, jsonl(lines)))
    assert job["request_counts"]["valid"] == 2
    (error,) = job["errors"]
    assert error["line"] == 2 and error["code"] == "model_mismatch" and "gpt-4o-mini" in error["message"]


@pytest.mark.parametrize("multipart", [False, True])
def test_blank_lines_do_not_count_towards_the_line_limit(platform, multipart):
    client = platform.app(max_lines=3).test_client()
    lines = [json.dumps(chat_line(f"c{i}", "hi")) for i in range(3)]
    padded = ("\n\n  \n\r\n".join(lines) + "\n\n\n").encode()

    def send(body: bytes):
        if multipart:
            form = {"file": (io.BytesIO(body), "in.jsonl"), "purpose": "batch"}
            return client.post("/v1/files", data=form, content_type="multipart/form-data")
        return _job(client, body)

    accepted = send(padded)
    assert accepted.status_code in (200, 201), accepted.get_json()
    over = send(padded + json.dumps(chat_line("c3", "hi")).encode() + b"\n")
    assert over.status_code == 413 and "3 lines" in over.get_json()["error"]["message"]


def test_cr_only_line_endings_end_lines(client):
    """A file whose lines end with CR alone (no LF anywhere) is read as universal newlines read it: the
    upload is any bytes (OpenAPI's binary), so it is not refused for them."""
    lines = [json.dumps(chat_line(f"c{i}", "hi")) for i in range(3)]
    r = _job(client, "\r".join(lines).encode() + b"\r")
    assert r.status_code == 201, r.get_json()
    counts = validated(client, r)["request_counts"]
    assert counts["total"] == 3 and counts["valid"] == 3
    stored = client.get(f"/v1/files/{r.get_json()['input_file_id']}/content").data
    assert stored == "\n".join(lines).encode() + b"\n"  # same size, line feeds in place of the CRs
    crlf = _job(client, "\r\n".join(lines).encode() + b"\r\n")
    assert crlf.status_code == 201 and validated(client, crlf)["request_counts"]["valid"] == 3
    stray = _job(client, "\n".join([lines[0].replace(", ", ",\r "), lines[1]]).encode())  # CR as JSON whitespace
    assert stray.status_code == 201 and validated(client, stray)["request_counts"]["valid"] == 2

"""The native API without a worker: uploads, validation errors with line numbers, limits, pagination."""

import json

from tests.helpers import MODEL, chat_line, completion_line, jsonl, validated


def _create(client, body: bytes, model=MODEL, **fields):
    data = {"file": (__import__("io").BytesIO(body), "in.jsonl"), "model": model}
    data.update({k: json.dumps(v) for k, v in fields.items()})
    return client.post("/v1/jobs", data=data, content_type="multipart/form-data")


def test_create_job_multipart_and_raw(client):
    body = jsonl([chat_line(f"c{i}", f"hello {i}") for i in range(20)])
    r = _create(client, body, metadata={"team": "a"}, defaults={"max_tokens": 3})
    assert r.status_code == 201, r.get_json()
    job = r.get_json()
    assert job["object"] == "job" and job["id"].startswith("batch_") and len(job["id"]) == 30
    assert job["status"] == "validating"  # validation runs in the background
    job = validated(client, r)
    assert job["status"] == "in_progress"
    assert job["request_counts"] == {
        "total": 20,
        "valid": 20,
        "invalid": 0,
        "completed": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert job["shards"] == 3  # shard size 8
    assert job["metadata"] == {"team": "a"} and job["defaults"] == {"max_tokens": 3}
    assert job["progress"] == 0.0 and job["created_at"] and job["in_progress_at"]

    r = client.post(f"/v1/jobs?model={MODEL}", data=body, content_type="application/x-ndjson")
    assert r.status_code == 201, r.get_json()
    assert validated(client, r)["request_counts"]["valid"] == 20
    assert client.get(f"/v1/jobs/{job['id']}").get_json()["id"] == job["id"]


def test_bad_lines_become_errors_with_line_numbers(client):
    lines = [
        chat_line("ok-1", "hi"),
        "{not json",
        {
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}]},
        },
        chat_line("ok-1", "duplicate id"),
        {**chat_line("u", "x"), "url": "/v1/embeddings"},
        chat_line("bad-param", "x", temperature=-1),
        completion_line("too-long", "word " * 5000),
        completion_line("ok-2", "fine"),
    ]
    r = _create(client, jsonl(lines))
    assert r.status_code == 201
    job = validated(client, r)
    assert job["request_counts"]["valid"] == 2 and job["request_counts"]["invalid"] == 6
    by_line = {e["line"]: e["code"] for e in job["errors"]}
    assert by_line == {
        2: "invalid_json",
        3: "invalid_custom_id",
        4: "duplicate_custom_id",
        5: "invalid_url",
        6: "invalid_parameter",
        7: "context_length_exceeded",
    }
    errors = [json.loads(x) for x in client.get(f"/v1/jobs/{job['id']}/errors").data.splitlines()]
    assert [e["response"]["body"]["error"]["code"] for e in errors] == [by_line[n] for n in sorted(by_line)]
    # the repeated custom_id's error line names none: "ok-1" has exactly one result line
    assert [e["custom_id"] for e in errors] == [None, None, None, "u", "bad-param", "too-long"]
    assert all(e["response"]["status_code"] == 400 for e in errors)


def test_unknown_model_in_openai_lines(client):
    # the native API's model serves every line; an unknown job model is a 400 for the whole request
    r = _create(client, jsonl([chat_line("a", "x")]), model="no-such-model")
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "model"


def test_all_lines_bad_fails_the_job(client):
    r = _create(client, b'{"a": 1}\nnope\n\n[1]\n')
    assert r.status_code == 201
    job = validated(client, r)
    assert job["status"] == "failed" and job["failed_at"]
    assert [e["line"] for e in job["errors"]] == [1, 2, 4]
    assert job["request_counts"]["invalid"] == 3
    errors = client.get(f"/v1/jobs/{job['id']}/errors").data.splitlines()
    assert len(errors) == 3 and job["error_file_id"] and job["output_file_id"] is None


def test_limits_answer_413(platform):
    small = platform.app(max_lines=5, max_upload_bytes=2000).test_client()
    six = jsonl([chat_line(f"c{i}", "x") for i in range(6)])
    r = small.post(f"/v1/jobs?model={MODEL}", data=six, content_type="application/x-ndjson")
    assert r.status_code == 413 and "5 lines" in r.get_json()["error"]["message"]
    big = jsonl([chat_line(f"c{i}", "y" * 600) for i in range(4)])
    r = small.post(f"/v1/jobs?model={MODEL}", data=big, content_type="application/x-ndjson")
    assert r.status_code == 413
    r = small.post(
        "/v1/files",
        data={"file": (__import__("io").BytesIO(big), "x.jsonl"), "purpose": "batch"},
        content_type="multipart/form-data",
    )
    assert r.status_code == 413


def test_list_jobs_pagination_and_status_filter(platform):
    fresh = platform.app(default_tenant="pager").test_client()
    ids = []
    for i in range(5):
        body = jsonl([chat_line("a", "x")]) if i % 2 == 0 else b"bad\n"
        created = fresh.post(f"/v1/jobs?model={MODEL}", data=body, content_type="application/x-ndjson")
        ids.append(validated(fresh, created)["id"])
    seen, after = [], None
    while True:
        page = fresh.get("/v1/jobs", query_string={"limit": 2, **({"after": after} if after else {})}).get_json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids[::-1]
    failed = fresh.get("/v1/jobs?status=failed").get_json()["data"]
    assert [j["id"] for j in failed] == [ids[3], ids[1]]
    assert fresh.get("/v1/jobs?status=bogus").status_code == 400
    assert fresh.get("/v1/jobs?limit=0").status_code == 400


def test_tenants_are_isolated(platform):
    mine = platform.app(default_tenant="t1").test_client()
    theirs = platform.app(default_tenant="t2").test_client()
    job = mine.post(f"/v1/jobs?model={MODEL}", data=b"bad\n", content_type="application/x-ndjson").get_json()
    assert theirs.get(f"/v1/jobs/{job['id']}").status_code == 404
    assert theirs.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404
    assert theirs.get(f"/v1/files/{job['input_file_id']}").status_code == 404
    assert mine.get(f"/v1/files/{job['input_file_id']}").status_code == 200


def test_errors_are_openai_shaped(client):
    r = client.get("/v1/jobs/batch_doesnotexist")
    assert r.status_code == 404
    assert set(r.get_json()["error"]) == {"message", "type", "param", "code"}
    assert r.headers["x-request-id"].startswith("req_")  # on every response, errors included
    assert client.get("/v1/jobs", headers={"X-Request-Id": "proxy-42"}).headers["x-request-id"] == "proxy-42"
    from flask.testing import FlaskClient

    unauthenticated = FlaskClient(client.application).get("/v1/jobs")
    assert unauthenticated.status_code == 401 and unauthenticated.headers["x-request-id"].startswith("req_")
    assert client.post("/v1/jobs", data=b"x", content_type="text/csv").status_code == 415
    r = client.post(
        "/v1/batches",
        json={"input_file_id": "file-x", "endpoint": "/v1/moderations", "completion_window": "24h"},
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "endpoint"

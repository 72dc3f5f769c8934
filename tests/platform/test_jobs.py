"""The native API end to end through a real worker: results as Parquet and JSONL, errors, cancellation."""

import json
import time

import pyarrow.parquet as pq

from pagedbatch.client import Client
from tests.helpers import MODEL, chat_line, completion_line, jsonl, wait_for


def test_native_job_end_to_end(live_url, worker, tmp_path):
    client = Client(live_url, api_key=worker.api_key)
    lines = [chat_line(f"n-{i}", f"question {i}") for i in range(17)]
    lines += [completion_line(f"p-{i}", f"prompt {i}") for i in range(5)]
    lines.insert(3, "{broken")
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(lines))
    job = client.submit(src, model=MODEL, defaults={"max_tokens": 3})
    assert job["status"] == "validating" and job["request_counts"]["total"] == 23
    job = client.wait(job["id"], timeout=120, poll_s=0.2)
    assert job["request_counts"] == {
        "total": 23,
        "valid": 22,
        "invalid": 1,
        "completed": 22,
        "failed": 0,
        "cancelled": 0,
    }
    assert job["status"] == "completed", job
    assert job["progress"] == 1.0
    assert job["request_counts"]["completed"] == 22 and job["request_counts"]["failed"] == 0
    assert job["usage"]["completion_tokens"] <= 22 * 4 and job["usage"]["prompt_tokens"] > 0

    out = client.download(job["id"], tmp_path / "r.parquet")
    rows = pq.read_table(out).to_pylist()
    assert [r["line"] for r in rows] == list(range(1, 24))  # one row per line, in line order
    assert [r["status"] for r in rows].count("failed") == 1 and rows[3]["error_code"] == "invalid_json"
    rows = [r for r in rows if r["status"] == "completed"]
    assert sorted(r["custom_id"] for r in rows) == sorted([f"n-{i}" for i in range(17)] + [f"p-{i}" for i in range(5)])
    usage = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert usage == job["usage"]["total_tokens"]

    jl = client.download(job["id"], tmp_path / "r.jsonl", fmt="jsonl")
    output = [json.loads(x) for x in jl.read_text().splitlines()]
    assert len(output) == 22 and len({o["custom_id"] for o in output}) == 22
    errors = client.download(job["id"], tmp_path / "e.jsonl", errors=True).read_text().splitlines()
    assert [json.loads(e)["response"]["body"]["error"]["code"] for e in errors] == ["invalid_json"]
    assert job["errors"] == [{"code": "invalid_json", "line": 4, "message": job["errors"][0]["message"], "param": None}]


def test_results_not_ready_is_409(live_url, worker):
    import urllib.request

    client = Client(live_url, api_key=worker.api_key)
    data = jsonl([chat_line(f"s-{i}", "slow", max_tokens=64, ignore_eos=True) for i in range(8)])
    req = urllib.request.Request(
        f"{live_url}/v1/jobs?model={MODEL}",
        data=data,
        headers={"Content-Type": "application/x-ndjson", **worker.auth()},
        method="POST",
    )
    job = json.loads(urllib.request.urlopen(req).read())
    try:
        urllib.request.urlopen(urllib.request.Request(f"{live_url}/v1/jobs/{job['id']}/results", headers=worker.auth()))
        status = 200
    except urllib.error.HTTPError as exc:
        status = exc.code
    final = client.wait(job["id"], timeout=120)
    assert status == 409 or final["completed_at"]  # it may already have finished on a fast machine


def test_cancel_aborts_running_requests(live_url, worker, tmp_path):
    client = Client(live_url, api_key=worker.api_key)
    # a first shard that finishes at once, then long generations still running when the job is cancelled
    lines = [completion_line(f"k-{i}", f"quick {i}", max_tokens=2) for i in range(8)]
    lines += [completion_line(f"k-{i}", f"count {i}", max_tokens=900, ignore_eos=True) for i in range(8, 64)]
    src = tmp_path / "long.jsonl"
    src.write_bytes(jsonl(lines))
    job = client.submit(src, model=MODEL)
    wait_for(
        lambda: {"status": "go" if client.job(job["id"])["request_counts"]["completed"] >= 8 else "wait"},
        statuses=("go",),
        timeout=60,
        poll=0.05,
    )
    cancelled_at = time.monotonic()
    job = client.cancel(job["id"])
    assert job["status"] in ("cancelling", "cancelled")
    job = wait_for(lambda: client.job(job["id"]), statuses=("cancelled",), timeout=30, poll=0.05)
    assert time.monotonic() - cancelled_at < 5, "cancellation should abort running requests promptly"
    counts = job["request_counts"]
    assert job["cancelled_at"] and counts["completed"] >= 8 and counts["cancelled"] == 64 - counts["completed"]
    rows = pq.read_table(client.download(job["id"], tmp_path / "partial.parquet")).to_pylist()
    assert [r["line"] for r in rows] == list(range(1, 65))  # every line has a row
    done = [r for r in rows if r["status"] == "completed"]
    assert len(done) == counts["completed"] and {f"k-{i}" for i in range(8)} <= {r["custom_id"] for r in done}
    assert all(r["output_text"] is not None for r in done)
    output = client.download(job["id"], tmp_path / "partial.jsonl", fmt="jsonl").read_text().splitlines()
    assert len(output) == counts["completed"]
    assert client.cancel(job["id"])["status"] == "cancelled"  # cancelling again is a no-op


def test_worker_keeps_serving_after_cancel(live_url, worker, tmp_path):
    client = Client(live_url, api_key=worker.api_key)
    src = tmp_path / "after.jsonl"
    src.write_bytes(jsonl([chat_line(f"a-{i}", "after cancel") for i in range(5)]))
    job = client.wait(client.submit(src, model=MODEL)["id"], timeout=120)
    assert job["status"] == "completed" and job["request_counts"]["completed"] == 5

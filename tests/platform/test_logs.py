"""The platform's log lines carry their job, shard and tenant: a worker's (JSON) and the API's."""

from __future__ import annotations

import io
import json
import logging

from pagedbatch.client import Client
from store.logs import ContextFilter, JsonFormatter
from tests.helpers import MODEL, chat_line, jsonl


def test_a_jobs_worker_log_lines_are_json_with_its_ids(live_url, worker, tmp_path):
    client = Client(live_url, api_key=worker.api_key)
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line(f"l-{i}", f"question {i}") for i in range(12)]))  # two shards
    job = client.wait(client.submit(src, model=MODEL)["id"], timeout=120, poll_s=0.2)
    assert job["status"] == "completed", job
    mine = [line for line in worker.worker_log().splitlines() if job["id"] in line]
    records = [json.loads(line) for line in mine]  # every line about the job is one JSON object
    carrying = [r for r in records if r.get("job_id") == job["id"]]
    shards = {r["shard_id"] for r in carrying}
    assert shards == {f"{job['id']}.{i:05d}" for i in range(2)}
    assert {r["tenant"] for r in carrying} == {worker.settings.default_tenant}
    done = [r for r in carrying if "completed" in r["message"] and r["logger"] == "workers.shard_runner"]
    assert sorted(r["shard_id"] for r in done) == sorted(shards)
    succeeded = [r for r in carrying if r["logger"] == "celery.app.trace" and " succeeded " in r["message"]]
    assert sorted(r["shard_id"] for r in succeeded) == sorted(shards)  # Celery's own lines too
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)


def test_api_log_lines_carry_tenant_and_job(platform):
    app = platform.app(default_tenant="acme")
    probe = logging.getLogger("pagedbatch.probe")

    def view(job_id):
        probe.info("looking at %s", job_id)
        return ""

    app.add_url_rule("/v1/jobs/<job_id>/probe", view_func=view)
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    probe.addHandler(handler)
    probe.setLevel(logging.INFO)
    try:
        assert app.test_client().get("/v1/jobs/batch_xyz/probe").status_code == 200
        probe.info("after the request")
    finally:
        probe.removeHandler(handler)
    during, after = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert (during["tenant"], during["job_id"]) == ("acme", "batch_xyz")
    assert "tenant" not in after and "job_id" not in after  # the context ends with the request

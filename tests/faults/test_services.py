"""Service faults during a job, caused for real on private servers: Redis restarted (queued messages lost),
PostgreSQL restarted, the API process killed and restarted; and the job-level stops: expiry after the
completion window and cancellation while shards run."""

import json
import os
import signal
import sys
import time
import urllib.request

import pytest
from sqlalchemy import update

from store.db import session_scope
from store.models import Job, utcnow
from tests.helpers import MODEL, REPO, free_port, jsonl, long_line, spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(faults):
    faults.start_worker(concurrency=2)
    yield faults
    faults.stop_workers()


def test_redis_restart_loses_queued_messages_and_the_job_completes(served):
    h = served
    ids = [f"r{i}" for i in range(24)]
    job = h.submit([long_line(cid, max_tokens=96) for cid in ids])
    h.wait_running(job["id"])
    h.redis.restart()  # every queued message is gone; the running shards go on
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)


def test_job_created_while_redis_is_down_runs_when_it_is_back(served):
    h = served
    h.redis.stop()
    try:
        ids = [f"d{i}" for i in range(6)]
        job = h.submit([long_line(cid, max_tokens=8) for cid in ids])  # stored; enqueueing failed
        assert job["status"] == "in_progress"
    finally:
        h.redis.start()
    done = h.wait(job["id"], timeout=90)
    assert done["status"] == "completed"
    h.assert_exactly_once(done["id"], ids)


def test_postgres_restart_during_a_job(served):
    h = served
    ids = [f"g{i}" for i in range(16)]
    job = h.submit([long_line(cid, max_tokens=96) for cid in ids])
    h.wait_running(job["id"])
    h.pg.restart()
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)


def _http(method, url, key, data=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is not None:
        headers["Content-Type"] = "application/x-ndjson"
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers)) as r:
        return json.loads(r.read())


def test_api_killed_and_restarted_during_a_job(served):
    h = served
    port = free_port()
    cmd = [sys.executable, "-m", "pagedbatch", "api", "--host", "127.0.0.1", f"--port={port}", "--workers=1"]
    cmd += ["--model", f"{MODEL}={h.model_path}"]
    base = f"http://127.0.0.1:{port}"

    def start_api():
        # its own process group: gunicorn's master and its workers die together
        proc = spawn(cmd, h.tmp / f"api-{time.monotonic_ns()}.log", cwd=REPO, env=h.env(), start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                _http("GET", f"{base}/v1/jobs?limit=1", h.api_key)
                return proc
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    kill(proc)
                    raise
                time.sleep(0.2)

    api = start_api()
    ids = [f"a{i}" for i in range(16)]
    try:
        job = _http("POST", f"{base}/v1/jobs?model={MODEL}", h.api_key, jsonl(long_line(c, max_tokens=64) for c in ids))
        h.wait_running(job["id"])
        kill(api)
        api = start_api()
        deadline = time.monotonic() + 120
        while (current := _http("GET", f"{base}/v1/jobs/{job['id']}", h.api_key))["status"] != "completed":
            assert time.monotonic() < deadline, current
            time.sleep(0.3)
    finally:
        kill(api)
    h.assert_exactly_once(job["id"], ids)


def kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_expiry_keeps_finished_results_and_reports_the_rest_expired(served):
    h = served
    ids = [f"e{i}" for i in range(160)]  # enough shards that some still wait when the first is done
    job = h.submit([long_line(cid, max_tokens=64) for cid in ids])
    deadline = time.monotonic() + 60
    while not any(s.status == "done" for s in h.shards(job["id"])):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with session_scope(h.settings.database_url) as s:  # its completion window ends now
        s.execute(update(Job).where(Job.id == job["id"]).values(expires_at=utcnow()))
    done = h.wait(job["id"], timeout=60)
    assert done["status"] == "expired", done
    counts = done["request_counts"]
    assert counts["completed"] > 0 and counts["failed"] > 0 and counts["completed"] + counts["failed"] == len(ids)
    output, errors = h.assert_exactly_once(done["id"], ids)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(output) == counts["completed"]


def test_cancel_while_shards_run(served):
    h = served
    ids = [f"c{i}" for i in range(24)]
    job = h.submit([long_line(cid, max_tokens=200) for cid in ids])
    h.wait_running(job["id"])
    r = h.client().post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.get_json()["status"] in ("cancelling", "cancelled")
    done = h.wait(job["id"], timeout=60)
    assert done["status"] == "cancelled"
    assert done["request_counts"]["cancelled"] > 0
    h.assert_exactly_once(done["id"], ids)

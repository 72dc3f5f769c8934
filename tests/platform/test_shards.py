"""Shards in process with a fake engine: redelivery never double counts, finalization happens once."""

import threading
from concurrent.futures import Future

from sqlalchemy import update

from engine.params.outputs import CompletionOutput, RequestOutput
from store.db import session_scope
from store.lifecycle.finalize import maybe_finalize
from store.lifecycle.jobs import get_job
from store.lifecycle.progress import job_progress
from store.lifecycle.shards import claim_shard
from store.models import SHARD_RUNNING, Shard
from store.results.parts import results_store
from tests.helpers import MODEL, chat_line, jsonl, validated
from workers import shard_runner


class FakeHost:
    tokenizer = None

    def __init__(self):
        self.submitted = 0

    def submit_many(self, requests, tenant="default", **_):
        futures = []
        for request_id, prompt, _params in requests:
            self.submitted += 1
            future = Future()
            ids = prompt["prompt_token_ids"]
            future.set_result(RequestOutput(request_id, None, ids, [CompletionOutput(0, "ok", [7, 8], "length")]))
            futures.append(future)
        return futures

    def abort(self, request_ids):
        return 0


class FakeWatcher:
    def register(self, job_id, request_ids):
        pass

    def unregister(self, job_id, request_ids):
        pass

    def is_cancelled(self, job_id):
        return False


def _job_without_worker(platform, n):
    # a queue no worker listens to: the shards are run here instead
    app = platform.app(queue_prefix="pbtest-noworker-" + platform.settings.queue_prefix)
    client = app.test_client()
    r = client.post(
        f"/v1/jobs?model={MODEL}",
        data=jsonl([chat_line(f"r{i}", "hi") for i in range(n)]),
        content_type="application/x-ndjson",
    )
    assert r.status_code == 201
    return app.extensions["pagedbatch"].settings, validated(client, r)


def test_redelivered_shard_is_counted_once(platform):
    settings, job = _job_without_worker(platform, 20)
    shard_ids = [f"{job['id']}.{i:05d}" for i in range(job["shards"])]
    host, watcher = FakeHost(), FakeWatcher()
    assert shard_runner.run_shard(settings, host, watcher, shard_ids[0]) == "done"
    # the worker died after writing the part but before the ack: the task comes back
    with session_scope(settings.database_url) as s:
        s.execute(update(Shard).where(Shard.id == shard_ids[0]).values(status=SHARD_RUNNING))
    assert shard_runner.run_shard(settings, host, watcher, shard_ids[0]) == "done"
    # a redelivery of a shard marked done is skipped
    assert shard_runner.run_shard(settings, host, watcher, shard_ids[0]) == "skipped"
    progress = job_progress(settings, get_job(settings, "default", job["id"]))
    assert progress.completed == 8 and progress.completion_tokens == 16
    for shard_id in shard_ids[1:]:
        shard_runner.run_shard(settings, host, watcher, shard_id)
    final = get_job(settings, "default", job["id"])
    assert final.status == "completed"
    assert (final.request_completed, final.request_failed, final.completion_tokens) == (20, 0, 40)
    assert len(results_store(settings).list_parts(job["id"])) == 3
    with session_scope(settings.database_url) as s:
        attempts = s.get(Shard, shard_ids[0]).attempts
    assert attempts == 2


def test_finalize_runs_once_under_races(platform):
    settings, job = _job_without_worker(platform, 5)
    shard_id = f"{job['id']}.00000"
    claim = claim_shard(settings, shard_id, "test")
    assert claim is not None and claim.attempt == 1
    from batchfile.errors import LineError
    from store.results.rows import error_row

    rows = [error_row(LineError(line, f"c{line}", "invalid_request", "bad")) for line in range(1, 6)]
    shard_runner._write_part(settings, job["id"], shard_id, rows)  # whole: a short part is never finalized
    results = []
    threads = [threading.Thread(target=lambda: results.append(maybe_finalize(settings, job["id"]))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    assert get_job(settings, "default", job["id"]).status == "completed"


def test_cancel_before_any_worker_runs(platform):
    settings, job = _job_without_worker(platform, 12)
    client = platform.app(queue_prefix=settings.queue_prefix).test_client()
    done = client.post(f"/v1/jobs/{job['id']}/cancel").get_json()
    assert done["status"] == "cancelled"  # nothing was running: every shard was dropped from the queue
    assert done["request_counts"]["cancelled"] == 12 and done["request_counts"]["completed"] == 0
    assert client.post(f"/v1/jobs/{job['id']}/cancel").get_json()["status"] == "cancelled"
    # the late task is skipped
    assert shard_runner.run_shard(settings, FakeHost(), FakeWatcher(), f"{job['id']}.00000") == "skipped"
    errors = client.get(f"/v1/jobs/{job['id']}/errors").data.splitlines()
    assert len(errors) == 12


def test_finished_job_cannot_be_cancelled(platform):
    settings, job = _job_without_worker(platform, 3)
    shard_runner.run_shard(settings, FakeHost(), FakeWatcher(), f"{job['id']}.00000")
    client = platform.app(queue_prefix=settings.queue_prefix).test_client()
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 409

"""Cancellation at the stages no worker is needed for, each caught in the act: while the upload is being
validated, while the shards wait in the queue, and while the job is finalizing. (Cancelling while shards
run is in test_faults_services.)"""

import dataclasses
import threading
from concurrent.futures import Future

from engine.params.outputs import CompletionOutput, RequestOutput
from store.lifecycle import finalize, validating
from tests.helpers import MODEL, jsonl, long_line, wait_until
from workers import shard_runner


class InstantHost:
    tokenizer = None

    def submit_many(self, requests, tenant="default", **_):
        futures = []
        for request_id, prompt, _params in requests:
            future = Future()
            out = CompletionOutput(0, "ok", [7, 8], "length")
            future.set_result(RequestOutput(request_id, None, prompt["prompt_token_ids"], [out]))
            futures.append(future)
        return futures

    def abort(self, request_ids):
        return 0


class NoWatcher:
    def register(self, job_id, request_ids): ...

    def unregister(self, job_id, request_ids): ...

    def is_cancelled(self, job_id):
        return False


def _client(settings, h):
    from api.app import create_app

    client = create_app(settings).test_client()
    client.environ_base.update({f"HTTP_{k.upper()}": v for k, v in h.headers.items()})
    return client


def _unserved(h):
    return dataclasses.replace(h.settings, queue_prefix="faults-unserved")  # no worker listens here


def test_cancel_while_validating(faults, monkeypatch):
    h = faults
    settings = _unserved(h)
    gate, reached = threading.Event(), threading.Event()
    real = validating.validate_stream

    def slow_validation(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 3:
                reached.set()
                assert gate.wait(30)
            yield item

    monkeypatch.setattr(validating, "validate_stream", slow_validation)
    ids = [f"val{i}" for i in range(10)]
    client = _client(settings, h)
    r = client.post(
        f"/v1/jobs?model={MODEL}", data=jsonl(long_line(c) for c in ids), content_type="application/x-ndjson"
    )
    job = r.get_json()
    assert r.status_code == 201 and job["status"] == "validating"  # answered before validation ends
    assert reached.wait(30)
    r = _client(settings, h).post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.get_json()["status"] == "cancelling"
    gate.set()
    done = h.wait(job["id"], timeout=30)
    assert done["status"] == "cancelled" and done["request_counts"]["cancelled"] == len(ids)
    assert done["finalizing_at"] is None and done["usage"]["total_tokens"] == 0
    h.assert_exactly_once(job["id"], ids)


def test_cancel_while_queued_then_the_late_task_is_skipped(faults):
    h = faults
    settings = _unserved(h)
    ids = [f"q{i}" for i in range(9)]
    job = h.submit([long_line(c) for c in ids], client=_client(settings, h))
    done = _client(settings, h).post(f"/v1/jobs/{job['id']}/cancel").get_json()
    assert done["status"] == "cancelled" and done["request_counts"]["cancelled"] == len(ids)
    assert shard_runner.run_shard(settings, InstantHost(), NoWatcher(), f"{job['id']}.00000") == "skipped"
    h.assert_exactly_once(job["id"], ids)


def test_cancel_while_finalizing_is_refused_and_the_job_completes(faults, monkeypatch):
    h = faults
    settings = _unserved(h)
    ids = [f"f{i}" for i in range(6)]
    job = h.submit([long_line(c) for c in ids], client=_client(settings, h))
    gate, reached = threading.Event(), threading.Event()
    real = finalize._write_final_files

    def slow_final_files(*args, **kwargs):
        reached.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(finalize, "_write_final_files", slow_final_files)
    shard_ids = [f"{job['id']}.{i:05d}" for i in range(job["shards"])]
    runner = threading.Thread(
        target=lambda: [shard_runner.run_shard(settings, InstantHost(), NoWatcher(), s) for s in shard_ids]
    )
    runner.start()
    assert reached.wait(30)
    assert h.job(job["id"])["status"] == "finalizing"
    r = _client(settings, h).post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 409
    gate.set()
    runner.join(30)
    done = wait_until(lambda: (j := h.job(job["id"]))["status"] == "completed" and j, 10, what="the job to complete")
    assert done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(job["id"], ids)

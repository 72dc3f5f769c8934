"""Validation off the request path (no worker: shards are run here or not at all): create answers
`validating` at once, shards are enqueued as they are validated, `on_invalid_lines` fail|skip, a dead
validator's job is resumed by the sweeper without a line lost or doubled, the pool bounds concurrency,
and a running shard's counts move per request."""

from __future__ import annotations

import dataclasses
import io
import json
import threading
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from engine.params.outputs import CompletionOutput, RequestOutput
from store.db import session_scope
from store.filestore.storage import get_storage
from store.lifecycle import validating
from store.lifecycle.progress import job_progress
from store.models import SHARD_CANCELLED, Job, Shard, utcnow
from tests.helpers import MODEL, chat_line, jsonl, validated, wait_until
from tests.platform.test_shards import FakeWatcher
from workers import shard_runner, sweeper


@pytest.fixture
def unserved(platform):
    """An app on a queue no worker serves, its test client, and its settings."""
    app = platform.app(queue_prefix="pbtest-noworker-validation")
    return app, app.test_client(), app.extensions["pagedbatch"].settings


def _post(client, lines, **args):
    query = "&".join(f"{k}={v}" for k, v in {"model": MODEL, **args}.items())
    return client.post(f"/v1/jobs?{query}", data=jsonl(lines), content_type="application/x-ndjson")


def _shard_lines(settings, job_id) -> list[dict]:
    storage = get_storage(settings.storage_url)
    with session_scope(settings.database_url) as s:
        keys = list(s.scalars(select(Shard.input_key).where(Shard.job_id == job_id).order_by(Shard.index)))
    lines = []
    for key in keys:
        with storage.open_read(key) as f:
            lines += [json.loads(x) for x in f if x.strip()]
    return lines


def _gate(monkeypatch, after: int):
    """validate_stream stops after `after` items until the returned event is set."""
    gate, reached = threading.Event(), threading.Event()
    real = validating.validate_stream

    def gated(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == after:
                reached.set()
                assert gate.wait(30)
            yield item

    monkeypatch.setattr(validating, "validate_stream", gated)
    return gate, reached


def test_shards_are_enqueued_while_the_file_is_still_validating(unserved, monkeypatch):
    app, client, settings = unserved
    gate, reached = _gate(monkeypatch, after=10)  # shard size 8: one shard is written by then
    sent = []
    monkeypatch.setattr("api.validations.enqueue_shards", lambda _settings, shards: sent.extend(shards))
    r = _post(client, [chat_line(f"s{i}", "hi") for i in range(20)])
    assert r.status_code == 201 and r.get_json()["status"] == "validating"
    try:
        assert reached.wait(30)
        job = client.get(f"/v1/jobs/{r.get_json()['id']}").get_json()
        assert job["status"] == "in_progress" and job["shards"] == 1  # running before validation ended
        assert sent == [(f"{job['id']}.00000", MODEL)]
    finally:
        gate.set()
    job = validated(client, r)
    assert job["shards"] == 3 and job["request_counts"]["valid"] == 20 and len(sent) == 3
    client.post(f"/v1/jobs/{job['id']}/cancel")  # no shard is left queued for another test's worker


def test_batches_fail_a_file_with_invalid_lines_and_skip_is_an_option(unserved):
    app, client, settings = unserved
    lines = [chat_line("a", "x"), chat_line("b", "x"), chat_line("a", "dup"), chat_line("c", "x", temperature=9)]
    upload = {"file": (io.BytesIO(jsonl(lines)), "in.jsonl"), "purpose": "batch"}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    failed = validated(client, client.post("/v1/batches", json=body))
    assert failed["status"] == "failed" and failed["output_file_id"] is None
    assert [(e["line"], e["code"]) for e in failed["errors"]["data"]] == [
        (3, "duplicate_custom_id"),
        (4, "invalid_parameter"),
    ]
    assert failed["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    errors = client.get(f"/v1/files/{failed['error_file_id']}/content").data.splitlines()
    assert [json.loads(e)["custom_id"] for e in errors] == [None, "c"]  # "a" keeps its one line
    with session_scope(settings.database_url) as s:
        statuses = set(s.scalars(select(Shard.status).where(Shard.job_id == failed["id"])))
    assert statuses == {SHARD_CANCELLED}  # held, never sent

    skipped = validated(client, client.post("/v1/batches", json={**body, "on_invalid_lines": "skip"}))
    assert skipped["status"] == "in_progress" and skipped["request_counts"]["failed"] == 2
    assert [x["custom_id"] for x in _shard_lines(settings, skipped["id"])] == ["a", "b"]
    r = client.post("/v1/batches", json={**body, "on_invalid_lines": "maybe"})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "on_invalid_lines"
    cancelled = client.post(f"/v1/batches/{skipped['id']}/cancel").get_json()
    assert cancelled["status"] == "cancelled" and cancelled["request_counts"]["failed"] == 4


def test_native_jobs_skip_invalid_lines_unless_told_to_fail(unserved):
    app, client, settings = unserved
    lines = [chat_line("a", "x"), "{broken"]
    running = validated(client, _post(client, lines))
    assert running["status"] == "in_progress" and running["request_counts"]["invalid"] == 1
    client.post(f"/v1/jobs/{running['id']}/cancel")
    failed = validated(client, _post(client, lines, on_invalid_lines="fail"))
    assert failed["status"] == "failed" and failed["request_counts"]["invalid"] == 1
    assert _post(client, lines, on_invalid_lines="x").status_code == 400


def test_a_dead_validators_job_is_resumed_by_the_sweeper(unserved, monkeypatch):
    app, client, settings = unserved
    settings = dataclasses.replace(settings, shard_size=4)
    lines = [chat_line(f"r{i}", "hi") if i % 5 else f"broken {i}" for i in range(23)]
    upload = {"file": (io.BytesIO(jsonl(lines)), "in.jsonl"), "purpose": "batch"}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    from store.filestore import files
    from store.lifecycle import jobs

    input_file = files.get_file(settings, settings.default_tenant, file_id)
    job, owner = jobs.create_job(
        settings, input_file, tenant=settings.default_tenant, model=MODEL, on_invalid_lines="skip"
    )

    class Died(BaseException):
        pass

    real = validating.validate_stream

    def dies_midway(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 14:
                raise Died
            yield item

    monkeypatch.setattr(validating, "validate_stream", dies_midway)
    sent = []
    with pytest.raises(Died):
        validating.validate_job(settings, job.id, owner, sent.extend)
    with session_scope(settings.database_url) as s:
        row = s.get(Job, job.id)
        assert row.validated_at is None and 0 < row.validated_lines < 23  # checkpoints were committed
        assert validating.stale_validations(settings).count(job.id) == 0  # its heartbeat is fresh
        s.execute(update(Job).where(Job.id == job.id).values(validation_heartbeat_at=utcnow() - timedelta(hours=1)))
    monkeypatch.setattr(validating, "validate_stream", real)
    monkeypatch.setattr(sweeper, "enqueue_shards", lambda _settings, shards: sent.extend(shards))
    assert sweeper._resume_stale_validations(settings) == 1
    wait_until(
        lambda: client.get(f"/v1/jobs/{job.id}").get_json()["status"] != "validating" and _validated(settings, job.id),
        30,
        what="the resumed validation",
    )
    done = client.get(f"/v1/jobs/{job.id}").get_json()
    valid = [f"r{i}" for i in range(23) if i % 5]
    assert sorted(x["custom_id"] for x in _shard_lines(settings, job.id)) == sorted(valid)  # each exactly once
    assert sorted(shard for shard, _ in sent) == sorted(f"{job.id}.{i:05d}" for i in range(done["shards"]))
    counts = done["request_counts"]
    assert (counts["total"], counts["valid"], counts["invalid"]) == (23, len(valid), 23 - len(valid))
    assert sorted(e["line"] for e in done["errors"]) == [i + 1 for i in range(23) if i % 5 == 0]
    errors = client.get(f"/v1/jobs/{job.id}/errors").data.splitlines()
    assert len(errors) == 23 - len(valid)  # the invalid lines' rows, none twice
    client.post(f"/v1/jobs/{job.id}/cancel")


def _validated(settings, job_id) -> bool:
    with session_scope(settings.database_url) as s:
        return s.get(Job, job_id).validated_at is not None


def test_the_validation_pool_bounds_concurrency(platform, monkeypatch):
    app = platform.app(queue_prefix="pbtest-noworker-validation", max_concurrent_validations=1)
    client = app.test_client()
    running, peak, lock = [0], [0], threading.Lock()
    real = validating.validate_job

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(validating, "validate_job", counted)
    created = [_post(client, [chat_line("a", "x")]) for _ in range(3)]
    assert all(r.get_json()["status"] == "validating" for r in created)
    jobs = [validated(client, r) for r in created]
    assert [job["status"] for job in jobs] == ["in_progress"] * 3 and peak[0] == 1
    for job in jobs:
        client.post(f"/v1/jobs/{job['id']}/cancel")


class OneByOneHost:
    """Requests finish when the test says so."""

    tokenizer = None

    def __init__(self):
        self.futures: list[tuple[Future, RequestOutput]] = []

    def submit_many(self, requests, tenant="default", **_):
        out = []
        for request_id, prompt, _params in requests:
            future = Future()
            ids = prompt["prompt_token_ids"]
            self.futures.append(
                (future, RequestOutput(request_id, None, ids, [CompletionOutput(0, "ok", [7], "stop")]))
            )
            out.append(future)
        return out

    def finish(self, n: int) -> None:
        for future, output in self.futures[:n]:
            future.set_result(output)
        self.futures = self.futures[n:]

    def abort(self, request_ids):
        return 0


def test_request_counts_move_per_request_while_a_shard_runs(unserved):
    app, client, settings = unserved
    job = validated(client, _post(client, [chat_line(f"p{i}", "hi") for i in range(8)]))  # one shard
    host = OneByOneHost()
    runner = threading.Thread(target=shard_runner.run_shard, args=(settings, host, FakeWatcher(), f"{job['id']}.00000"))
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while not host.futures:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for finishing, done in ((1, 1), (2, 3)):
            host.finish(finishing)
            while (seen := _progress(settings, job["id"])) != done:
                assert time.monotonic() < deadline, seen
                time.sleep(0.05)
            assert client.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "in_progress"
    finally:
        host.finish(8)
        runner.join(30)
    assert client.get(f"/v1/jobs/{job['id']}").get_json()["request_counts"]["completed"] == 8


def _progress(settings, job_id) -> int:
    with session_scope(settings.database_url) as s:
        return job_progress(settings, s.get(Job, job_id), session=s).completed


def test_an_api_process_resumes_a_job_its_dead_peer_never_validated(unserved):
    app, client, settings = unserved
    from store.filestore import files
    from store.lifecycle import jobs

    upload = {"file": (io.BytesIO(jsonl([chat_line(f"x{i}", "hi") for i in range(5)])), "in.jsonl"), "purpose": "batch"}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    input_file = files.get_file(settings, settings.default_tenant, file_id)
    job, _owner = jobs.create_job(
        settings, input_file, tenant=settings.default_tenant, model=MODEL, on_invalid_lines="skip"
    )
    # the process that created it died before validating a line
    with session_scope(settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job.id).values(validation_heartbeat_at=utcnow() - timedelta(hours=1)))
    pool = app.extensions["pagedbatch"].validations
    for _ in range(10):  # older stale jobs of other tests may come first
        assert pool.resume_stale() >= 1
        assert pool.wait(30)
        if _validated(settings, job.id):
            break
    done = client.get(f"/v1/jobs/{job.id}").get_json()
    assert done["status"] == "in_progress" and done["request_counts"]["valid"] == 5
    assert sorted(x["custom_id"] for x in _shard_lines(settings, job.id)) == [f"x{i}" for i in range(5)]
    client.post(f"/v1/jobs/{job.id}/cancel")

"""Poison bisection in process (issue 12, finding 2): a shard past its attempt limit is split into halves with
fresh attempts, down to single requests, which fail alone; every request ends exactly once."""

import json
from datetime import timedelta

from sqlalchemy import select, update

from store.db import session_scope
from store.lifecycle.jobs import get_job
from store.lifecycle.shards import claim_shard, split_shard
from store.models import Shard, utcnow
from store.results.parts import results_store
from tests.platform.test_shards import FakeHost, FakeWatcher, _job_without_worker
from workers import shard_runner


def _die_once(settings, shard_id):
    """One attempt whose worker died: claimed, then its lease ran out."""
    assert claim_shard(settings, shard_id, "dead-worker", max_attempts=1) is not None
    with session_scope(settings.database_url) as s:
        s.execute(update(Shard).where(Shard.id == shard_id).values(lease_until=utcnow() - timedelta(seconds=1)))


def _shards(settings, job_id):
    with session_scope(settings.database_url) as s:
        rows = s.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.index))
        return [(r.id, r.status, r.request_count, r.attempts) for r in rows]


def test_an_exhausted_shard_is_bisected_down_to_a_single_failed_request(platform, monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_MAX_SHARD_ATTEMPTS", "1")
    settings, job = _job_without_worker(platform, 5)
    host, watcher, job_id = FakeHost(), FakeWatcher(), job["id"]
    first = f"{job_id}.00000"
    _die_once(settings, first)
    assert shard_runner.run_shard(settings, host, watcher, first) == "split"
    assert host.submitted == 0  # nothing of the poisoned shard ran in this attempt
    assert [s[1:] for s in _shards(settings, job_id)] == [("done", 5, 2), ("queued", 2, 0), ("queued", 3, 0)]
    ids = [s[0] for s in _shards(settings, job_id)]
    assert split_shard(settings, first, 2, [[b"x\n"]]) is None  # a stale attempt changes nothing
    assert shard_runner.run_shard(settings, host, watcher, ids[1]) == "done"  # the innocent half runs
    _die_once(settings, ids[2])
    assert shard_runner.run_shard(settings, host, watcher, ids[2]) == "split"  # 3 -> 1 + 2
    ids = [s[0] for s in _shards(settings, job_id)]
    assert [s[2] for s in _shards(settings, job_id)] == [5, 2, 3, 1, 2]
    _die_once(settings, ids[3])
    assert shard_runner.run_shard(settings, host, watcher, ids[3]) == "done"  # one request: it fails alone
    assert get_job(settings, "default", job_id).status != "completed"
    assert shard_runner.run_shard(settings, host, watcher, ids[4]) == "done"

    final = get_job(settings, "default", job_id)
    assert final.status == "completed"
    assert (final.request_completed, final.request_failed) == (4, 1)
    parts = sorted(p.rsplit("/", 1)[-1] for p in results_store(settings).list_parts(job_id))
    assert parts == sorted(f"{sid}.parquet" for sid in (ids[1], ids[3], ids[4]))
    client = platform.app(queue_prefix=settings.queue_prefix).test_client()
    done = [json.loads(line) for line in client.get(f"/v1/jobs/{job_id}/results?format=jsonl").data.splitlines()]
    failed = [json.loads(line) for line in client.get(f"/v1/jobs/{job_id}/errors").data.splitlines()]
    assert sorted(line["custom_id"] for line in done + failed) == [f"r{i}" for i in range(5)]
    (error,) = failed
    assert error["error"]["code"] == "shard_attempts_exhausted"

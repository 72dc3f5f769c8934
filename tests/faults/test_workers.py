"""Worker faults, caused for real on worker processes: SIGKILL mid-shard, a broker redelivery while a shard
runs (tiny visibility timeout), SIGTERM, and a request that makes the engine raise."""

import signal
import time

import pytest

from store.models import utcnow
from tests.helpers import long_line

pytestmark = pytest.mark.slow


def test_sigkill_mid_shard_several_times(fresh_workers):
    h = fresh_workers
    ids = [f"k{i}" for i in range(24)]
    # a shard runs for at least 1.2 s (240 steps of at least 5 ms), however fast the machine decodes
    job = h.submit([long_line(cid, max_tokens=240) for cid in ids])
    assert job["shards"] == 6
    for kill in range(3):
        since = utcnow()
        worker = h.start_worker(step_delay_s=0.005)
        h.wait_running(job["id"], since)
        time.sleep(0.3)  # well inside the shard
        worker.kill(signal.SIGKILL)
        worker.wait()
        running = [s for s in h.shards(job["id"]) if s.status == "running"]
        assert running, f"kill {kill} did not land mid-shard"
    h.start_worker()
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "completed", done
    assert done["request_counts"]["completed"] == len(ids) and done["request_counts"]["failed"] == 0
    h.assert_exactly_once(done["id"], ids)
    assert max(s.attempts for s in h.shards(job["id"])) >= 2  # killed shards really ran again


def test_redelivery_during_a_long_shard_does_not_run_it_twice(fresh_workers):
    h = fresh_workers
    # Redis hands an unacknowledged message to another consumer after 1s; each shard runs for longer
    # (600 steps of at least 10 ms each, however fast the machine)
    worker = h.start_worker(
        concurrency=3,
        PAGEDBATCH_VISIBILITY_TIMEOUT_S="1",
        step_delay_s=0.01,
    )
    ids = [f"v{i}" for i in range(8)]
    job = h.submit([long_line(cid, max_tokens=600) for cid in ids])
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)
    assert "not running it twice" in worker.text()  # the redelivery really happened, and was skipped
    assert [s.attempts for s in h.shards(job["id"])] == [1, 1]


def test_sigterm_hands_unfinished_shards_back(fresh_workers):
    h = fresh_workers
    first = h.start_worker()
    ids = [f"t{i}" for i in range(16)]
    job = h.submit([long_line(cid, max_tokens=160) for cid in ids])
    h.wait_running(job["id"])
    t0 = time.monotonic()
    first.kill(signal.SIGTERM)
    first.wait(timeout=20)
    assert time.monotonic() - t0 < 10, "the worker did not stop promptly"
    assert "handed back" in first.text()
    shards = h.shards(job["id"])
    assert not [s for s in shards if s.status == "running"], [(s.id, s.status) for s in shards]
    h.start_worker()
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)


def test_request_that_makes_the_engine_raise_fails_alone(fresh_workers):
    h = fresh_workers
    h.start_worker(concurrency=3, engine_factory="tests.doubles:poisoned_engine", PAGEDBATCH_TEST_POISON="POISONPILL")
    ids = [f"p{i}" for i in range(12)]
    lines = [long_line(cid, max_tokens=8) for cid in ids]
    lines[5] = long_line("p5", content="please POISONPILL now", max_tokens=8)
    job = h.submit(lines)
    done = h.wait(job["id"], timeout=90)
    assert done["status"] == "completed"
    assert done["request_counts"]["completed"] == 11 and done["request_counts"]["failed"] == 1
    output, errors = h.assert_exactly_once(done["id"], ids)
    (error,) = errors
    assert error["custom_id"] == "p5" and error["error"]["code"] == "engine_error"
    assert "poisoned" in error["error"]["message"]
    # the worker keeps serving
    again = h.wait(h.submit([long_line("after", max_tokens=4)])["id"], timeout=60)
    assert again["status"] == "completed" and again["request_counts"]["completed"] == 1


def test_sigterm_with_a_drain_timeout_finishes_the_running_shards(fresh_workers):
    """What Kubernetes does to a worker it scales down: SIGTERM, then SIGKILL after the grace period. With
    a drain timeout inside that period the running shards finish here (no work thrown away) and the queued
    ones stay queued for the next worker."""
    h = fresh_workers
    first = h.start_worker(
        concurrency=2,
        step_delay_s=0.01,
        PAGEDBATCH_WORKER_DRAIN_S="60",
    )
    ids = [f"g{i}" for i in range(16)]
    job = h.submit([long_line(cid, max_tokens=150) for cid in ids])  # 4 shards of >= 1.5s each, 2 at a time
    h.wait_running(job["id"])
    running = {s.id for s in h.shards(job["id"]) if s.status == "running"}
    first.kill(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    shards = {s.id: s for s in h.shards(job["id"])}
    assert running and all(shards[sid].status == "done" and shards[sid].attempts == 1 for sid in running), [
        (s.id, s.status, s.attempts) for s in shards.values()
    ]
    assert [s for s in shards.values() if s.status == "queued"], "every shard ran: the drain took new ones"
    assert "handed back" not in first.text()
    h.start_worker()
    done = h.wait(job["id"], timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)
    assert all(s.attempts == 1 for s in h.shards(job["id"])), "a shard ran twice"


def test_a_drain_timeout_that_runs_out_hands_the_shards_back(fresh_workers):
    h = fresh_workers
    first = h.start_worker(
        concurrency=2,
        step_delay_s=0.2,
        PAGEDBATCH_WORKER_DRAIN_S="1",
    )
    ids = [f"h{i}" for i in range(8)]
    job = h.submit([long_line(cid, max_tokens=150) for cid in ids])  # shards of >= 30s
    h.wait_running(job["id"])
    t0 = time.monotonic()
    first.kill(signal.SIGTERM)
    first.wait(timeout=30)
    assert time.monotonic() - t0 < 20, "the worker outlived its drain timeout: it waited for the shards"
    assert "still running after 1s of drain" in first.text() and "handed back" in first.text()
    assert not [s for s in h.shards(job["id"]) if s.status == "running"]
    h.start_worker()
    done = h.wait(job["id"], timeout=240)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)

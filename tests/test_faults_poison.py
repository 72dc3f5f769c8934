"""Poison work (issue 12, finding 2): a shard that SIGKILLs its worker on every attempt is tried a limited
number of times, then its requests fail with a clear error, its job completes, and other jobs flow."""

import time

import pytest

from tests.helpers import long_line

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 2


def test_a_shard_that_kills_its_worker_every_time_ends_failed_after_the_limit(fresh_workers):
    h = fresh_workers
    env = {"PAGEDBATCH_TEST_KILL": "KILLPILL", "PAGEDBATCH_MAX_SHARD_ATTEMPTS": str(MAX_ATTEMPTS)}

    def start():
        return h.start_worker(concurrency=1, engine_factory="tests.doubles:killing_engine", **env)

    worker = start()
    poison_ids = [f"x{i}" for i in range(4)]
    lines = [long_line(cid, max_tokens=8) for cid in poison_ids]
    lines[2] = long_line("x2", content="please KILLPILL now", max_tokens=8)
    poison = h.submit(lines)
    other_ids = [f"ok{i}" for i in range(4)]
    other = h.submit([long_line(cid, max_tokens=8) for cid in other_ids])
    assert poison["shards"] == 1 and other["shards"] == 1

    deaths = 0
    deadline = time.monotonic() + 240
    while h.job(poison["id"])["status"] != "completed" or h.job(other["id"])["status"] != "completed":
        assert time.monotonic() < deadline, (h.job(poison["id"]), h.job(other["id"]), deaths)
        if worker.proc.poll() is not None:  # killed by the poison shard: start another (a supervisor's job)
            deaths += 1
            worker = start()
        time.sleep(0.2)
    assert deaths == MAX_ATTEMPTS  # every attempt killed its worker; the one past the limit did not run

    done = h.job(poison["id"])
    counts = done["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (4, 0, 4)
    output, errors = h.assert_exactly_once(done["id"], poison_ids)
    assert not output
    assert {e["error"]["code"] for e in errors} == {"shard_attempts_exhausted"}
    assert "2 times" in errors[0]["error"]["message"]
    (shard,) = h.shards(poison["id"])
    assert shard.attempts == MAX_ATTEMPTS + 1

    assert h.job(other["id"])["request_counts"]["completed"] == len(other_ids)
    h.assert_exactly_once(other["id"], other_ids)

"""Poison work (issue 12, finding 2): a shard that SIGKILLs its worker on every attempt is tried a limited
number of times, then bisected: its halves run as new shards with fresh attempts, down to the one request
that kills the worker, which fails alone with a clear error; the job completes, and other jobs flow."""

import time

import pytest

from tests.helpers import long_line

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 2


def test_a_shard_that_kills_its_worker_every_time_is_bisected_down_to_the_one_poison_request(fresh_workers):
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
    # [x0..x3] dies MAX_ATTEMPTS times and is split; [x0, x1] runs; [x2, x3] dies and is split; [x3] runs;
    # [x2] dies MAX_ATTEMPTS times and fails alone
    assert deaths == 3 * MAX_ATTEMPTS

    done = h.job(poison["id"])
    counts = done["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (4, 3, 1)
    output, errors = h.assert_exactly_once(done["id"], poison_ids)
    assert sorted(line["custom_id"] for line in output) == ["x0", "x1", "x3"]
    (error,) = errors
    assert error["custom_id"] == "x2" and error["error"]["code"] == "shard_attempts_exhausted"
    assert "2 times" in error["error"]["message"]
    shards = h.shards(poison["id"])
    assert [s.request_count for s in shards] == [4, 2, 2, 1, 1]
    assert [s.attempts for s in shards] == [MAX_ATTEMPTS + 1, 1, MAX_ATTEMPTS + 1, MAX_ATTEMPTS + 1, 1]
    assert [s.part_key is None for s in shards] == [True, False, True, False, False]  # the split ones: no part

    assert h.job(other["id"])["request_counts"]["completed"] == len(other_ids)
    h.assert_exactly_once(other["id"], other_ids)

"""A worker whose engine is split across two tensor-parallel ranks (`--tensor-parallel-size 2`, two
gloo processes): a REST job it serves has the same results as a single-process worker's, and killing
its second rank mid-job ends the worker (the shard's lease runs out) while another worker finishes the
job with every line exactly once."""

import signal
import subprocess

import pytest

from tests.helpers import chat_line, long_line

pytestmark = pytest.mark.slow

TP2 = ("--tensor-parallel-size=2",)


def _answers(h, job_id) -> dict[str, tuple]:
    output, errors = h.result_lines(job_id)
    assert not errors, errors
    return {
        line["custom_id"]: (
            line["response"]["body"]["choices"][0]["message"]["content"],
            line["response"]["body"]["usage"]["completion_tokens"],
        )
        for line in output
    }


def _rank_processes(worker) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(worker.proc.pid), "-f", "engine.parallel.rank_main"], capture_output=True, text=True
    ).stdout.split()
    return [int(pid) for pid in found]


def test_a_tensor_parallel_worker_gives_the_single_process_results(fresh_workers):
    h = fresh_workers
    lines = [chat_line(f"c{i}", f"question number {i} " * (1 + i % 5), max_tokens=12) for i in range(10)]
    worker = h.start_worker(extra_args=TP2)
    assert len(_rank_processes(worker)) == 1
    job = h.wait(h.submit(lines)["id"])
    assert job["status"] == "completed", job
    sharded = _answers(h, job["id"])
    h.stop_workers()
    h.start_worker()
    job = h.wait(h.submit(lines)["id"])
    assert job["status"] == "completed", job
    assert sharded == _answers(h, job["id"])
    assert len(sharded) == len(lines)


def test_killing_a_rank_mid_job_ends_the_worker_and_another_finishes_the_job(fresh_workers):
    h = fresh_workers
    ids = [f"k{i}" for i in range(12)]
    job = h.submit([long_line(cid, max_tokens=240) for cid in ids])
    worker = h.start_worker(extra_args=TP2)
    (rank1,) = _rank_processes(worker)
    h.wait_running(job["id"])
    subprocess.run(["kill", f"-{signal.SIGKILL}", str(rank1)], check=True)
    assert worker.wait(timeout=60) == 70  # the worker ends itself, with the reason in its log
    assert "the engine cannot go on" in worker.text() and "tensor-parallel" in worker.text()
    assert any(s.status == "running" for s in h.shards(job["id"]))  # its shard was taken mid-way
    h.start_worker()
    done = h.wait(job["id"], timeout=180)
    assert done["status"] == "completed", done
    assert done["request_counts"]["completed"] == len(ids) and done["request_counts"]["failed"] == 0
    h.assert_exactly_once(done["id"], ids)
    assert max(s.attempts for s in h.shards(job["id"])) >= 2

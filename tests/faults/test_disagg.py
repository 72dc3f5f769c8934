"""Prefill/decode disaggregation with real worker processes, PostgreSQL and Redis: a job on one
prefill and one decode worker equals the job on one `both` worker; SIGKILL of the decode worker
mid-job, or of the prefill worker mid-transfer, and the job still completes, each custom_id once."""

import re
import signal
import time

import pytest

from tests.helpers import chat_line, long_line

pytestmark = pytest.mark.slow

FAST_LIVENESS = {"PAGEDBATCH_PREFILL_LIVENESS_S": "1.5"}


def mixed_lines(prefix: str, count: int = 8) -> list[dict]:
    """Greedy and seeded requests of several prompt lengths."""
    lines = []
    for i in range(count):
        content = " ".join(["tell me a story about paged attention"] * (1 + i % 4))
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 1000 + i}
        lines.append(chat_line(f"{prefix}{i}", content, max_tokens=6 + i % 5, **sampling))
    return lines


def answers(h, job_id: str) -> dict:
    output, errors = h.result_lines(job_id)
    assert not errors, errors
    return {
        line["custom_id"]: (
            line["response"]["body"]["choices"][0]["message"]["content"],
            line["response"]["body"]["choices"][0]["finish_reason"],
            line["response"]["body"]["usage"]["completion_tokens"],
        )
        for line in output
    }


def wait_for_text(worker, pattern: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, worker.text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pattern!r} not in the worker's log:\n{worker.text()[-3000:]}")
        time.sleep(0.05)


def test_one_prefill_one_decode_equals_one_both_worker(fresh_workers):
    h = fresh_workers
    lines = mixed_lines("e")
    h.start_worker()
    single = h.wait(h.submit(lines)["id"])
    assert single["status"] == "completed"
    h.stop_workers()
    prefill = h.start_worker(role="prefill")
    h.start_worker(role="decode")
    split = h.wait(h.submit(lines)["id"])
    assert split["status"] == "completed"
    h.assert_exactly_once(split["id"], [line["custom_id"] for line in lines])
    assert answers(h, split["id"]) == answers(h, single["id"])
    assert prefill.text().count("sending KV of") == len(lines)  # every request was prefilled there


def test_sigkill_of_the_decode_worker_mid_job(fresh_workers):
    h = fresh_workers
    prefill = h.start_worker(role="prefill", **FAST_LIVENESS)
    # each decode step takes at least 10 ms, so 160 steps outlast the kill whatever the machine's speed
    decode = h.start_worker(role="decode", step_delay_s=0.01, **FAST_LIVENESS)
    ids = [f"d{i}" for i in range(8)]
    job = h.submit([long_line(cid, max_tokens=160) for cid in ids])
    wait_for_text(prefill, "sending KV of")  # the decode worker holds KV it received
    time.sleep(0.3)
    decode.kill(signal.SIGKILL)
    decode.wait()
    assert [s for s in h.shards(job["id"]) if s.status == "running"], "the kill did not land mid-job"
    h.start_worker(role="decode", **FAST_LIVENESS)
    done = h.wait(job["id"], timeout=180)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)
    # the dead worker's shards ran again, prefilled again on the prefill worker
    assert re.search(r"sending KV of \S+/2/", prefill.text())


def test_sigkill_of_the_prefill_worker_mid_transfer(fresh_workers):
    h = fresh_workers
    # a capped send rate makes each bundle take about a second, so the kill lands inside one
    prefill = h.start_worker(role="prefill", PAGEDBATCH_KV_MAX_SEND_MBPS="0.2", **FAST_LIVENESS)
    decode = h.start_worker(role="decode", **FAST_LIVENESS)
    ids = [f"p{i}" for i in range(8)]
    job = h.submit([long_line(cid, max_tokens=30) for cid in ids])
    wait_for_text(prefill, "sending KV of")
    time.sleep(0.2)
    prefill.kill(signal.SIGKILL)
    prefill.wait()
    done = h.wait(job["id"], timeout=180)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(ids)
    h.assert_exactly_once(done["id"], ids)
    assert "prefilling it here" in decode.text()  # the half-sent bundle was dropped, not imported

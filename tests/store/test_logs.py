"""Log lines as JSON or text, with the job, shard and tenant ids of the work in hand (store.logs)."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from store.logs import configure_logging, log_context, log_format


@pytest.fixture
def capture():
    """Root logging into a buffer, restored afterwards; yields (buffer, configure)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    yield buffer, lambda fmt: configure_logging("INFO", fmt, stream=buffer)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_json_lines_carry_the_context_ids(capture):
    buffer, configure = capture
    configure("json")
    log = logging.getLogger("pagedbatch.test")
    log.info("outside")
    with log_context(job_id="batch_1", tenant="acme"):
        with log_context(shard_id="batch_1.0"):
            log.info("inner %d", 1)
        log.warning("outer")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["outside", "inner 1", "outer", "failed"]
    assert "job_id" not in lines[0] and lines[0]["level"] == "INFO" and lines[0]["logger"] == "pagedbatch.test"
    assert {k: lines[1][k] for k in ("job_id", "shard_id", "tenant")} == {
        "job_id": "batch_1",
        "shard_id": "batch_1.0",
        "tenant": "acme",
    }
    assert "shard_id" not in lines[2] and lines[2]["job_id"] == "batch_1"
    assert "RuntimeError: boom" in lines[3]["exc_info"]


def test_text_lines_name_the_ids(capture):
    buffer, configure = capture
    configure("text")
    with log_context(job_id="batch_2", shard_id="batch_2.3", tenant=None):
        logging.getLogger("x").info("hello")
    line = buffer.getvalue().strip()
    assert line.endswith("INFO x: hello [job_id=batch_2 shard_id=batch_2.3]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_contexts_of_threads_do_not_mix(capture):
    buffer, configure = capture
    configure("json")
    barrier = threading.Barrier(4)

    def shard(i: int) -> None:
        with log_context(shard_id=f"s.{i}"):
            barrier.wait()  # every thread is inside its own context at once
            logging.getLogger("t").info("shard %d", i)

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert sorted((line["message"], line["shard_id"]) for line in lines) == [(f"shard {i}", f"s.{i}") for i in range(4)]


def test_format_from_the_environment_and_bad_values(monkeypatch):
    monkeypatch.delenv("PAGEDBATCH_LOG_FORMAT", raising=False)
    assert log_format() == "text"
    monkeypatch.setenv("PAGEDBATCH_LOG_FORMAT", "JSON")
    assert log_format() == "json" and log_format("text") == "text"
    monkeypatch.setenv("PAGEDBATCH_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="PAGEDBATCH_LOG_FORMAT"):
        log_format()
    with pytest.raises(ValueError, match="unknown log context"), log_context(user="x"):
        pass

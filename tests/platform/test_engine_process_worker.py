"""A worker whose engine runs in a process of its own (PAGEDBATCH_ENGINE_PROCESS=on): a job through the REST API
completes with what the offline engine generates, a cancelled job's requests leave that engine, and the
worker's metrics count the child's steps."""

from __future__ import annotations

import io
import os
import re
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from engine import LLM, SamplingParams
from tests.helpers import REPO, free_port, jsonl, process_alive, spawn, wait_for, wait_for_log
from tests.platform.model_deployment import model_deployment

MODEL = "tinyproc"


@pytest.fixture
def deployment(platform, tmp_path):
    with model_deployment(platform, tmp_path, MODEL, "qwen3") as deployment:
        yield deployment


def _line(custom_id: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def test_a_job_runs_through_an_engine_process(deployment, tmp_path):
    from flask.testing import FlaskClient

    from api.app import create_app

    settings, api_key, path = deployment
    log, port = tmp_path / "worker.log", free_port()
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1", "PAGEDBATCH_ENGINE_PROCESS": "on"}
    argv = [sys.executable, "-m", "pagedbatch", "worker", "--model", f"{MODEL}={path}", "--device=cpu"]
    proc = spawn([*argv, "--concurrency=2", f"--metrics-port={port}"], log, cwd=REPO, env=env)
    prompts = [f"line {i} says" + " more" * (i % 5) for i in range(12)]
    try:
        wait_for_log(proc, log, " ready.")
        engine_pid = int(re.search(r"in engine process (\d+)", log.read_text()).group(1))
        assert engine_pid != proc.pid
        client = FlaskClient(create_app(settings))
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {api_key}"
        lines = [_line(f"p-{i}", p, 5) for i, p in enumerate(prompts)]
        job = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(lines), content_type="application/x-ndjson")
        assert job.status_code == 201, job.get_json()
        done = wait_for(lambda: client.get(f"/v1/jobs/{job.get_json()['id']}").get_json(), timeout=180)
        assert done["status"] == "completed", done
        table = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{done['id']}/results").data)).to_pylist()

        # a job cancelled midway (its first shard done, long generations running): they leave the engine process
        long_lines = [_line(f"q-{i}", p, 2) for i, p in enumerate(prompts[:8])]
        long_lines += [_line(f"c-{i}", f"count {i}", 900) for i in range(24)]
        job = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(long_lines), content_type="application/x-ndjson")
        job_id = job.get_json()["id"]

        def first_shard():
            completed = client.get(f"/v1/jobs/{job_id}").get_json()["request_counts"]["completed"]
            return {"status": "go" if completed >= 8 else "wait"}

        wait_for(first_shard, statuses=("go",), timeout=120, poll=0.05)
        cancelled_at = time.monotonic()
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        cancelled = wait_for(lambda: client.get(f"/v1/jobs/{job_id}").get_json(), timeout=60, poll=0.05)
        assert cancelled["status"] == "cancelled", cancelled
        assert time.monotonic() - cancelled_at < 10, "the running requests were not aborted promptly"
        assert cancelled["request_counts"]["cancelled"] == 32 - cancelled["request_counts"]["completed"] > 0

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    llm = LLM(str(path))
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [r["custom_id"] for r in table] == [f"p-{i}" for i in range(len(prompts))]
    for row, want in zip(table, expected):
        assert row["status"] == "completed"
        assert row["output_text"] == want.outputs[0].text
    finished = float(re.search(rf'pagedbatch_requests_finished_total{{model="{MODEL}"}} (\S+)', metrics).group(1))
    assert finished >= len(prompts)
    assert re.search(rf'pagedbatch_engine_step_seconds_count{{model="{MODEL}"}} ([1-9]\S*)', metrics)
    assert not process_alive(engine_pid), "the engine process outlived its worker"

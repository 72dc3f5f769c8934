"""A mixture-of-experts model through the whole platform: a worker serving a tiny Qwen3-MoE model,
a REST job of chat and completion lines, results as Parquet equal to the offline engine's."""

import json
import os
import sys

import pyarrow.parquet as pq
import pytest

from engine import LLM, SamplingParams
from engine.testing.tiny import write_tiny_model
from pagedbatch.client import Client
from tests.helpers import REPO, chat_line, completion_line, jsonl, spawn, wait_for_log

MOE_MODEL = "tiny-moe"


@pytest.fixture(scope="module")
def moe_worker(platform):
    """A second worker process, serving only the MoE model (it registers it, so the API accepts it)."""
    path = write_tiny_model(platform.tmp / "tiny-qwen3-moe", arch="qwen3_moe")
    log = platform.tmp / "moe-worker.log"
    env = {**os.environ, **platform.settings.to_env(), "PYTHONUNBUFFERED": "1"}
    proc = spawn(
        [
            sys.executable,
            "-m",
            "pagedbatch",
            "worker",
            "--model",
            f"{MOE_MODEL}={path}",
            "--concurrency=2",
            "--device=cpu",
        ],
        log=log,
        cwd=REPO,
        env=env,
    )
    try:
        wait_for_log(proc, log, " ready.", timeout=180)
        yield path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:  # a worker that will not stop is killed
            proc.kill()


def test_moe_job_end_to_end(live_url, platform, moe_worker, tmp_path):
    client = Client(live_url, api_key=platform.api_key)
    prompts = [f"prompt number {i}: the quick brown fox" for i in range(6)]
    lines = [
        completion_line(f"p-{i}", p, max_tokens=6, model=MOE_MODEL, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    lines += [chat_line(f"c-{i}", f"question {i}", max_tokens=4, model=MOE_MODEL) for i in range(4)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(lines))
    job = client.submit(src, model=MOE_MODEL)
    job = client.wait(job["id"], timeout=180, poll_s=0.2)
    assert job["status"] == "completed", job
    assert job["request_counts"]["completed"] == 10 and job["request_counts"]["failed"] == 0

    rows = pq.read_table(client.download(job["id"], tmp_path / "r.parquet")).to_pylist()
    assert [r["status"] for r in rows] == ["completed"] * 10
    texts = {
        r["custom_id"]: json.loads(r["response_body"])["choices"][0]["text"]
        for r in rows
        if r["custom_id"].startswith("p-")
    }
    # greedy completions equal the offline engine's on the same model
    offline = LLM(str(moe_worker)).generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [texts[f"p-{i}"] for i in range(6)] == [o.outputs[0].text for o in offline]
    assert sum(r["completion_tokens"] for r in rows if r["custom_id"].startswith("p-")) == 36

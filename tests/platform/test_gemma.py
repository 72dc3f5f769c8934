"""A Gemma 3 model end to end through the REST API and a real worker: a chat job's Parquet results hold
what the offline engine generates for the same conversations."""

from __future__ import annotations

import io
import json
import os
import sys

import pyarrow.parquet as pq
import pytest

from engine import LLM, SamplingParams
from tests.helpers import REPO, jsonl, spawn, wait_for, wait_for_log
from tests.platform.model_deployment import model_deployment

GEMMA = "gemma"


@pytest.fixture
def gemma_deployment(platform, tmp_path):
    """A deployment of its own (database, queues) serving a tiny Gemma 3 image-text checkpoint."""
    with model_deployment(platform, tmp_path, GEMMA, "gemma3-mm") as deployment:
        yield deployment


def _chat(custom_id: str, content: str) -> dict:
    body = {
        "model": GEMMA,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


@pytest.mark.slow
def test_gemma_chat_job_to_parquet(gemma_deployment, tmp_path):
    from flask.testing import FlaskClient

    from api.app import create_app

    settings, api_key, path = gemma_deployment
    log = tmp_path / "worker.log"
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    proc = spawn(
        [sys.executable, "-m", "pagedbatch", "worker", "--model", f"{GEMMA}={path}", "--concurrency=2", "--device=cpu"],
        log,
        cwd=REPO,
        env=env,
    )
    questions = [f"question {i}: how are you today?" * (1 + i % 4) for i in range(10)]  # past the 12-token window
    try:
        wait_for_log(proc, log, " ready.")
        client = FlaskClient(create_app(settings))
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {api_key}"
        lines = [_chat(f"g-{i}", q) for i, q in enumerate(questions)]
        job = client.post(f"/v1/jobs?model={GEMMA}", data=jsonl(lines), content_type="application/x-ndjson")
        assert job.status_code == 201, job.get_json()
        job_id = job.get_json()["id"]
        done = wait_for(lambda: client.get(f"/v1/jobs/{job_id}").get_json(), timeout=180)
        assert done["status"] == "completed", done
        assert done["request_counts"]["completed"] == len(questions)
        table = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{job_id}/results").data)).to_pylist()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    llm = LLM(str(path))
    expected = llm.chat(
        [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q in questions],
        SamplingParams(temperature=0, max_tokens=6),
        use_tqdm=False,
    )
    assert [r["custom_id"] for r in table] == [f"g-{i}" for i in range(len(questions))]
    for row, want in zip(table, expected):
        assert row["status"] == "completed"
        assert want.outputs[0].text and json.dumps(want.outputs[0].text)[1:-1] in json.dumps(row, default=str), row

"""An image-text model end to end through the REST API and a real worker: a 50-line job mixing text
lines and image lines (data URLs, and http URLs from a local server the worker's guard is configured to
allow) completes with the offline engine's tokens; lines with an undecodable or oversized image, or a URL
to 127.0.0.1, 169.254.169.254 or a private address get per-line errors; every other line completes."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from engine import LLM, SamplingParams
from tests.helpers import REPO, jsonl, spawn, wait_for
from tests.platform.model_deployment import model_deployment
from tests.vision_helpers import ALLOWED_HOST, data_url, picture
from tests.workers.test_vision_lines import chat, image, text

MODEL = "vlm"


@pytest.fixture
def vision_deployment(platform, tmp_path, request):
    """A deployment of its own (database, queues) serving a tiny image-text checkpoint of `request.param`."""
    with model_deployment(platform, tmp_path, MODEL, request.param) as deployment:
        yield deployment


@pytest.mark.slow
@pytest.mark.parametrize("vision_deployment", ["llava", "qwen2.5-vl"], indirect=True)
def test_vision_job_to_parquet(vision_deployment, image_server, tmp_path, monkeypatch):
    from flask.testing import FlaskClient

    from api.app import create_app

    settings, api_key, path = vision_deployment
    base, port = image_server
    limits = {"PAGEDBATCH_IMAGE_FETCH_ALLOW": f"{ALLOWED_HOST}/32", "PAGEDBATCH_IMAGE_MAX_PIXELS": "100000"}
    for key, value in limits.items():
        monkeypatch.setenv(key, value)  # the API's validation runs in this process
    good = {}
    for i in range(45):
        kind = i % 3
        parts = [text(f"question {i}: how are you today?")]
        if kind == 1:
            parts.append(image(data_url(picture(100 + i % 7, 30 + i % 5, 40))))
        elif kind == 2:
            parts.append(image(f"{base}/cat.png"))
        good[f"ok-{i}"] = parts
    bad = {
        "undecodable": ([image("data:image/png;base64,aGVsbG8gd29ybGQ=")], "invalid_image"),
        "oversized": ([image(data_url(picture(14, 400, 300)))], "image_too_large"),
        "loopback": ([image(f"http://127.0.0.1:{port}/cat.png")], "url_forbidden"),
        "metadata": ([image("http://169.254.169.254/latest/meta-data/")], "url_forbidden"),
        "private": ([image("http://192.168.1.10/cat.png")], "url_forbidden"),
    }
    lines = [chat(k, v, model=MODEL) for k, v in good.items()] + [chat(k, v[0], model=MODEL) for k, v in bad.items()]
    assert len(lines) == 50
    log = tmp_path / "worker.log"
    env = {**os.environ, **settings.to_env(), **limits, "PYTHONUNBUFFERED": "1"}
    proc = spawn(
        [sys.executable, "-m", "pagedbatch", "worker", "--model", f"{MODEL}={path}", "--concurrency=2", "--device=cpu"],
        log,
        cwd=REPO,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while " ready." not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        client = FlaskClient(create_app(settings))
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {api_key}"
        job = client.post(f"/v1/jobs?model={MODEL}", data=jsonl(lines), content_type="application/x-ndjson")
        assert job.status_code == 201, job.get_json()
        job_id = job.get_json()["id"]
        done = wait_for(lambda: client.get(f"/v1/jobs/{job_id}").get_json(), timeout=240)
        assert done["status"] == "completed", done
        table = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{job_id}/results").data)).to_pylist()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a loaded machine: the warm shutdown may take longer; ours only
            proc.kill()
            proc.wait(timeout=30)
    rows = {r["custom_id"]: r for r in table}
    assert {k: rows[k]["error_code"] for k in bad} == {k: v[1] for k, v in bad.items()}
    llm = LLM(str(path))
    expected = llm.chat(
        [[{"role": "user", "content": parts}] for parts in good.values()],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )
    for custom_id, want in zip(good, expected):
        assert rows[custom_id]["status"] == "completed", rows[custom_id]
        assert rows[custom_id]["output_token_ids"] == want.outputs[0].token_ids, custom_id
        assert rows[custom_id]["prompt_tokens"] == len(want.prompt_token_ids)

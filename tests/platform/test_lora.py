"""LoRA adapters through the whole platform: a worker serving a tiny Llama with three PEFT adapters
(`--lora NAME=DIR`); `/v1/models` lists them with their base (`parent`); one REST batch mixes the base
and the adapters line by line, and each line's greedy output equals PEFT's (`PeftModel`) token for token;
a line naming an unknown adapter is a per-line error that lists the known names."""

import io
import json
import os
import random
import sys
import time

import pytest
from transformers import AutoTokenizer

from engine.testing.tiny import write_tiny_model
from tests.engine.lora_adapters import peft_reference, write_adapters
from tests.helpers import REPO, jsonl, spawn, wait_for

openai = pytest.importorskip("openai")
BASE = "tiny-lora-base"


@pytest.fixture(scope="module")
def lora_worker(platform):
    path = write_tiny_model(platform.tmp / "tiny-llama-lora", arch="llama")
    adapters = write_adapters(path, platform.tmp / "adapters")
    log = platform.tmp / "lora-worker.log"
    env = {**os.environ, **platform.settings.to_env(), "PYTHONUNBUFFERED": "1"}
    proc = spawn(
        [
            sys.executable,
            "-m",
            "pagedbatch",
            "worker",
            "--model",
            f"{BASE}={path}",
            "--concurrency=2",
            "--device=cpu",
            "--max-loras=2",
            *[f"--lora={n}={d}" for n, d in adapters.items()],
        ],
        log=log,
        cwd=REPO,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        while " ready." not in (log.read_text(errors="replace") if log.exists() else ""):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.2)
        yield path, adapters
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - a worker that will not stop is killed
            proc.kill()


@pytest.fixture(scope="module")
def oai(live_url, platform):
    return openai.OpenAI(base_url=live_url + "/v1", api_key=platform.api_key, max_retries=0)


def test_models_list_adapters_with_their_base(oai, lora_worker):
    path, adapters = lora_worker
    listed = {m.id: m.model_dump() for m in oai.models.list().data}
    assert listed[BASE]["parent"] is None and listed[BASE]["root"] == str(path)
    for name, directory in adapters.items():
        assert listed[name]["parent"] == BASE and listed[name]["root"] == directory


def test_one_job_mixes_adapters_and_base_and_matches_peft(oai, lora_worker):
    path, adapters = lora_worker
    rng = random.Random(11)
    prefix = [rng.randrange(512) for _ in range(36)]  # shared by every line: the prefix cache is used
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    max_tokens = [8] * len(prompts)
    models = [BASE, *adapters]
    lines = [
        {
            "custom_id": f"{model}/{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        }
        for i, prompt in enumerate(prompts)
        for model in models
    ]
    lines.append(
        {
            "custom_id": "unknown",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "no-such-adapter", "prompt": "hi", "max_tokens": 2},
        }
    )
    uploaded = oai.files.create(file=("lora.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window="24h",
        extra_body={"on_invalid_lines": "skip"},
    )
    batch = wait_for(lambda: oai.batches.retrieve(batch.id).model_dump(), timeout=240)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": len(lines), "completed": len(lines) - 1, "failed": 1}

    errors = [json.loads(x) for x in oai.files.content(batch["error_file_id"]).read().splitlines()]
    assert [e["custom_id"] for e in errors] == ["unknown"]
    message = json.dumps(errors[0])
    assert all(name in message for name in adapters), message  # the known names are listed

    texts = {}
    for row in map(json.loads, oai.files.content(batch["output_file_id"]).read().splitlines()):
        body = row["response"]["body"]
        texts[row["custom_id"]] = body["choices"][0]["text"]
        assert body["model"] == row["custom_id"].split("/")[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    for model in models:
        expected = peft_reference(path, adapters.get(model), prompts, max_tokens)
        for i, tokens in enumerate(expected):
            expected_text = tokenizer.decode(tokens, skip_special_tokens=True)  # as the response text
            assert texts[f"{model}/{i}"] == expected_text, f"{model} line {i} differs from PEFT"

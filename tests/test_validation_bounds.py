"""Validation bounded by configuration, not by input: over-long prompts rejected before being
tokenized whole."""

from __future__ import annotations

import dataclasses
import io
import json
import resource
import time

import pytest

from batchfile.errors import CONTEXT_LENGTH_EXCEEDED, LineError
from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.prompts import SCREEN_CHARS
from batchfile.request import COMPLETIONS_URL
from engine.tiny import write_tiny_model


@pytest.fixture(scope="module")
def limits(tmp_path_factory) -> ModelLimits:
    path = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", arch="qwen3")
    return ModelLimits.from_dir(path, name="tiny")


def completion(custom_id: str, prompt: str, **body) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": prompt, **body}}
    return json.dumps(line).encode() + b"\n"


def parse(limits: ModelLimits, data: bytes) -> list:
    return list(parse_requests(io.BytesIO(data), {limits.name: limits}))


def test_an_8mb_prompt_is_rejected_fast_without_tokenizing_it(limits):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    (result,) = parse(limits, completion("big", "x " * 4_000_000, model="tiny"))
    elapsed = time.monotonic() - start
    assert isinstance(result, LineError) and result.code == CONTEXT_LENGTH_EXCEEDED
    assert "at least" in result.message
    assert elapsed < 5, elapsed  # tokenizing it whole took 20 s and 2.6 GB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 300 * 1024  # KiB on Linux


@pytest.mark.parametrize("word", ["x ", "hello world. ", "no-spaces-at-all-"])
def test_screening_never_rejects_a_prompt_that_fits(limits, word):
    text = word * (3 * SCREEN_CHARS // len(word))
    exact = len(limits.encode([text], add_special_tokens=True)[0])
    fits = dataclasses.replace(limits, max_model_len=exact + 1)
    (ok,) = parse(fits, completion("fits", text, model="tiny", max_tokens=1))
    assert not isinstance(ok, LineError), ok
    assert len(ok.prompt_token_ids) == exact
    too_small = dataclasses.replace(limits, max_model_len=exact // 2)
    (bad,) = parse(too_small, completion("over", text, model="tiny", max_tokens=1))
    assert isinstance(bad, LineError) and bad.code == CONTEXT_LENGTH_EXCEEDED


def test_concurrent_validations_are_bounded(platform):
    from api.platform import EXTENSION

    app = platform.app(default_tenant="busy", max_concurrent_validations=1, validation_wait_s=0.2)
    client = app.test_client()
    body = completion("a", "hi", model="tiny")
    slots = app.extensions[EXTENSION].validations
    assert slots.acquire(timeout=1)  # another upload is being validated
    try:
        busy = client.post("/v1/jobs?model=tiny", data=body, content_type="application/x-ndjson")
        assert busy.status_code == 503 and busy.headers["Retry-After"]
        assert busy.get_json()["error"]["code"] == "server_busy"
        assert client.get("/v1/files").get_json()["data"] == []  # its upload is not kept
    finally:
        slots.release()
    assert client.post("/v1/jobs?model=tiny", data=body, content_type="application/x-ndjson").status_code == 201

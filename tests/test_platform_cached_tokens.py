"""Prefix-cache hits reach the batch's usage: requests sharing a long prefix report cached_tokens in their
output lines, and the batch (`usage.input_tokens_details.cached_tokens`, checked with the openai client's
`Batch` type) and the native job (`usage.prompt_tokens_details.cached_tokens`) report their sum."""

from __future__ import annotations

import io
import json
import urllib.request

import pytest

from tests.helpers import completion_line, jsonl, wait_for

openai = pytest.importorskip("openai")
from openai import types as oat  # noqa: E402

PREFIX = "The quick brown fox jumps over the lazy dog while counting sheep. " * 12


def test_batch_usage_sums_the_lines_cached_tokens(live_url, worker):
    oai = openai.OpenAI(base_url=live_url + "/v1", api_key=worker.api_key, max_retries=0)
    lines = [completion_line(f"c-{i}", f"{PREFIX}Item {i}:", max_tokens=2) for i in range(8)]  # one shard
    file = oai.files.create(file=("prefix.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = oai.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(lambda: oai.batches.retrieve(batch.id).model_dump(), timeout=180)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == len(lines), done
    typed = oat.Batch.model_validate(done)
    output = [json.loads(x) for x in oai.files.content(done["output_file_id"]).read().splitlines()]
    usages = [line["response"]["body"]["usage"] for line in output]
    per_line = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert all(0 <= c <= u["prompt_tokens"] for c, u in zip(per_line, usages))
    assert sum(per_line) > 0  # the shared prefix was served from the cache
    assert typed.usage.input_tokens_details.cached_tokens == sum(per_line)
    assert typed.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)

    request = urllib.request.Request(f"{live_url}/v1/jobs/{batch.id}", headers=worker.auth())
    with urllib.request.urlopen(request) as response:
        job = json.loads(response.read())
    assert job["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(per_line)

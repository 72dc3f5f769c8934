"""Prefix-cache hits reach the batch's usage: requests sharing a long prefix report cached_tokens in their
output lines, and the batch (`usage.input_tokens_details.cached_tokens`, checked with the openai client's
`Batch` type) and the native job (`usage.prompt_tokens_details.cached_tokens`) report their sum, also
while a shard is still running."""

from __future__ import annotations

import io
import json
import urllib.request

import pytest

from store.lifecycle.shards import claim_shard, report_progress
from tests.helpers import MODEL, completion_line, jsonl, validated, wait_for
from workers.progress import ProgressBoard, ShardProgress

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


def test_running_shard_reports_its_cached_tokens(platform):
    # a queue no worker listens to: the shard is claimed and its progress reported here
    app = platform.app(queue_prefix="pbtest-nocache-" + platform.settings.queue_prefix)
    client = app.test_client()
    r = client.post(
        f"/v1/jobs?model={MODEL}",
        data=jsonl([completion_line(f"r{i}", "hi") for i in range(3)]),
        content_type="application/x-ndjson",
    )
    assert r.status_code == 201
    settings, job = app.extensions["pagedbatch"].settings, validated(client, r)
    shard_id = f"{job['id']}.00000"
    claim = claim_shard(settings, shard_id, "test")
    progress = ShardProgress(ProgressBoard(), settings, shard_id, claim.attempt)
    for status, cached in (("completed", 16), ("completed", 5), ("failed", None)):
        progress.add({"status": status, "prompt_tokens": 20, "completion_tokens": 2, "cached_tokens": cached})
    progress.close()
    report_progress(settings, shard_id, claim.attempt, progress.counts)
    live = client.get(f"/v1/jobs/{job['id']}").get_json()
    assert live["status"] == "in_progress" and live["usage"]["prompt_tokens_details"]["cached_tokens"] == 21
    assert live["usage"]["prompt_tokens"] == 40

"""Batch lines with images (`image_url` chat parts, `input_image` in /v1/responses) through
`pagedbatch run`'s offline path: the same tokens as LLM.chat on the same conversations (data URLs and
http URLs from a local server the guard is configured to allow), and per-line errors with their own
codes for undecodable, oversized and forbidden-address images, while every other line completes."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from engine import LLM, SamplingParams
from tests.vision_helpers import ALLOWED_HOST, data_url, picture
from workers.offline import run_offline


def chat(custom_id, parts, **body):
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": parts}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def image(url, detail=None):
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def text(value):
    return {"type": "text", "text": value}


@pytest.mark.parametrize("arch", ["llava", "gemma3-vl", "qwen2.5-vl"])
def test_image_lines_offline(tiny_model, tmp_path, monkeypatch, image_server, arch):
    base, port = image_server
    monkeypatch.setenv("PAGEDBATCH_IMAGE_FETCH_ALLOW", f"{ALLOWED_HOST}/32")
    monkeypatch.setenv("PAGEDBATCH_IMAGE_MAX_PIXELS", "100000")
    path = tiny_model(arch)
    one, two, three = picture(11, 50, 40), picture(12, 30, 60), picture(13, 25, 25)
    good = {
        "one": [text("What is this? "), image(data_url(one), "low")],
        "two": [image(data_url(two)), text(" and "), image(data_url(three), "high"), text(" compare")],
        "text": [text("Hello, world! How are you today?")],
        "http": [text("Look: "), image(f"{base}/cat.png")],
    }
    bad = {  # custom_id: (parts, error code)
        "undecodable": ([image("data:image/png;base64,aGVsbG8gd29ybGQ=")], "invalid_image"),
        "oversized": ([image(data_url(picture(14, 400, 300)))], "image_too_large"),
        "loopback": ([image(f"http://127.0.0.1:{port}/cat.png")], "url_forbidden"),
        "metadata": ([image("http://169.254.169.254/latest/meta-data/")], "url_forbidden"),
        "private": ([image("http://10.1.2.3/cat.png")], "url_forbidden"),
        "by-name": ([image(f"http://localhost:{port}/cat.png")], "url_forbidden"),  # caught by the worker
        "missing": ([image(f"{base}/nothing.png")], "image_fetch_failed"),  # the worker's fetch fails
    }
    lines = [chat(k, v) for k, v in good.items()] + [chat(k, v[0]) for k, v in bad.items()]
    lines.append(
        {
            "custom_id": "responses",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "m",
                "max_output_tokens": 8,
                "temperature": 0,
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Describe: "},
                            {"type": "input_image", "image_url": data_url(one)},
                        ],
                    }
                ],
            },
        }
    )
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    llm = LLM(str(path), max_num_batched_tokens=32)
    summary = run_offline(tmp_path / "in.jsonl", tmp_path / "out.parquet", path, progress=False, llm=llm)
    rows = {r["custom_id"]: r for r in pq.read_table(summary.output_path).to_pylist()}
    assert {k: rows[k]["error_code"] for k in bad} == {k: v[1] for k, v in bad.items()}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    conversations = [[{"role": "user", "content": parts}] for parts in good.values()]
    conversations.append([{"role": "user", "content": [text("Describe: "), image(data_url(one))]}])
    expected = llm.chat(conversations, params, use_tqdm=False)
    for custom_id, out in zip([*good, "responses"], expected):
        row = rows[custom_id]
        assert row["status"] == "completed", (custom_id, row["error_message"])
        assert row["output_token_ids"] == out.outputs[0].token_ids, custom_id
        assert row["prompt_tokens"] == len(out.prompt_token_ids)  # the image tokens counted
    assert rows["one"]["prompt_tokens"] > rows["text"]["prompt_tokens"]

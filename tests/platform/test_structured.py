"""Structured outputs and tools through the platform: lines validated by the API, carried in the
shard input to a real worker, constrained there, and answered in the JSONL output."""

import json

import jsonschema

from pagedbatch.client import Client
from tests.helpers import MODEL, chat_line, completion_line, jsonl

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}


def test_constrained_lines_through_a_worker(live_url, worker, tmp_path):
    client = Client(live_url, api_key=worker.api_key)
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}
    lines = [
        chat_line("schema", "hi", max_tokens=60, response_format=fmt, temperature=1.0, seed=1),
        completion_line("choice", "x", max_tokens=8, structured_outputs={"choice": ["left", "right"]}),
        chat_line("tool", "hi", max_tokens=60, tools=[TOOL], tool_choice="required", seed=2),
        chat_line(
            "bad",
            "hi",
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}},
        ),
        chat_line("greedy-n", "hi", max_tokens=3, n=2, temperature=0),
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(lines))
    job = client.wait(client.submit(src, model=MODEL)["id"], timeout=120, poll_s=0.2)
    assert job["status"] == "completed", job
    assert job["request_counts"]["completed"] == 4 and job["request_counts"]["invalid"] == 1
    assert job["errors"][0]["line"] == 4 and "type 'objekt'" in job["errors"][0]["message"]

    out = client.download(job["id"], tmp_path / "r.jsonl", fmt="jsonl").read_text().splitlines()
    bodies = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, out)}
    jsonschema.validate(json.loads(bodies["schema"]["choices"][0]["message"]["content"]), SCHEMA)
    assert bodies["choice"]["choices"][0]["text"] in ("left", "right")
    call = bodies["tool"]["choices"][0]
    assert call["finish_reason"] == "tool_calls"
    for c in call["message"]["tool_calls"]:
        assert c["function"]["name"] == "pick"
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMA)
    greedy = bodies["greedy-n"]["choices"]
    assert len(greedy) == 2 and greedy[0]["message"]["content"] == greedy[1]["message"]["content"]
